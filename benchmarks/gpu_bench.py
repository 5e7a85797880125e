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
import os
import sys
import time

import numpy as np
from mpi4py import MPI


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


def hbm_copy_bandwidth(cp) -> float:
    """Bytes moved through HBM per second (read + write) by a device-to-device copy."""
    n = 1 << 30
    a, b = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    b.data.copy_from_device(a.data, n)
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.data.copy_from_device(a.data, n)
    cp.cuda.runtime.deviceSynchronize()
    return 2 * n * 5 / (time.perf_counter() - t0)


def setup_nccl(mpi, device: int):
    """A torch.distributed NCCL group over the same ranks, or (None, why not)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, "torch is not installed"
    os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000 if mpi.rank == 0 else 0))
    os.environ["MASTER_PORT"] = mpi.bcast(os.environ["MASTER_PORT"])
    error = None
    try:
        import datetime

        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", rank=mpi.rank, world_size=mpi.size, timeout=datetime.timedelta(seconds=60)
        )
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    except Exception as e:  # NCCL refuses duplicate GPUs in many versions
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    errors = [e for e in mpi.allgather(error) if e]
    if errors:
        return None, errors[0]
    return (torch, dist), f"NCCL {torch.cuda.nccl.version()}"


def measure(coll, count, comm, nccl, cp, mpi, iters):
    """(ours, nccl, host-staged) seconds per call for one size."""
    n = mpi.size
    stream = cp.cuda.get_current_stream()
    x = cp.ones(count, cp.float32)
    out = cp.empty(count * (n if coll == "all_gather" else 1), cp.float32)
    host_x, host_out = cp.asnumpy(x), cp.asnumpy(out)

    def ours():
        if coll == "all_reduce":
            comm.all_reduce(x, out, 0, None, stream, False)
        else:
            comm.all_gather(x, out, None, stream, False)

    def staged():
        x.get(out=host_x)
        if coll == "all_reduce":
            mpi.Allreduce(host_x, host_out)
        else:
            mpi.Allgather(host_x, host_out)
        out.set(host_out)

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
    nccl, nccl_what = setup_nccl(mpi, comm.device)
    if mpi.rank == 0:
        print(
            f"# {n} ranks, devices {sorted(set(mpi.allgather(comm.device)))}, sync={comm.sync_mode}"
        )
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
