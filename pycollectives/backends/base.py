"""What every backend shares: the call a Communicator hands it (``Call``), point-to-point
operations (``P2POp``), and "every rank reports, one exchange, raise on every rank"
(``gathered_or_raise``, ``same_on_every_rank``)."""

from __future__ import annotations

from collections import namedtuple
from typing import NamedTuple

from pycollectives import _C
from pycollectives.errors import CollectiveError

# Every field but the collective and x, with its default. The fields and their order are the
# core's (_C.CALL_FIELDS, csrc/python/call_args.h): it reads a Call by position.
_CALL_DEFAULTS = {
    "out": None,
    "op": 0,  # native codes
    "root": 0,
    "algorithm": 0,  # 0: automatic
    "async_op": False,
    "stream": None,  # a GPU stream (object or handle); None: the arrays' library's current one
    "counts": None,  # uneven all_gather / reduce_scatter
    "in_splits": None,  # all_to_all
    "out_splits": None,
    "reproducible": None,  # reductions in rank order; None: the communicator's setting
}


class Call(
    namedtuple("Call", _C.CALL_FIELDS, defaults=[_CALL_DEFAULTS[f] for f in _C.CALL_FIELDS[2:]])
):
    """One collective as the Communicator hands it to a backend, the one descriptor every
    backend takes (host, nodes, CUDA, the emulated device): ``Call(collective, x, out=None,
    op=0, root=0, algorithm=0, async_op=False, stream=None, counts=None, in_splits=None,
    out_splits=None, reproducible=None)``. Names and codes are checked; arrays not yet (each
    backend checks its own kind of array before anything moves). A tuple, which the native
    layers read by position."""

    __slots__ = ()


class _P2POp(NamedTuple):
    kind: str
    array: object
    peer: int
    tag: int = 0


class P2POp(_P2POp):
    """One point-to-point operation of ``Communicator.batch_p2p``: ``kind`` "send" or "recv",
    the array sent or received into, the peer rank, and a tag (an int >= 0). A plain tuple
    underneath, which is what the native layer takes."""

    __slots__ = ()

    def __new__(cls, kind: str, array, peer: int, tag: int = 0):
        if kind != "send" and kind != "recv":
            raise ValueError(f"P2POp kind must be 'send' or 'recv', got {kind!r}")
        return super().__new__(cls, kind, array, peer, tag)


def gathered_or_raise(group, what: str, value=None, error: str | None = None) -> list:
    """Every rank's `value`, in rank order, from one exchange over `group`. A rank whose step
    failed passes `error` (why): then every rank raises the same ``CollectiveError`` ("`what`:
    rank r: why; ..."), so a failure on one rank is an error on all of them, never a hang."""
    reports = group.allgather((value, error))
    failed = [(r, why) for r, (_, why) in enumerate(reports) if why is not None]
    if failed:
        raise CollectiveError(f"{what}: " + "; ".join(f"rank {r}: {why}" for r, why in failed))
    return [v for v, _ in reports]


def same_on_every_rank(values: list, what: str):
    """ValueError naming each rank's value unless all of `values` (one per rank) are equal."""
    if len(set(values)) != 1:
        each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"ranks disagree on {what}: {each}")
