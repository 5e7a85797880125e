"""Runs a fixed mix of collectives; the test reads the PYCOLL_DEBUG log and the printed choices."""

import numpy as np
from checks import run_main

import pycollectives as pc


def main():
    with pc.Communicator() as comm:
        n = comm.size
        for nbytes in (8, 4096, 1 << 20):
            x = np.ones(nbytes // 4, np.float32)
            comm.all_reduce(x)
            comm.broadcast(x)
            out = np.empty(x.size * n, np.float32)
            comm.all_gather(x, out)
        comm.all_reduce(np.ones(4, np.float32), algorithm="ring")
        if comm.rank == 0:
            for coll in ("all_reduce", "all_gather", "broadcast"):
                print("choice", coll, comm.algorithm_for(coll, 8))


if __name__ == "__main__":
    run_main(main)
