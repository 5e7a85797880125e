"""All-reduce float32, 8 B to 64 MiB: pycollectives vs MPI_Allreduce (mpi4py), same run.

    mpiexec -n 2 python benchmarks/allreduce_vs_mpi.py [--max-bytes N] [--json FILE]

Times are the slowest rank's mean per call over a timed batch, best of --rounds batches;
ours and MPI's batches alternate per size so both see the same machine. Bandwidth follows
nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n.
"""

from __future__ import annotations

from functools import partial

from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.formulas import bus_factor
from pycollectives.bench.scripts import float32_sizes, machine, sweep_options, write_json
from pycollectives.bench.timing import best_per_call


def main():
    args = sweep_options(__doc__.splitlines()[0], rounds=5)

    mpi = MPI.COMM_WORLD
    n = mpi.Get_size()
    comm = pc.Communicator(mpi)
    factor = bus_factor("all_reduce", n)
    rows = []
    if comm.rank == 0:
        print(f"# all_reduce float32 sum, {n} ranks, {', '.join(machine().values())}")
        print(
            f"# {'bytes':>10} {'ours us':>10} {'mpi us':>10} {'ours busbw':>11} "
            f"{'mpi busbw':>10} {'speedup':>8}"
        )
    sizes = float32_sizes(args.min_bytes, args.max_bytes, 2, 256 << 20, 5, 20000)
    for nbytes, x, out, iters in sizes:
        fns = (partial(comm.all_reduce, x, out), partial(mpi.Allreduce, x, out))
        best_ours, best_mpi = best_per_call(mpi, fns, iters, args.rounds, min(iters, 50))
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
    if comm.rank == 0 and args.json:
        write_json(args.json, {"ranks": n, "rows": rows})
    comm.close()


if __name__ == "__main__":
    main()
