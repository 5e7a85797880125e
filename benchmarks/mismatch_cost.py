"""Cost of always-on mismatch detection: the same small collectives with and without it.

    mpiexec -n 2 python benchmarks/mismatch_cost.py

Two communicators over the same ranks, one built with PYCOLL_CHECK_MISMATCH=0 (a switch that
exists only for this measurement); their batches alternate, best of --rounds.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.timing import per_call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    checked = pc.Communicator(mpi)
    os.environ["PYCOLL_CHECK_MISMATCH"] = "0"
    unchecked = pc.Communicator(mpi)
    del os.environ["PYCOLL_CHECK_MISMATCH"]

    def timed(comm, x, algo):
        return per_call(mpi, lambda: comm.all_reduce(x, algorithm=algo), args.iters)

    if mpi.rank == 0:
        print(f"# all_reduce float32, {mpi.size} ranks: us per call, best of {args.rounds}")
        print(
            f"# {'bytes':>8} {'algo':>7} {'checked':>9} {'unchecked':>10} {'cost us':>8} "
            f"{'cost %':>7}"
        )
    for nbytes in (8, 1024):
        x = np.ones(nbytes // 4, np.float32)
        for algo in ("ring", "direct"):
            for comm in (checked, unchecked):
                timed(comm, x, algo)  # warm up
            a = b = float("inf")
            for _ in range(args.rounds):
                a = min(a, timed(checked, x, algo))
                b = min(b, timed(unchecked, x, algo))
            if mpi.rank == 0:
                print(
                    f"  {nbytes:>8} {algo:>7} {a * 1e6:>9.3f} {b * 1e6:>10.3f} "
                    f"{(a - b) * 1e6:>8.3f} {(a - b) / b * 100:>6.1f}%"
                )
    checked.close()
    unchecked.close()


if __name__ == "__main__":
    main()
