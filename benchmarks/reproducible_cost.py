"""What reproducible mode costs: all-reduces through the public API on two communicators over
the same ranks, one as by default and one with ``reproducible=True`` (every reduction in
rank order: the direct schedules, or the shared buffers' pass), their batches alternating,
best of --rounds each, on plain numpy arrays and on ``Communicator.empty`` buffers.

    mpiexec -n 2 python benchmarks/reproducible_cost.py
    mpiexec -n 4 python benchmarks/reproducible_cost.py

Prints, per size and kind of array, µs per call by default and reproducible, the algorithm
each ran (``algorithm_for``; the shared buffers' pass where it maps them) and the ratio
(reproducible / default: above 1 is what the mode costs).
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.timing import per_call

SIZES = {"8 B": 8, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of calls per batch")
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    comms = {
        "default": pc.Communicator(mpi),
        "reproducible": pc.Communicator(mpi, reproducible=True),
    }
    if mpi.rank == 0:
        print(f"# all_reduce float32, {mpi.size} ranks: us per call, best of {args.rounds} "
              "alternating batches")  # fmt: skip
        print(f"{'size':>7} {'arrays':>7} {'default':>10} {'algorithm':>10} "
              f"{'reproducible':>13} {'algorithm':>10} {'ratio':>6}")  # fmt: skip
    for label, nbytes in SIZES.items():
        count = nbytes // 4
        for kind in ("plain", "shared"):
            if kind == "shared" and nbytes < pc.Options().shared_bytes:
                continue  # below the size from which shared buffers are mapped
            xs = {
                k: (c.empty(count, np.float32) if kind == "shared" else np.empty(count, np.float32))
                for k, c in comms.items()
            }
            for x in xs.values():
                x[:] = 1.0
            x0 = xs["default"]
            one = per_call(mpi, lambda x0=x0: comms["default"].all_reduce(x0), 1, warmup=2)
            iters = max(3, min(20000, int(args.budget / max(one, 1e-7))))
            best = {k: float("inf") for k in comms}
            for _ in range(args.rounds):
                for k, c in comms.items():
                    best[k] = min(
                        best[k], per_call(mpi, lambda c=c, x=xs[k]: c.all_reduce(x), iters)
                    )
            if mpi.rank == 0:
                algo = {
                    k: "shared" if kind == "shared" else c.algorithm_for("all_reduce", nbytes)
                    for k, c in comms.items()
                }
                a, b = best["default"] * 1e6, best["reproducible"] * 1e6
                print(f"{label:>7} {kind:>7} {a:>10.2f} {algo['default']:>10} {b:>13.2f} "
                      f"{algo['reproducible']:>10} {b / a:>6.2f}", flush=True)  # fmt: skip
            del xs, x0
    for c in comms.values():
        c.close()


if __name__ == "__main__":
    main()
