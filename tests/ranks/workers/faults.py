"""Faults: a rank that skips a collective, and a rank that dies mid-collective.

Usage: mpiexec -n 2 python faults.py skip|die
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from checks import expect, hard_exit, run_main
from mpi4py import MPI

import pycollectives as pc


def skip():
    comm = pc.Communicator(timeout=1.0)
    x = np.ones(1000, np.float32)
    comm.all_reduce(x)  # collective #1: everyone
    if comm.rank == 0:
        t0 = time.monotonic()
        words = ("all_reduce #2", "rank 1", "never started it: 1")
        expect(pc.CollectiveTimeout, lambda: comm.all_reduce(x), *words)  # #2: rank 1 never comes
        took = time.monotonic() - t0
        assert 0.9 < took < 5, took
        # Poisoned: the next call fails at once, naming the earlier error.
        t0 = time.monotonic()
        expect(pc.CollectiveError, lambda: comm.broadcast(x), "earlier error")
        assert time.monotonic() - t0 < 0.1, time.monotonic() - t0
        print("skip")
    MPI.COMM_WORLD.Barrier()
    comm.close()


def skip_root():
    """A broadcast's root does not wait for its receivers: it returns at once, and a later
    call that waits for rank 1 in vain names the broadcast it never started too."""
    comm = pc.Communicator(timeout=1.0)
    x = np.arange(1000, dtype=np.float32) if comm.rank == 0 else np.zeros(1000, np.float32)
    comm.all_reduce(np.ones(3, np.int32))  # collective #1: everyone
    if comm.rank == 1:
        time.sleep(0.5)  # late, not absent
    t0 = time.monotonic()
    comm.broadcast(x, root=0)  # #2
    took = time.monotonic() - t0
    assert np.array_equal(x, np.arange(1000, dtype=np.float32)), x[:4]
    if comm.rank == 0:
        assert took < 0.3, f"the root waited {took:.2f} s for its receiver"
    y = np.ones(4, np.float32)
    comm.all_reduce(y)  # #3
    assert np.all(y == 2), y
    if comm.rank == 0:
        comm.broadcast(x, root=0)  # #4: rank 1 never comes
        t0 = time.monotonic()
        words = ("all_reduce #5", "never started it: 1", "never started broadcast #4: 1")
        expect(pc.CollectiveTimeout, lambda: comm.all_reduce(y), *words)  # #5 needs rank 1
        took = time.monotonic() - t0
        assert 0.9 < took < 5, took
        print("skip_root")
    MPI.COMM_WORLD.Barrier()
    comm.close()


def late_root():
    """Both ranks take themselves for a broadcast's root, rank 1 late. Rank 0 returns
    without waiting for it; rank 1, arriving, sees the disagreement and raises. Rank 0's
    next call receives rank 1's stale broadcast message where it expects its own data: it
    must raise before writing that message into its output."""
    comm = pc.Communicator(timeout=10.0)
    comm.all_reduce(np.ones(3, np.int32))  # #1
    if comm.rank == 1:
        time.sleep(0.3)
    x = np.full(1000, 7.0 + comm.rank, np.float32)
    z = np.zeros(1000, np.float32)
    try:
        comm.broadcast(x, root=comm.rank, algorithm="ring")  # #2: the disagreement
        comm.broadcast(z, root=1, algorithm="ring")  # #3, on rank 0 alone
    except pc.CollectiveMismatch as e:
        assert "broadcast #2" in str(e) and "root" in str(e), str(e)
        assert np.all(z == 0), f"rank {comm.rank}: output written with a stale message {z[:2]}"
    else:
        raise AssertionError(f"rank {comm.rank} returned {z[:2]} (no CollectiveMismatch)")
    MPI.COMM_WORLD.Barrier()
    if comm.rank == 0:
        print("late_root")
    comm.close()


def dead_peer(name, leave):
    """Rank 1 leaves (`leave()` never returns) while rank 0 is in an all-reduce; rank 0 must
    raise CollectiveError naming rank 1 within 5 s."""
    comm = pc.Communicator(timeout=60.0)
    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x)
    if comm.rank == 1:
        leave()
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except pc.CollectiveError as e:
        took = time.monotonic() - t0
        assert "rank 1" in str(e) and "no longer running" in str(e), str(e)
        assert took < 5, took
        print(f"{name}: the survivor raised within {took:.2f} s", flush=True)
    else:
        raise AssertionError(f"{name}: dead peer not detected")
    hard_exit(0)


def die():
    def leave():
        sys.stdout.flush()
        os._exit(0)  # gone without a word, while rank 0 enters the next collective

    dead_peer("die", leave)


def kill9():
    def leave():
        time.sleep(0.2)  # rank 0 is inside the next all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)

    dead_peer("kill9", leave)


def loop():
    # Collectives until killed (bounded: 60 s at most).
    comm = pc.Communicator(timeout=60.0)
    x = np.ones(1 << 16, np.float32)
    if comm.rank == 0:
        print("looping", flush=True)
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        comm.all_reduce(x)
    comm.close()


def main():
    cases = {
        "skip": skip, "skip_root": skip_root, "late_root": late_root,
        "die": die, "kill9": kill9, "loop": loop,
    }  # fmt: skip
    cases[sys.argv[1]]()


if __name__ == "__main__":
    run_main(main)
