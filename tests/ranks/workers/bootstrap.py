"""A job launched by torchrun or a plain env:// launcher (no mpiexec): the communicator meets
its peers through torch's TCPStore, and runs over shared memory like any other."""

import os
import sys

import numpy as np
from checks import run_main

import pycollectives as pc


def main():
    want = int(os.environ["WORLD_SIZE"])
    with pc.Communicator(timeout=30) as comm:
        assert (comm.rank, comm.size) == (int(os.environ["RANK"]), want), (comm.rank, comm.size)
        assert comm._group.mpi is None  # not an MPI world of one
        x = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
        comm.all_reduce(x)
        np.testing.assert_array_equal(x, np.arange(1000) * (want * (want + 1) / 2))
        got = comm.broadcast_object({"from": comm.rank, "blob": "z" * 5000}, root=want - 1)
        assert got == {"from": want - 1, "blob": "z" * 5000}, got
        comm.barrier()
    sys.stdout.write(f"rank {comm.rank}/{comm.size} ok\n")  # one write: other ranks share the pipe
    sys.stdout.flush()


if __name__ == "__main__":
    run_main(main)
