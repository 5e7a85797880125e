"""The transports a Communicator dispatches to, behind one protocol.

A backend runs calls on one kind of memory and topology:

- ``HostBackend``: numpy arrays on one machine, over shared memory (``_C.HostComm``);
- ``pycollectives.hierarchy.Hierarchical``: numpy arrays on several nodes (shared memory
  inside each, MPI between them);
- ``pycollectives.cuda.CudaComm``: CUDA arrays on one machine, over CUDA IPC.

Each offers ``run(call)``, ``p2p(ops, async_op)``, ``barrier(async_op)``, ``seq``,
``timeout`` (settable), ``algorithm_for(collective, nbytes)`` and ``close()``; the host ones
(``HostBackend``, ``Hierarchical``) also ``abort(reason)``. ``run`` and
``p2p`` return None when the work is done, or a native handle (``wait(timeout)``,
``is_completed()``, ``seq``) that the Communicator wraps in a ``Work``.
"""

from __future__ import annotations

from typing import NamedTuple

from pycollectives import _C
from pycollectives.errors import CollectiveError
from pycollectives.options import Options, load_tuning


class Call(NamedTuple):
    """One collective as the Communicator hands it to a backend: names and codes checked,
    arrays not yet (each backend checks its own kind of array before anything moves). A tuple,
    which the native host layer reads by position."""

    collective: str
    x: object
    out: object = None
    op: int = 0  # native codes
    root: int = 0
    algorithm: int = 0  # 0: automatic
    async_op: bool = False
    stream: object = None
    counts: list | None = None  # uneven all_gather / reduce_scatter
    in_splits: list | None = None  # all_to_all
    out_splits: list | None = None


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


def rendezvous(group, opts: Options):
    """A ``_C.HostComm`` whose segment every rank of `group` has mapped. Every rank reports its
    configuration and segment (or why it has none) in one exchange, so a failure on one rank
    is an error on all ranks, never a hang."""
    host, error = None, None
    try:
        host = _C.HostComm(group.rank, group.size, opts.host_options())
    except (CollectiveError, ValueError) as e:
        error = str(e)
    config = (opts.staging_bytes, opts.staging_slots)
    name = None if host is None else host.segment_name
    reports = gathered_or_raise(group, "cannot set up shared memory", (config, name), error)
    configs = [config for config, _ in reports]
    same_on_every_rank(configs, "the staging configuration (staging_bytes, staging_slots)")
    error = None
    try:
        host.attach([name for _, name in reports])
    except CollectiveError as e:
        error = str(e)
    try:
        gathered_or_raise(group, "cannot attach shared memory", error=error)
    finally:  # every peer has mapped our segment (or given up): its name is no longer needed
        host.unlink()
    host.set_tuning(load_tuning())
    if opts.algorithm is not None:
        host.set_forced(opts.algorithm)
    return host


class HostBackend:
    """numpy arrays on one machine, over shared memory."""

    def __init__(self, group, opts: Options):
        self.c = rendezvous(group, opts)
        # Straight to the native layer: run(call) reads the Call's fields; p2p(ops, async_op)
        # takes the P2POps as the tuples they are.
        self.run, self.p2p = self.c.run_call, self.c.p2p

    def barrier(self, async_op):
        return self.c.barrier(async_op)

    @property
    def seq(self) -> int:
        return self.c.seq

    @property
    def timeout(self) -> float:
        return self.c.timeout

    @timeout.setter
    def timeout(self, seconds: float):
        self.c.timeout = seconds

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        return self.c.choose(collective, nbytes)

    def abort(self, reason: str):
        self.c.abort(reason)

    def close(self):
        self.c = self.run = self.p2p = None
