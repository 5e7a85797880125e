"""Where a small GPU collective's time goes on the host: the same 8 B all-reduce on cupy arrays
called through each layer, back to back, with the wall and CPU time per call.

    PYCOLL_CUDA_SYNC=kernel mpiexec -n 2 python benchmarks/gpu_call_cost.py [--calls 2000]

Layers, outermost first:
  Communicator   comm.all_reduce(x, out): what a user calls (blocking, on cupy arrays: the
                 one-step path, one crossing into C++ that describes, checks and queues it)
  CudaComm       the CUDA transport's Python object (argument description and checks)
  native.run     its C++ call alone: fingerprints, events, the launch
When wall equals CPU time, the host, not the GPU, sets the pace. Slowest rank; --profile
also prints rank 0's cProfile of the Communicator calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from mpi4py import MPI

import pycollectives as pc
from pycollectives.backends import Call
from pycollectives.backends.cuda.args import described


def per_call(mpi, fn, sync, calls: int) -> tuple:
    """(wall, CPU) seconds per call of `calls` back-to-back calls, the slowest rank's."""
    for _ in range(50):
        fn()
    sync()
    mpi.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    sync()
    wall = (time.perf_counter() - t0) / calls
    cpu = (time.process_time() - c0) / calls
    return mpi.allreduce(wall, op=MPI.MAX), mpi.allreduce(cpu, op=MPI.MAX)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import cupy as cp

    mpi = MPI.COMM_WORLD
    comm = pc.Communicator(mpi, timeout=60)
    x, out = cp.ones(2, cp.float32), cp.empty(2, cp.float32)
    stream = cp.cuda.get_current_stream()
    comm.all_reduce(x, out)  # starts the CUDA transport
    stream.synchronize()
    inner = comm._cuda
    native = inner._native_comm()
    xd, od, _ = described("all_reduce", x, out, None, mpi.rank, inner.device)
    call = Call("all_reduce", x, out)
    sptr = stream.ptr

    layers = {
        "Communicator": lambda: comm.all_reduce(x, out),
        "CudaComm": lambda: inner.all_reduce(x, out),
        "native.run": lambda: native.run(call, xd, od, sptr),
    }
    if mpi.rank == 0:
        print(f"# {mpi.size} ranks, sync={inner.sync_mode}, 8 B all-reduce, {args.calls} calls")
    for name, fn in layers.items():
        wall, cpu = per_call(mpi, fn, stream.synchronize, args.calls)
        if mpi.rank == 0:
            print(f"{name:14s} wall {wall * 1e6:7.1f} us/call   cpu {cpu * 1e6:7.1f} us/call")
    if args.profile:
        prof = cProfile.Profile() if mpi.rank == 0 else None
        if prof:
            prof.enable()
        for _ in range(args.calls):
            comm.all_reduce(x, out)
        stream.synchronize()
        if prof:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
            print(text.getvalue())
    comm.close()


if __name__ == "__main__":
    main()
