"""Reduction operators and algorithm names."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """Element-wise reduction. ``AVG`` is the sum divided by the number of ranks (floats only)."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4


SUM = ReduceOp.SUM
PROD = ReduceOp.PROD
MIN = ReduceOp.MIN
MAX = ReduceOp.MAX
AVG = ReduceOp.AVG

# Anything a caller may pass as `op`, mapped to the native code.
_OP_CODES: dict = {}
for _op in ReduceOp:
    _OP_CODES[_op] = int(_op)
    _OP_CODES[_op.name] = int(_op)
    _OP_CODES[_op.name.lower()] = int(_op)

# Algorithm names and their native codes; None means "choose automatically".
ALGORITHMS = ("ring", "tree", "direct")
_ALGO_CODES = {None: 0, "auto": 0, "ring": 1, "tree": 2, "direct": 3}


def op_code(op) -> int:
    """Native code of `op` (a ReduceOp or its name), or a ValueError naming the choices."""
    try:
        return _OP_CODES[op]
    except (KeyError, TypeError):
        raise ValueError(
            f"op must be one of {', '.join(o.name.lower() for o in ReduceOp)}, got {op!r}"
        ) from None


def algo_code(algorithm) -> int:
    """Native code of an algorithm name (None or "auto": automatic choice)."""
    try:
        return _ALGO_CODES[algorithm]
    except (KeyError, TypeError):
        raise ValueError(
            f"algorithm must be None or one of {', '.join(ALGORITHMS)}, got {algorithm!r}"
        ) from None
