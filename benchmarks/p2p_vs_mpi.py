"""Sendrecv exchange between 2 ranks, 8 B to 16 MiB: pycollectives p2p vs MPI_Sendrecv (mpi4py).

    mpiexec -n 2 python benchmarks/p2p_vs_mpi.py [--sizes 8,1024,...] [--rounds 5] [--json FILE]

Each iteration, each rank sends `bytes` to the other and receives as many from it: ours as one
batch through HostComm.p2p, MPI's as one Sendrecv, on the same buffers. Times are the slowest
rank's mean per iteration over a timed batch, best of --rounds batches; ours and MPI's batches
alternate per size. Bandwidth follows nccl-tests' sendrecv: busbw = algbw = bytes / time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from allreduce_vs_mpi import timed  # noqa: E402

import pycollectives as pc  # noqa: E402

SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args()

    mpi = MPI.COMM_WORLD
    if mpi.Get_size() != 2:
        raise SystemExit("run on 2 ranks: mpiexec -n 2 python benchmarks/p2p_vs_mpi.py")
    comm = pc.Communicator(mpi)
    peer = 1 - comm.rank
    host = comm._c
    rows = []
    if comm.rank == 0:
        print(
            f"# sendrecv exchange, 2 ranks, {platform.processor() or platform.machine()}, "
            f"{MPI.Get_library_version().splitlines()[0].strip()}"
        )
        print(
            f"# {'bytes':>10} {'ours us':>10} {'mpi us':>10} {'ours busbw':>11} "
            f"{'mpi busbw':>10} {'speedup':>8}"
        )
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.full(nbytes, comm.rank, np.uint8)
        y = np.empty(nbytes, np.uint8)
        iters = int(min(20000, max(5, (256 << 20) // max(nbytes, 1) // 4)))
        ops = [("send", x, peer, 0), ("recv", y, peer, 0)]

        def ours(ops=ops):
            host.p2p(ops)

        def theirs(x=x, y=y):
            mpi.Sendrecv(x, dest=peer, recvbuf=y, source=peer)

        for f in (ours, theirs):  # warm up (page faults, caches)
            for _ in range(min(iters, 50)):
                f()
        assert np.all(y == peer)
        best_ours = best_mpi = float("inf")
        for _ in range(args.rounds):
            best_ours = min(best_ours, timed(ours, iters, mpi))
            best_mpi = min(best_mpi, timed(theirs, iters, mpi))
        row = {
            "bytes": nbytes,
            "ours_us": best_ours * 1e6,
            "mpi_us": best_mpi * 1e6,
            "ours_busbw_GBs": nbytes / best_ours / 1e9,
            "mpi_busbw_GBs": nbytes / best_mpi / 1e9,
            "speedup": best_mpi / best_ours,
        }
        rows.append(row)
        if comm.rank == 0:
            print(
                f"  {nbytes:>10} {row['ours_us']:>10.2f} {row['mpi_us']:>10.2f} "
                f"{row['ours_busbw_GBs']:>11.3f} {row['mpi_busbw_GBs']:>10.3f} "
                f"{row['speedup']:>7.2f}x",
                flush=True,
            )
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": 2, "rows": rows}, f, indent=1)
    comm.close()


if __name__ == "__main__":
    main()
