"""What PYCOLL_TRACE costs a call: small all-reduces on two communicators over the same
ranks, one traced and one not, their batches alternating, best of --rounds.

    mpiexec -n 2 python benchmarks/trace_overhead.py
"""

from __future__ import annotations

import tempfile
from functools import partial

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives import trace
from pycollectives.bench.scripts import batch_options
from pycollectives.bench.timing import best_per_call


def main():
    args = batch_options(__doc__.splitlines()[0], rounds=7)
    mpi = MPI.COMM_WORLD
    plain = pc.Communicator(mpi)
    where = tempfile.mkdtemp(prefix="pycoll-trace-") if mpi.rank == 0 else None
    trace.enable(f"{mpi.bcast(where)}/t-{{rank}}.json")
    with plain, pc.Communicator(mpi) as traced:
        if mpi.rank == 0:
            print(f"# all_reduce float32, {mpi.size} ranks: us per call, best of {args.rounds}")
            print(f"{'bytes':>8} {'untraced':>10} {'traced':>10} {'added':>8} {'ratio':>6}")
        for nbytes in (8, 1024, 65536):
            x = np.ones(nbytes // 4, np.float32)
            sides = (partial(plain.all_reduce, x), partial(traced.all_reduce, x))
            p, t = (s * 1e6 for s in best_per_call(mpi, sides, args.iters, args.rounds, 0))
            if mpi.rank == 0:
                print(f"{nbytes:>8} {p:>10.2f} {t:>10.2f} {t - p:>8.2f} {t / p:>6.2f}")


if __name__ == "__main__":
    main()
