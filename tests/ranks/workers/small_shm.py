"""A job in a small /dev/shm (test_small_shm.py mounts one): `fits` checks an all-reduce and
prints the staging slot each rank took; `refused` expects every rank to raise the same error,
with its remedy, before any segment of ours exists.

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
    try:
        pc.Communicator()
    except pc.CollectiveError as e:
        message = str(e)
    else:
        raise AssertionError("a communicator was made in a /dev/shm too small for it")
    mpi = MPI.COMM_WORLD
    messages = mpi.allgather(message)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert "not enough shared memory" in message and "--shm-size" in message, message
    mpi.Barrier()
    assert ours() == [], ours()  # nothing of ours left behind
    if mpi.rank == 0:
        print(f"refused: {message}", flush=True)


if __name__ == "__main__":
    run_main({"fits": fits, "refused": refused}[sys.argv[1]])
