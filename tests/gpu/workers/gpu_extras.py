"""Streams, async work and torch tensors on the CUDA transport.

Usage: mpiexec -n N python gpu_extras.py stream|async|torch|mismatch
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
from checks import run_main
from gpu_common import use_local_device
from mpi4py import MPI

from pycollectives.cuda import CudaComm
from pycollectives.errors import CollectiveMismatch

SUM = 0


def check_stream(comm: CudaComm):
    # A kernel queued on a stream right before the collective is seen by it.
    n = comm.size
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(1 << 20, cp.float32)
    for it in range(5):
        with s:
            x.fill(comm.rank + it)
        comm.all_reduce(x, None, SUM, None, s, False)
        with s:
            x *= 2  # queued after the collective on the same stream: sees its result
        s.synchronize()
        want = 2 * sum(r + it for r in range(n))
        assert float(x[0]) == want and float(x[-1]) == want, (it, float(x[0]), want)
    # The array library's current stream is used when none is given.
    with s:
        x.fill(1)
        comm.all_reduce(x, None, SUM, None, None, False)
        got = float(x.sum())
    assert got == n * x.size, got
    print(f"stream rank={comm.rank}")


def check_async(comm: CudaComm):
    x = cp.full(1 << 18, comm.rank + 1, cp.float64)
    out = cp.empty_like(x)
    work = comm.all_reduce(x, out, SUM, None, None, True)
    work.wait()  # later work on the current stream waits for the collective
    total = float(out.sum())
    assert total == x.size * sum(range(1, comm.size + 1)), total
    assert work.is_completed()
    bufs = [cp.full(100, comm.rank, cp.int32) for _ in range(4)]
    works = [comm.broadcast(b, 0, None, None, True) for b in bufs]
    for w in works:
        w.wait()
    cp.cuda.get_current_stream().synchronize()
    assert all(w.is_completed() for w in works)
    assert all(int(w.result()[7]) == 0 for w in works)
    print(f"async rank={comm.rank}")


def check_torch(comm: CudaComm):
    import torch

    dev = torch.device("cuda", comm.device)
    base = torch.arange(3000) % 100
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        x = (base * (comm.rank + 1)).to(dt).to(dev)
        want = sum((base * (r + 1)).to(dt).double() for r in range(comm.size))
        comm.all_reduce(x, None, SUM, None, None, False)
        got = x.double().cpu().numpy()
        tol = 0.02 if dt in (torch.bfloat16, torch.float16) else 1e-6
        assert np.allclose(got, want.numpy(), rtol=tol, atol=tol), dt
        digests = MPI.COMM_WORLD.allgather(x.cpu().view(torch.uint8).numpy().tobytes())
        assert len(set(digests)) == 1, f"{dt}: ranks differ"
    # A non-default torch stream, given explicitly.
    s = torch.cuda.Stream(device=dev)
    y = torch.empty(1 << 16, device=dev)
    with torch.cuda.stream(s):
        y.fill_(comm.rank)
    comm.all_reduce(y, None, SUM, None, s, False)
    s.synchronize()
    assert float(y[0]) == sum(range(comm.size))
    print(f"torch rank={comm.rank}")


def check_mismatch(comm: CudaComm):
    # Ranks that disagree on the count: CollectiveMismatch everywhere, before any launch.
    x = cp.zeros(10 + comm.rank, cp.float32)
    try:
        comm.all_reduce(x, None, SUM, None, None, False)
    except CollectiveMismatch as e:
        assert "count" in str(e), e
    else:
        raise AssertionError("mismatched counts were not detected")
    # A barrier against a collective is a mismatch too.
    comm2 = CudaComm(MPI.COMM_WORLD, MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, timeout=30)
    try:
        if comm.rank == 0:
            comm2.barrier()
        else:
            comm2.broadcast(cp.zeros(4, cp.int32), 0, None, None, False)
    except CollectiveMismatch:
        pass
    else:
        raise AssertionError("a barrier against a broadcast was not detected")
    finally:
        comm2.close()
    print(f"mismatch rank={comm.rank}")


def main():
    what = sys.argv[1]
    use_local_device()
    comm = CudaComm(MPI.COMM_WORLD, MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, timeout=60)
    checks = {"stream": check_stream, "async": check_async, "torch": check_torch}
    checks["mismatch"] = check_mismatch
    try:
        checks[what](comm)
    finally:
        comm.close()


if __name__ == "__main__":
    run_main(main)
