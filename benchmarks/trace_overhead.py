"""What PYCOLL_TRACE costs a call: small all-reduces on two communicators over the same
ranks, one traced and one not, their batches alternating, best of --rounds.

    mpiexec -n 2 python benchmarks/trace_overhead.py
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives import trace
from pycollectives.bench.timing import per_call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    plain = pc.Communicator(mpi)
    where = tempfile.mkdtemp(prefix="pycoll-trace-") if mpi.rank == 0 else None
    trace.enable(f"{mpi.bcast(where)}/t-{{rank}}.json")
    traced = pc.Communicator(mpi)

    def timed(comm, x):
        return per_call(mpi, lambda: comm.all_reduce(x), args.iters)

    if mpi.rank == 0:
        print(f"# all_reduce float32, {mpi.size} ranks: us per call, best of {args.rounds}")
        print(f"{'bytes':>8} {'untraced':>10} {'traced':>10} {'added':>8} {'ratio':>6}")
    for nbytes in (8, 1024, 65536):
        x = np.ones(nbytes // 4, np.float32)
        best = {"plain": float("inf"), "traced": float("inf")}
        for _ in range(args.rounds):
            best["plain"] = min(best["plain"], timed(plain, x))
            best["traced"] = min(best["traced"], timed(traced, x))
        if mpi.rank == 0:
            p, t = best["plain"] * 1e6, best["traced"] * 1e6
            print(f"{nbytes:>8} {p:>10.2f} {t:>10.2f} {t - p:>8.2f} {t / p:>6.2f}")
    traced.close()
    plain.close()


if __name__ == "__main__":
    main()
