"""The host backend: numpy arrays on one machine, over shared memory (``_C.HostComm``)."""

from __future__ import annotations

from pycollectives import _C
from pycollectives.backends.base import gathered_or_raise, same_on_every_rank
from pycollectives.errors import CollectiveError
from pycollectives.options import Options, load_tuning


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

    @property
    def failed(self) -> bool:
        """Unusable after an error, an abort or a revocation."""
        return self.c.poisoned

    def abort(self, reason: str):
        self.c.abort(reason)

    def close(self):
        self.c = self.run = self.p2p = None
