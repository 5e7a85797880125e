"""GPU collectives: pycollectives' CUDA transport vs NCCL vs host-staged MPI, same run.

    mpiexec -n 2 python benchmarks/gpu_bench.py [--max-bytes 1G] [--collectives all_reduce,...]
    mpiexec -n 4 python benchmarks/gpu_bench.py

Written for ranks sharing one GPU (2 and 4 ranks on the test machine), but runs on any
number of GPUs. For each size (float32, 8 B to --max-bytes) it prints latency and nccl-tests
busbw (all-reduce 2(n-1)/n, all-gather (n-1)/n with bytes = the gathered size) of:
  ours        pycollectives.cuda.CudaComm (sync mode printed: kernel or host)
  nccl        torch.distributed over NCCL (NCCL_MULTI_RANK_GPU_ENABLE=1; skipped when NCCL
              cannot run several ranks on one GPU, or torch is missing)
  staged      what a user would write with mpi4py: copy to host, MPI Allreduce/Allgather,
              copy back
and the physical bound: on one GPU every rank's data crosses HBM, so an all-reduce of S bytes
over n ranks moves at least 2*n*S bytes through it (all-gather: n*S written + S*n read),
timed against a device-to-device copy of a large buffer. Times: slowest rank, median of
--iters timed calls after warm-up, each call synchronised.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

from pycollectives.bench.gpu import hbm_copy_bandwidth, staged_runner, torch_nccl


def fail(msg: str):
    if MPI.COMM_WORLD.rank == 0:
        print(f"gpu_bench: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)


def sizes(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def timed(fn, sync, iters: int, mpi) -> float:
    """Slowest rank's median seconds per call."""
    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return mpi.allreduce(float(np.median(samples)), op=MPI.MAX)


def measure(coll, count, comm, nccl, cp, mpi, iters):
    """(ours, nccl, host-staged) seconds per call for one size."""
    n = mpi.size
    stream = cp.cuda.get_current_stream()
    x = cp.ones(count, cp.float32)
    out = cp.empty(count * (n if coll == "all_gather" else 1), cp.float32)
    staged_run = staged_runner(mpi, coll, "sum", 0, np.dtype(np.float32))

    def ours():
        if coll == "all_reduce":
            comm.all_reduce(x, out, 0, None, stream, False)
        else:
            comm.all_gather(x, out, None, stream, False)

    def staged():
        staged_run(x, out, False)  # copy to host, MPI Allreduce/Allgather, copy back

    t_ours = timed(ours, stream.synchronize, iters, mpi)
    t_staged = timed(staged, stream.synchronize, max(2, iters // 2), mpi)
    t_nccl = float("nan")
    if nccl is not None:
        torch, dist = nccl
        tx = torch.ones(count, device="cuda")
        tout = torch.empty(out.size, device="cuda")

        def with_nccl():
            if coll == "all_reduce":
                dist.all_reduce(tx)
            else:
                dist.all_gather_into_tensor(tout, tx)

        t_nccl = timed(with_nccl, torch.cuda.synchronize, iters, mpi)
    return t_ours, t_nccl, t_staged


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", type=parse_bytes, default=8)
    ap.add_argument("--max-bytes", type=parse_bytes, default=1 << 30)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--collectives", default="all_reduce,all_gather")
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD

    from pycollectives.cuda import CudaComm, cuda_available

    ok, why = cuda_available()
    if not ok:
        fail(f"needs a CUDA GPU: {why}")
    try:
        import cupy as cp
    except ImportError:
        fail("needs cupy (pip install cupy-cuda12x)")

    comm = CudaComm(mpi, mpi.rank, mpi.size, timeout=120)
    cp.cuda.Device(comm.device).use()
    n = mpi.size
    hbm = mpi.allreduce(hbm_copy_bandwidth(cp), op=MPI.MIN)
    nccl, nccl_what = torch_nccl(mpi, comm.device)
    devices = sorted(set(mpi.allgather(comm.device)))  # every rank: it is a collective
    if mpi.rank == 0:
        print(f"# {n} ranks, devices {devices}, sync={comm.sync_mode}")
        print(f"# HBM copy bandwidth {hbm / 1e9:.1f} GB/s (read+write); {nccl_what}")

    for coll in args.collectives.split(","):
        factor = 2 * (n - 1) / n if coll == "all_reduce" else (n - 1) / n
        if mpi.rank == 0:
            print(f"\n## {coll} float32, busbw factor {factor:.3f}")
            print(
                f"{'bytes':>12} {'ours us':>10} {'busbw':>8} {'nccl us':>10} {'busbw':>8} "
                f"{'staged us':>10} {'bound us':>10} {'ours/nccl':>9} {'staged/ours':>11} "
                f"{'bound/ours':>10}"
            )
        for nbytes in sizes(args.min_bytes, args.max_bytes):
            count = max(nbytes // 4, 2)
            t_ours, t_nccl, t_staged = measure(coll, count, comm, nccl, cp, mpi, args.iters)
            size_bytes = count * 4
            busbytes = size_bytes * (n if coll == "all_gather" else 1)
            # On one GPU every rank's data crosses the same HBM (all-gather: each rank writes
            # n*S and reads n*S; all-reduce: 2*n*S in all).
            traffic = 2 * n * size_bytes * (n if coll == "all_gather" else 1)
            t_bound = traffic / hbm
            if mpi.rank == 0:
                bw_ours, bw_nccl = (busbytes * factor / t / 1e9 for t in (t_ours, t_nccl))
                print(
                    f"{size_bytes:>12} {t_ours * 1e6:>10.1f} {bw_ours:>8.2f} "
                    f"{t_nccl * 1e6:>10.1f} {bw_nccl:>8.2f} "
                    f"{t_staged * 1e6:>10.1f} {t_bound * 1e6:>10.1f} {t_ours / t_nccl:>9.2f} "
                    f"{t_staged / t_ours:>11.2f} {t_bound / t_ours:>10.3f}"
                )
            cp.get_default_memory_pool().free_all_blocks()
    comm.close()
    if nccl is not None:
        nccl[1].destroy_process_group()


if __name__ == "__main__":
    main()
