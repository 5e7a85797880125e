"""The host backend: numpy arrays on one machine, over shared memory (``_C.HostComm``)."""

from __future__ import annotations

import os
import sys

from pycollectives import _C
from pycollectives.backends import host_tuning
from pycollectives.backends.base import gathered_or_raise, same_on_every_rank
from pycollectives.errors import CollectiveError
from pycollectives.options import Options
from pycollectives.trace import flight

# The smallest staging slot a small /dev/shm makes us take, and the share of what is free that
# this communicator's segments may fill (MPI, other communicators and the job's own files need
# the rest).
MIN_FITTED_SLOT = 16 << 10
SHM_SHARE = 0.75


def shm_free(path: str = "/dev/shm") -> int:
    """Bytes a new file in `path` may take (0 where there is no such file system)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def staging_that_fits(nranks: int, slot: int, slots: int, free: int) -> int | None:
    """The largest staging slot, `slot` or a power-of-two fraction of it down to 16 KiB, whose
    segments (one per rank, `nranks` ranks on this machine) fill at most SHM_SHARE of `free`;
    None where none does."""
    while True:
        if nranks * _C.segment_bytes(nranks, slot, slots) <= free * SHM_SHARE:
            return slot
        if slot // 2 < MIN_FITTED_SLOT or (slot // 2) % 64:
            return None
        slot //= 2


def fit_staging(group, opts: Options) -> Options:
    """`opts` with staging slots every rank of `group` (the ranks of one machine) can afford
    in /dev/shm, decided alike on every rank from the least free space any of them sees: the
    default slot while it fits, else smaller ones (a one-line notice), else the same
    CollectiveError on every rank, with its remedy, before any segment exists. Slots asked for
    (``staging_bytes=``, ``PYCOLL_STAGING_BYTES``) are kept as they are, and taken by the ranks
    that were not asked."""
    if getattr(group, "members", None) is not None:  # a try of shrink: the slots they had
        return opts
    # Every rank takes part whatever it was asked: a replacement that grows a communicator
    # comes with the defaults, the survivors with their slots.
    reports = group.allgather((shm_free(), opts.staging_bytes if opts.staging_asked else None))
    asked = [slot for _, slot in reports if slot is not None]
    if asked:
        return opts if opts.staging_asked else opts.replace(staging_bytes=asked[0])
    free = min(free for free, _ in reports)
    slot = staging_that_fits(group.size, opts.staging_bytes, opts.staging_slots, free)
    if slot == opts.staging_bytes:
        return opts
    if slot is None:
        need = group.size * _C.segment_bytes(group.size, MIN_FITTED_SLOT, opts.staging_slots)
        raise CollectiveError(
            f"not enough shared memory for {group.size} ranks: even with {MIN_FITTED_SLOT >> 10} "
            f"KiB staging slots they need {need} bytes, and /dev/shm has {free} bytes free "
            f"(a communicator takes at most {SHM_SHARE:.0%} of it). {REMEDY}"
        )
    if group.rank == 0:
        print(
            f"pycollectives: /dev/shm has {free >> 20} MiB free: staging slots of {slot >> 10} KiB "
            f"instead of {opts.staging_bytes >> 10} KiB for {group.size} ranks ({REMEDY_SHORT})",
            file=sys.stderr,
            flush=True,
        )
    return opts.replace(staging_bytes=slot)


REMEDY_SHORT = "a larger /dev/shm keeps the default: docker run --shm-size=1g"
REMEDY = (
    "Give the job a larger /dev/shm (docker run --shm-size=1g; Kubernetes: an emptyDir of medium "
    "Memory on /dev/shm) or run fewer ranks on this machine; python -m pycollectives.doctor -n "
    "RANKS says what a job needs"
)


def rendezvous(group, opts: Options):
    """A ``_C.HostComm`` whose segment every rank of `group` has mapped, with the algorithm
    thresholds of this machine and rank count (host_tuning). Staging slots shrink where
    /dev/shm is small (fit_staging)."""
    opts = fit_staging(group, opts)
    # The probe's communicator logs nothing (its calls are not the user's) and runs every
    # algorithm as asked: a reproducible one would run each reduction in rank order.
    probe_opts = opts.replace(debug=False, reproducible=False)
    rules, source = host_tuning.tuning_rules(group, opts, lambda: _mapped(group, probe_opts)[0])
    if opts.debug and group.rank == 0:
        print(f"pycollectives INFO: algorithm thresholds for {group.size} ranks: {source}",
              file=sys.stderr, flush=True)  # fmt: skip
    host, comm_id = _mapped(group, opts)
    flight.attach(host, opts, comm_id, group.rank, group.size)
    host.set_tuning(rules)
    if opts.algorithm is not None:
        host.set_forced(opts.algorithm)
    return host


def _mapped(group, opts: Options):
    """(a ``_C.HostComm`` whose segment every rank of `group` has mapped, its flight
    recorder's name). Every rank reports its configuration and segment (or why it has none) in
    one exchange, so a failure on one rank is an error on all ranks, never a hang."""
    host, error = None, None
    try:
        host = _C.HostComm(group.rank, group.size, opts.host_options())
    except (CollectiveError, ValueError) as e:
        error = str(e)
    config = (opts.staging_bytes, opts.staging_slots, opts.reproducible)
    name = None if host is None else host.segment_name
    reports = gathered_or_raise(group, "cannot set up shared memory", (config, name), error)
    configs = [config for config, _ in reports]
    same_on_every_rank(
        configs,
        "the staging configuration and reproducible mode (staging_bytes, staging_slots, "
        "reproducible)",
    )
    error = None
    try:
        host.attach([name for _, name in reports])
    except CollectiveError as e:
        error = str(e)
    try:
        gathered_or_raise(group, "cannot attach shared memory", error=error)
    finally:  # every peer has mapped our segment (or given up): its name is no longer needed
        host.unlink()
    return host, flight.comm_id(reports[0][1])


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
