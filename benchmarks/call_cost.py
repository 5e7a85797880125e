"""What one small blocking call costs, ours against mpi4py's on the same ranks: loops of
8-byte broadcasts, all-reduces and all-gathers, ours and MPI's batches alternating, per call
time of the slowest rank, median and best of --rounds. On one rank there is no peer to wait
for, so the time is the call's own cost (Python and native); on two, the latency.

    mpiexec -n 1 python benchmarks/call_cost.py
    mpiexec -n 2 python benchmarks/call_cost.py
    mpiexec -n 1 python benchmarks/call_cost.py --torch   # ours on torch CPU tensors over the
                                                          # same memory (MPI's on the arrays)
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.timing import per_call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50000)
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--torch", action="store_true", help="ours on torch CPU tensors")
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    x = np.ones(max(1, args.bytes // 4), np.float32)
    gathered = np.empty(mpi.size * x.size, np.float32)
    ox, ogathered = x, gathered  # what ours is called on
    if args.torch:
        import torch

        ox, ogathered = torch.from_numpy(x), torch.from_numpy(gathered)
    comm = pc.Communicator(mpi)
    calls = {  # (ours, MPI's)
        "broadcast": (lambda: comm.broadcast(ox), lambda: mpi.Bcast(x, root=0)),
        "all_reduce": (lambda: comm.all_reduce(ox), lambda: mpi.Allreduce(MPI.IN_PLACE, x)),
        "all_gather": (lambda: comm.all_gather(ox, ogathered), lambda: mpi.Allgather(x, gathered)),
    }

    def timed(fn):
        return per_call(mpi, fn, args.iters, warmup=1000) * 1e6

    if mpi.rank == 0:
        print(
            f"# {x.nbytes} B float32{' (ours: torch CPU tensors)' if args.torch else ''}, "
            f"{mpi.size} rank(s), {args.iters} calls a batch, "
            f"{args.rounds} batches each: us per call (median, best); ratio = MPI / ours"
        )
        print(f"{'call':>12} {'ours':>14} {'mpi4py':>14} {'ratio':>6}")
    for name, (ours, theirs) in calls.items():
        t = {"ours": [], "mpi": []}
        for _ in range(args.rounds):
            x[:] = 1
            t["ours"].append(timed(ours))
            x[:] = 1
            t["mpi"].append(timed(theirs))
        if mpi.rank == 0:
            med = {k: statistics.median(v) for k, v in t.items()}
            cell = {k: f"{med[k]:.2f}, {min(t[k]):.2f}" for k in t}
            ratio = med["mpi"] / med["ours"]
            print(f"{name:>12} {cell['ours']:>14} {cell['mpi']:>14} {ratio:>5.2f}x")
    comm.close()


if __name__ == "__main__":
    main()
