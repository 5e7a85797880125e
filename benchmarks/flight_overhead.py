"""What the flight recorder costs a call: small collectives through the public API on two
communicators over the same ranks, one with the recorder (the default) and one without
(``PYCOLL_FLIGHT_RECORDER=0``), their batches alternating, best of --rounds each.

    mpiexec -n 2 python benchmarks/flight_overhead.py

Prints µs per call with and without, the difference and its share of the call without.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.timing import per_call


def communicator(entries: int) -> pc.Communicator:
    os.environ["PYCOLL_FLIGHT_RECORDER"] = str(entries)
    try:
        return pc.Communicator(MPI.COMM_WORLD)
    finally:
        del os.environ["PYCOLL_FLIGHT_RECORDER"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    off, on = communicator(0), communicator(1024)
    x = np.ones(2, np.float32)  # 8 B
    calls = {
        "all_reduce": lambda c: c.all_reduce(x),
        "broadcast": lambda c: c.broadcast(x, root=0),
    }
    if mpi.rank == 0:
        print(f"# 8 B float32, {mpi.size} ranks, {args.iters} calls a batch: us per call, "
              f"best of {args.rounds} alternating batches")  # fmt: skip
        print(f"{'call':>10} {'off':>8} {'on':>8} {'added':>8} {'share':>7}")
    for name, fn in calls.items():
        best = {"off": float("inf"), "on": float("inf")}
        for _ in range(args.rounds):
            for key, comm in (("off", off), ("on", on)):
                best[key] = min(best[key], per_call(mpi, lambda c=comm, f=fn: f(c), args.iters))
        if mpi.rank == 0:
            a, b = best["off"] * 1e6, best["on"] * 1e6
            print(f"{name:>10} {a:>8.3f} {b:>8.3f} {b - a:>8.3f} {(b - a) / a:>7.1%}")
    on.close()
    off.close()


if __name__ == "__main__":
    main()
