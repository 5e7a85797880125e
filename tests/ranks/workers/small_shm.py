"""A job in a small /dev/shm (test_small_shm.py mounts one): `fits` checks an all-reduce and
prints the staging slot each rank took; `refused` (once MPI has started, /dev/shm filled but
for 4 MiB) expects every rank to raise the same error, with its remedy, before any segment of
ours exists.

Usage: mpiexec -n N python small_shm.py fits|refused
"""

from __future__ import annotations

import os
import sys

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc


def ours() -> list:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("pycoll"))


def fits():
    comm = pc.Communicator()
    x = np.arange(1 << 18, dtype=np.int64) * (comm.rank + 1)
    comm.all_reduce(x)
    want = np.arange(1 << 18, dtype=np.int64) * (comm.size * (comm.size + 1) // 2)
    assert np.array_equal(x, want), x[:4]
    print(f"rank {comm.rank} slot {comm.staging_bytes}", flush=True)
    comm.close()


def refused():
    # MPICH has what it needs (with less, MPI_Init itself may die); then rank 0 takes all but
    # 4 MiB of what is left, less than 8 ranks' segments need even with 16 KiB slots.
    mpi = MPI.COMM_WORLD
    filler = "/dev/shm/filler"
    if mpi.rank == 0:
        st = os.statvfs("/dev/shm")
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - (4 << 20))
        os.close(fd)
    mpi.Barrier()
    try:
        refused_with_little_left(mpi)
    finally:
        mpi.Barrier()
        if mpi.rank == 0:
            os.unlink(filler)


def refused_with_little_left(mpi):
    try:
        pc.Communicator()
    except pc.CollectiveError as e:
        message = str(e)
    else:
        raise AssertionError("a communicator was made in a /dev/shm too small for it")
    messages = mpi.allgather(message)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert "not enough shared memory" in message and "--shm-size" in message, message
    mpi.Barrier()
    assert ours() == [], ours()  # nothing of ours left behind
    if mpi.rank == 0:
        print(f"refused: {message}", flush=True)


if __name__ == "__main__":
    run_main({"fits": fits, "refused": refused}[sys.argv[1]])
