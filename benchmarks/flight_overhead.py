"""What the flight recorder costs a call: small collectives through the public API on two
communicators over the same ranks, one with the recorder (the default) and one without
(``PYCOLL_FLIGHT_RECORDER=0``), their batches alternating, best of --rounds each.

    mpiexec -n 2 python benchmarks/flight_overhead.py

Prints µs per call with and without, the difference and its share of the call without.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.scripts import batch_options
from pycollectives.bench.timing import best_per_call


def communicator(entries: int) -> pc.Communicator:
    os.environ["PYCOLL_FLIGHT_RECORDER"] = str(entries)
    try:
        return pc.Communicator(MPI.COMM_WORLD)
    finally:
        del os.environ["PYCOLL_FLIGHT_RECORDER"]


def main():
    args = batch_options(__doc__.splitlines()[0], rounds=15)
    mpi = MPI.COMM_WORLD
    x = np.ones(2, np.float32)  # 8 B
    calls = {
        "all_reduce": lambda c: c.all_reduce(x),
        "broadcast": lambda c: c.broadcast(x, root=0),
    }
    if mpi.rank == 0:
        print(f"# 8 B float32, {mpi.size} ranks, {args.iters} calls a batch: us per call, "
              f"best of {args.rounds} alternating batches")  # fmt: skip
        print(f"{'call':>10} {'off':>8} {'on':>8} {'added':>8} {'share':>7}")
    with communicator(0) as off, communicator(1024) as on:
        for name, fn in calls.items():
            sides = (partial(fn, off), partial(fn, on))
            a, b = (t * 1e6 for t in best_per_call(mpi, sides, args.iters, args.rounds, 0))
            if mpi.rank == 0:
                print(f"{name:>10} {a:>8.3f} {b:>8.3f} {b - a:>8.3f} {(b - a) / a:>7.1%}")


if __name__ == "__main__":
    main()
