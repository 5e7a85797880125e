"""Faults on the GPU path, as faults.py has them on the host path: a rank that dies while its
peer is in a collective, and a rank that never arrives. No wait may be unbounded.

Usage: mpiexec -n 2 python gpu_faults.py die|skip
Environment: PYCOLL_TIMEOUT (the communicator's timeout), PYCOLL_CUDA_SYNC (kernel or stepped: the
mode checked), PYCOLL_CHECK_MISMATCH=0 to skip the host rendezvous before each launch, so that
the fault is met by the device waits (kernel mode) or the host-driven steps (stepped mode).
"""

from __future__ import annotations

import os
import sys
import time

import cupy as cp
from checks import run_main
from gpu_common import use_local_device
from mpi4py import MPI

import pycollectives as pc

COUNT = 1 << 22  # 16 MiB of float32: many staging slots, many steps


def setup():
    use_local_device()
    comm = pc.Communicator()  # timeout: PYCOLL_TIMEOUT
    x = cp.ones(COUNT, cp.float32)
    comm.all_reduce(x)  # sets the CUDA transport up
    comm.barrier()  # ... and waits for it on the GPU: every rank is here, nothing in flight
    assert float(x[0]) == comm.size, float(x[0])
    mode = comm._cuda.sync_mode
    wanted = os.environ.get("PYCOLL_CUDA_SYNC")
    assert wanted in (None, "", mode), f"asked for {wanted} mode, running {mode}"
    return comm, x, mode


def next_all_reduce_fails(comm, x):
    """(the error, seconds) of the next all-reduce, which must fail. In kernel mode the call
    returns once it is queued and an error on the device surfaces at the next call, here a
    blocking barrier (itself bounded by the timeout)."""
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        comm.barrier()
    except pc.CollectiveError as e:
        return e, time.monotonic() - t0
    raise AssertionError(f"rank {comm.rank}: the all-reduce and barrier raised nothing")


def die():
    """Rank 1 leaves without a word while rank 0 is in an all-reduce: rank 0 raises
    CollectiveError (or CollectiveTimeout) naming rank 1, within the timeout."""
    comm, x, mode = setup()
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0 is inside the next all-reduce by now
        sys.stdout.flush()
        os._exit(0)
    e, took = next_all_reduce_fails(comm, x)
    msg = f"{type(e).__name__}: {e}"
    assert "rank 1" in msg, msg
    assert took < comm.timeout, f"took {took:.2f} s, the timeout is {comm.timeout} s: {msg}"
    print(f"die sync={mode} detected in {took:.2f} s: {msg}", flush=True)
    os._exit(0)  # rank 1 is gone: no collective close


def skip():
    """Rank 1 never comes to the second all-reduce: rank 0 raises CollectiveTimeout naming it,
    after the timeout and not much later, and its communicator is poisoned."""
    comm, x, mode = setup()
    if comm.rank == 0:
        e, took = next_all_reduce_fails(comm, x)
        msg = f"{type(e).__name__}: {e}"
        assert isinstance(e, pc.CollectiveTimeout), msg
        assert "rank 1" in msg, msg
        assert 0.9 * comm.timeout <= took < comm.timeout + 3, f"took {took:.2f} s: {msg}"
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
        except pc.CollectiveError as poisoned:
            assert time.monotonic() - t0 < 1, "a poisoned communicator must fail at once"
            assert "earlier error" in str(poisoned), str(poisoned)
        else:
            raise AssertionError("a poisoned communicator accepted a collective")
        print(f"skip sync={mode} timed out in {took:.2f} s: {msg}", flush=True)
    MPI.COMM_WORLD.Barrier()  # rank 1 waits here, never in the all-reduce
    sys.stdout.flush()
    os._exit(0)  # rank 0's communicator is poisoned: no collective close


def main():
    {"die": die, "skip": skip}[sys.argv[1]]()


if __name__ == "__main__":
    run_main(main)
