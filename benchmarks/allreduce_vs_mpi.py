"""All-reduce float32, 8 B to 64 MiB: pycollectives vs MPI_Allreduce (mpi4py), same run.

    mpiexec -n 2 python benchmarks/allreduce_vs_mpi.py [--max-bytes N] [--json FILE]

Times are the slowest rank's mean per call over a timed batch, best of --rounds batches;
ours and MPI's batches alternate per size so both see the same machine. Bandwidth follows
nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n.
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.formulas import bus_factor
from pycollectives.bench.peers import mpi_library
from pycollectives.bench.timing import best_per_call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args()

    mpi = MPI.COMM_WORLD
    n = mpi.Get_size()
    comm = pc.Communicator(mpi)
    factor = bus_factor("all_reduce", n)
    rows = []
    if comm.rank == 0:
        print(
            f"# all_reduce float32 sum, {n} ranks, {platform.processor() or platform.machine()}, "
            f"{mpi_library()}"
        )
        print(
            f"# {'bytes':>10} {'ours us':>10} {'mpi us':>10} {'ours busbw':>11} "
            f"{'mpi busbw':>10} {'speedup':>8}"
        )
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        x = np.ones(count, np.float32)
        out = np.empty_like(x)
        iters = int(min(20000, max(5, (256 << 20) // max(nbytes, 1) // 4)))

        def ours(x=x, out=out):
            comm.all_reduce(x, out)

        def theirs(x=x, out=out):
            mpi.Allreduce(x, out)

        best_ours, best_mpi = best_per_call(mpi, (ours, theirs), iters, args.rounds, min(iters, 50))
        row = {
            "bytes": nbytes,
            "ours_us": best_ours * 1e6,
            "mpi_us": best_mpi * 1e6,
            "ours_busbw_GBs": nbytes / best_ours / 1e9 * factor,
            "mpi_busbw_GBs": nbytes / best_mpi / 1e9 * factor,
            "speedup": best_mpi / best_ours,
        }
        rows.append(row)
        if comm.rank == 0:
            print(
                f"  {nbytes:>10} {row['ours_us']:>10.2f} {row['mpi_us']:>10.2f} "
                f"{row['ours_busbw_GBs']:>11.2f} {row['mpi_busbw_GBs']:>10.2f} "
                f"{row['speedup']:>7.2f}x",
                flush=True,
            )
        nbytes *= 2
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "rows": rows}, f, indent=1)
    comm.close()


if __name__ == "__main__":
    main()
