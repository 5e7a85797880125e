"""Staging slots written with ordinary stores, non-temporal stores, or whichever each rank
measures faster (PYCOLL_SLOT_STORES=cached, streamed, auto): three communicators over the same
ranks, out-of-place all-reduce batches of about 0.1 s alternating between them for --seconds
per size, so that all three see the same changes of the machine (on a VM, the host moving the
ranks' cores closer or apart).

    mpiexec -n 2 python benchmarks/slot_stores.py [--sizes 1M,16M,64M] [--seconds 60]

Prints each batch's ms per call (cached/streamed/auto) and, per size, the mean over the run
and auto's ratio to each fixed way (>1: auto is faster).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.formulas import parse_size
from pycollectives.bench.timing import per_call

MODES = ("cached", "streamed", "auto")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="bytes per rank, comma-separated")
    ap.add_argument("--seconds", type=float, default=60)
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    comms = {}
    for mode in MODES:
        os.environ["PYCOLL_SLOT_STORES"] = mode
        comms[mode] = pc.Communicator(mpi)
    for size in (parse_size(s) for s in args.sizes.split(",")):
        x = np.ones(size // 4, np.float32)
        y = np.empty_like(x)
        reps = max(5, int(0.1 / (size / 8e9)))
        total = dict.fromkeys(MODES, 0.0)
        if mpi.rank == 0:
            print(
                f"# all_reduce float32 {size} bytes, {mpi.size} ranks:"
                " ms per call, cached/streamed/auto"
            )
        start = time.time()
        while mpi.bcast(time.time() - start < args.seconds):
            line = []
            for mode, comm in comms.items():
                t = per_call(mpi, lambda c=comm, x=x, y=y: c.all_reduce(x, out=y), reps)
                total[mode] += t
                line.append(f"{t * 1e3:.3f}")
            assert y[0] == mpi.size and y[-1] == mpi.size
            if mpi.rank == 0:
                print("/".join(line), end=" ", flush=True)
        if mpi.rank == 0:
            c, s, a = (total[m] for m in MODES)
            print(f"\n# {size} bytes: auto {c / a:.2f}x cached, {s / a:.2f}x streamed (whole run)")
    for comm in comms.values():
        comm.close()


if __name__ == "__main__":
    main()
