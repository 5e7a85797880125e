"""Cost of always-on mismatch detection: the same small collectives with and without it.

    mpiexec -n 2 python benchmarks/mismatch_cost.py

Two communicators over the same ranks, one built with PYCOLL_CHECK_MISMATCH=0 (a switch that
exists only for this measurement); their batches alternate, best of --rounds.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.scripts import batch_options
from pycollectives.bench.timing import best_per_call


def main():
    args = batch_options(__doc__.splitlines()[0], rounds=7)
    mpi = MPI.COMM_WORLD
    checked = pc.Communicator(mpi)
    os.environ["PYCOLL_CHECK_MISMATCH"] = "0"
    unchecked = pc.Communicator(mpi)
    del os.environ["PYCOLL_CHECK_MISMATCH"]
    if mpi.rank == 0:
        print(f"# all_reduce float32, {mpi.size} ranks: us per call, best of {args.rounds}")
        print(
            f"# {'bytes':>8} {'algo':>7} {'checked':>9} {'unchecked':>10} {'cost us':>8} "
            f"{'cost %':>7}"
        )
    for nbytes in (8, 1024):
        x = np.ones(nbytes // 4, np.float32)
        for algo in ("ring", "direct"):
            sides = [partial(c.all_reduce, x, algorithm=algo) for c in (checked, unchecked)]
            # one batch of each untimed first (warm-up)
            a, b = best_per_call(mpi, sides, args.iters, args.rounds, args.iters)
            if mpi.rank == 0:
                print(
                    f"  {nbytes:>8} {algo:>7} {a * 1e6:>9.3f} {b * 1e6:>10.3f} "
                    f"{(a - b) * 1e6:>8.3f} {(a - b) / b * 100:>6.1f}%"
                )
    checked.close()
    unchecked.close()


if __name__ == "__main__":
    main()
