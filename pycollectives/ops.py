"""Reduction operators, and the names of collectives, algorithms and dtypes.

The names come from the native core (``_C``), in code order: a name's index is the code the
core takes, so no Python table can drift from it.
"""

from __future__ import annotations

from pycollectives import _C

COLLECTIVES: tuple = _C.COLLECTIVES
DTYPES: tuple = _C.DTYPES
# Algorithm names (without "auto"), and those each collective has.
ALGORITHMS: tuple = _C.ALGORITHMS[1:]
ALGORITHMS_FOR: dict = dict(_C.ALGORITHMS_FOR)
# Collectives that reduce (take op=).
REDUCING: tuple = _C.REDUCING


# Element-wise reductions, an IntEnum whose values are the core's op codes (made by the core
# from its own table: its one-step path takes the members as they are).
ReduceOp = _C.ReduceOp
ReduceOp.__doc__ = (
    "Element-wise reduction. ``AVG`` is the sum divided by the number of ranks (floats only)."
)

SUM = ReduceOp.SUM
PROD = ReduceOp.PROD
MIN = ReduceOp.MIN
MAX = ReduceOp.MAX
AVG = ReduceOp.AVG
assert tuple(o.name.lower() for o in ReduceOp) == _C.OPS, "ReduceOp out of step with the core"

# Names a caller may pass as `op`: "sum", "SUM", ... (the core's table, which run_now reads).
_OP_NAMES: dict = _C.OP_NAMES
# Twins in torch.distributed.ReduceOp (by name) and mpi4py's MPI.Op (by identity): the one
# translation table to and from torch's names (op_code, the torch backend, gloo between nodes).
TORCH_OPS = {"SUM": SUM, "PRODUCT": PROD, "MIN": MIN, "MAX": MAX, "AVG": AVG}
_TORCH_NAMES = {op: name for name, op in TORCH_OPS.items()}
_MPI_TWINS = ("SUM", "PROD", "MIN", "MAX")


def torch_op_name(op) -> str:
    """The name of a torch.distributed.ReduceOp, or of the RedOpType it wraps ("SUM",
    "PRODUCT", "BAND", ...); its repr if it has none."""
    name = getattr(op, "name", None)  # a RedOpType
    if name is None:  # a ReduceOp object: the RedOpType it wraps
        name = getattr(getattr(op, "op", None), "name", None)
    return repr(op) if name is None else str(name)


def torch_name(op) -> str:
    """torch.distributed.ReduceOp's name for one of ours (a ReduceOp or its code)."""
    return _TORCH_NAMES[ReduceOp(op)]


def _torch_op(op):
    """The twin of a torch.distributed.ReduceOp, None if `op` is not one; TypeError if it has
    no twin here (BAND, BOR, BXOR, PREMUL_SUM)."""
    if not type(op).__module__.startswith("torch."):
        return None
    name = torch_op_name(op)
    if name not in TORCH_OPS:
        raise TypeError(f"op: torch.distributed.ReduceOp.{name} has no pycollectives equivalent")
    return TORCH_OPS[name]


def _mpi_op(op):
    """The twin of an mpi4py MPI.Op, None if `op` is not one; TypeError if it has no twin."""
    if type(op).__module__ != "mpi4py.MPI" or type(op).__name__ != "Op":
        return None
    from mpi4py import MPI

    for name in _MPI_TWINS:
        if op == getattr(MPI, name):
            return ReduceOp[name]
    raise TypeError(f"op: MPI.Op {op!r} has no pycollectives equivalent (sum, prod, min, max)")


def op_code(op) -> int:
    """Native code of `op`: a ReduceOp (pc.SUM, ...) or its name ("sum", ...), or the twin of a
    torch.distributed.ReduceOp or an mpi4py MPI.Op. Anything else, plain integers included, is a
    TypeError: an integer could mean another library's numbering."""
    if type(op) is ReduceOp:
        return op._value_
    if isinstance(op, str):
        try:
            return int(_OP_NAMES[op])
        except KeyError:
            raise ValueError(
                f"op must be one of {', '.join(o.name.lower() for o in ReduceOp)}, got {op!r}"
            ) from None
    twin = _torch_op(op)
    if twin is None:
        twin = _mpi_op(op)
    if twin is None:
        raise TypeError(
            f"op must be a pycollectives ReduceOp (pc.SUM, ...), its name, or a torch.distributed"
            f".ReduceOp or MPI.Op with a twin here, got {op!r} of type {type(op).__name__}"
        )
    return int(twin)


_ALGO_CODES = {name: code for code, name in enumerate(_C.ALGORITHMS)}
_ALGO_CODES[None] = 0


def algo_code(algorithm) -> int:
    """Native code of an algorithm name (None or "auto": automatic choice)."""
    try:
        return _ALGO_CODES[algorithm]
    except (KeyError, TypeError):
        raise ValueError(
            f"algorithm must be None or one of {', '.join(ALGORITHMS)}, got {algorithm!r}"
        ) from None


def collective_code(collective: str) -> int:
    """Native code of a collective name."""
    return COLLECTIVES.index(collective)


def dtype_code(name: str) -> int:
    """Native code of a dtype name ("float32", ...), -1 when unsupported."""
    return DTYPES.index(name) if name in DTYPES else -1


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw factor, with algbw = bytes / time and bytes the full vector
    (all_reduce, broadcast, reduce), the gathered or scattered whole (all_gather,
    reduce_scatter, all_to_all, gather, scatter), or one message (sendrecv)."""
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}")
    if nranks <= 1:
        return 1.0
    return (2 if collective == "all_reduce" else 1) * (nranks - 1) / nranks
