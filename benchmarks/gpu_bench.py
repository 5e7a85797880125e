"""GPU collectives through pycollectives.Communicator vs NCCL vs host-staged MPI, against the
memory bound and the floors, all measured in the same run.

    mpiexec -n 2 python benchmarks/gpu_bench.py [--max-bytes 128M] [--json FILE]
    PYCOLL_CUDA_SYNC=kernel mpiexec -n 4 python benchmarks/gpu_bench.py   # under MPS

Each size (float32, 8 B to --max-bytes, x4) is timed through the public API a user calls,
``Communicator.all_reduce(x, out)`` / ``all_gather(x, out)`` / ``reduce_scatter(x, out)`` on
cupy arrays (--collectives; all-reduce and all-gather unless asked), two ways:
  sync      each call followed by a synchronisation of the stream (what a latency-bound
            caller sees): the slowest rank's median
  b2b       back to back: many calls queued, one synchronisation, time / calls (what a
            throughput-bound caller sees, e.g. one bucket after another)
and beside it, in the same run:
  staged    what an mpi4py user writes: copy to the host, MPI's collective, copy back
  nccl      NCCL on the same ranks (cupy.cuda.nccl or torch.distributed), or why it cannot
            run (NCCL refuses ranks that share a GPU)
  bound     the memory bound (pycollectives.bench.formulas, shared with pycoll-bench): one
            rank's least traffic (all-reduce: read S, write S) over the copy bandwidth one
            rank gets while every rank copies at once; equivalently every rank's traffic over
            the whole GPU's bandwidth when ranks share one GPU
and the floors, printed first: an empty kernel launched and synchronised, the same launched
back to back, and one flag's round trip between two processes' kernels through CUDA IPC
memory (only where kernels of different processes run side by side: own GPUs or MPS); in
kernel mode also 100 8 B all-reduces captured into one CUDA graph, the time per call of a
launch of it.

Small messages travel in the LL format (data and flag in one store) in kernel mode, up to
PYCOLL_CUDA_LL_BYTES (printed in the header); PYCOLL_CUDA_LL_BYTES=0 runs them without it, to
compare the two in one kit run (tools/gpu/run.sh, bench-mps).

Sizes are nccl-tests': all-gather's is the gathered output (each rank gives size / n),
reduce-scatter's the whole input (each rank gets size / n).
Ratios: "of bound" = bound / b2b; "x floor" = sync / the launch+sync floor; "staged/sync" and
"nccl/sync" > 1 mean ours is faster.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

from pycollectives.bench import formulas as F
from pycollectives.bench import gpu, timing
from pycollectives.options import Options

SYNC_BUDGET_S = 0.25  # time each mode may take per size (at least 3 calls)
B2B_BUDGET_S = 0.15


def fail(msg: str):
    if MPI.COMM_WORLD.rank == 0:
        print(f"gpu_bench: {msg}", file=sys.stderr)
    sys.exit(2)


def sizes(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def counts(coll: str, nbytes: int, n: int) -> tuple:
    """(elements each rank gives, elements each rank gets) for a size of `nbytes`."""
    if coll in ("all_gather", "reduce_scatter"):  # nbytes: the whole gathered or scattered
        per_rank = max(nbytes // (4 * n), 1)
        return (per_rank, per_rank * n) if coll == "all_gather" else (per_rank * n, per_rank)
    count = max(nbytes // 4, 2)
    return count, count


def measure(coll, nbytes, comm, nccl, cp, mpi, iters, calls, registered=False) -> dict:
    """One row: every time in seconds (nan where a peer cannot run), and the size.
    `registered`: our input and output are registered buffers (comm.empty on the GPU), over
    which an all-reduce runs the two-shot; the peers use the same arrays."""
    n = mpi.size
    stream = cp.cuda.get_current_stream()
    give, get = counts(coll, nbytes, n)
    # Small integers, not zeros (nothing runs faster on special values), so that every sum is
    # exact in float32 whatever the order of the additions.
    given = (np.arange(give) % 1024).astype(np.float32)
    if registered:
        device = cp.cuda.Device().id
        x = comm.empty(give, np.float32, device=device)
        x.set(given)
        out = comm.empty(get, np.float32, device=device)
    else:
        x = cp.asarray(given)
        out = cp.empty(get, cp.float32)

    def ours():
        if coll == "all_reduce":
            comm.all_reduce(x, out)
        elif coll == "all_gather":
            comm.all_gather(x, out)
        else:
            comm.reduce_scatter(x, out)

    row = {"size": max(give, get) * 4}  # reduce-scatter: its input, all-gather: its output
    sync = stream.synchronize
    native = comm._cuda._native_comm()
    before = native.first_use_runs
    ours()  # the first call of a shape plans it (or registers its arrays on first use)
    sync()
    row["first_use"] = native.first_use_runs > before  # ran zero-copy on unregistered arrays
    k = timing.calls_for(mpi, ours, sync, SYNC_BUDGET_S, iters)
    row["sync"] = timing.time_synchronised(mpi, ours, sync, k)
    k = timing.calls_for(mpi, ours, sync, B2B_BUDGET_S, calls, least=2)
    row["b2b"] = timing.time_back_to_back(mpi, ours, sync, k)
    if coll == "all_reduce":
        expect = given * n
    elif coll == "all_gather":
        expect = np.tile(given, n)
    else:
        expect = given[mpi.rank * get : (mpi.rank + 1) * get] * n
    if not np.array_equal(cp.asnumpy(out), expect):
        raise SystemExit(f"gpu_bench: rank {mpi.rank}: {coll} of {row['size']} B is wrong")

    staged = gpu.staged_runner(mpi, coll, "sum", 0, np.dtype(np.float32))

    def run_staged():
        staged(x, out, False)

    k = timing.calls_for(mpi, run_staged, sync, SYNC_BUDGET_S, max(3, iters // 2))
    row["staged"] = timing.time_synchronised(mpi, run_staged, sync, k)
    row["nccl"] = float("nan")
    run = nccl.runner(coll, "sum", 0, np.dtype(np.float32)) if nccl.reason is None else None
    if callable(run):
        nsync = getattr(run, "sync", sync)

        def run_nccl():
            run(x, out, False)

        run_nccl()
        k = timing.calls_for(mpi, run_nccl, nsync, SYNC_BUDGET_S, iters)
        row["nccl"] = timing.time_synchronised(mpi, run_nccl, nsync, k)
    return row


def derived(coll: str, row: dict, n: int, copy_bw_gbs: float, floors) -> dict:
    """The row's bound and ratios (rank 0 prints them). Times in seconds, bandwidths in GB/s."""
    bound = F.bound_time(coll, row["size"], n, copy_bw_gbs)
    return {
        "bound": bound,
        "busbw": F.busbw(coll, n, row["size"], row["b2b"]),
        "of_bound": bound / row["b2b"],
        "x_floor": row["sync"] / floors.launch_sync,
        "staged_ratio": row["staged"] / row["sync"],
        "nccl_ratio": row["nccl"] / row["sync"],
    }


def us(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.1f} us"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", type=F.parse_size, default=8)
    ap.add_argument("--max-bytes", type=F.parse_size, default=128 << 20)
    ap.add_argument("--iters", type=int, default=20, help="synchronised calls per size, at most")
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per size, at most")
    ap.add_argument("--collectives", default="all_reduce,all_gather")
    ap.add_argument("--json", help="also write every row to this file (rank 0)")
    ap.add_argument(
        "--registered",
        action="store_true",
        help="our arrays are registered buffers (comm.empty on the GPU): all-reduce runs the "
        "two-shot, all-gather and reduce-scatter read peers' buffers directly",
    )
    args = ap.parse_args()
    colls = args.collectives.split(",")
    bad = [c for c in colls if c not in ("all_reduce", "all_gather", "reduce_scatter")]
    if bad:
        fail(f"unknown collective {bad[0]!r}: all_reduce, all_gather, reduce_scatter")
    mpi = MPI.COMM_WORLD
    n = mpi.size
    try:
        dev = gpu.open_device(mpi, np.dtype(np.float32))
    except gpu.Unusable as e:
        fail(f"needs a CUDA GPU and cupy: {e}")
    cp = dev.cp
    import pycollectives as pc

    comm = pc.Communicator(mpi, timeout=120)
    warm = cp.ones(2, cp.float32)
    comm.all_reduce(warm)  # starts the CUDA transport
    cp.cuda.get_current_stream().synchronize()
    mode = comm._cuda.sync_mode  # kernel: one launch per call; host: the host drives steps
    first_use = Options.resolve().cuda_register_bytes  # registration on first use (0: off)
    ll_bytes = Options.resolve().cuda_ll_bytes if mode == "kernel" else 0  # stepped mode: none
    copy_bw = gpu.copy_bandwidth(mpi, dev)
    floors = gpu.measure_floors(mpi, cp, kernel_mode=mode == "kernel")
    graph, graph_why = None, "kernel mode only (stepped mode cannot be captured)"
    if mode == "kernel":
        graph, graph_why = gpu.graph_per_call(mpi, cp, comm)
    nccl = gpu.Nccl(mpi, dev)
    if mpi.rank == 0:
        print(f"# {n} ranks on {dev.name}, devices {sorted(set(dev.devices))}, sync={mode}, "
              f"LL format up to {ll_bytes} B (PYCOLL_CUDA_LL_BYTES; 0: off)")  # fmt: skip
        print(
            f"# copy bandwidth per rank, all ranks copying: {copy_bw:.1f} GB/s "
            f"({2 * copy_bw * dev.devices.count(dev.index):.0f} GB/s of traffic on the GPU)"
        )
        print(f"# floors: launch+sync {us(floors.launch_sync)}, launch back to back "
              f"{us(floors.launch_b2b)}, IPC flag round trip {us(floors.ping_pong)}"
              + (f" ({floors.why})" if floors.why else ""))  # fmt: skip
        print(f"# 8 B all-reduces in a CUDA graph of 100, per call: {us(graph)}"
              + (f" ({graph_why})" if graph_why else ""))  # fmt: skip
        print(f"# nccl: {nccl.what}")
        if args.registered:
            print("# our arrays: registered buffers (comm.empty on the GPU): no staging")
        elif first_use:
            print(f"# our arrays: cupy's pool, registered on first use from {first_use} B "
                  "(PYCOLL_CUDA_REGISTER_BYTES); rows marked * ran zero-copy")  # fmt: skip
    results = {"ranks": n, "device": dev.name, "sync_mode": mode, "ll_max_bytes": ll_bytes,
               "registered": args.registered, "register_bytes": first_use,
               "copy_bw_gbs": copy_bw,
               "floors": vars(floors), "graph_per_call": graph, "nccl": nccl.what,
               "rows": {}}  # fmt: skip
    for coll in colls:
        if mpi.rank == 0:
            print(f"\n## {coll} float32 (busbw factor {F.bus_factor(coll, n):.3f})")
            print(f"{'bytes':>10} {'sync us':>9} {'b2b us':>9} {'busbw':>7} {'staged us':>10} "
                  f"{'nccl us':>8} {'bound us':>9} {'of bound':>8} {'x floor':>7} "
                  f"{'staged/sync':>11} {'nccl/sync':>9}")  # fmt: skip
        rows = []
        for nbytes in sizes(args.min_bytes, args.max_bytes):
            row = measure(
                coll, nbytes, comm, nccl, cp, mpi, args.iters, args.calls, args.registered
            )
            row.update(derived(coll, row, n, copy_bw, floors))
            rows.append(row)
            if mpi.rank == 0:
                print(f"{row['size']:>10} {row['sync'] * 1e6:>9.1f} {row['b2b'] * 1e6:>9.1f} "
                      f"{row['busbw']:>7.2f} {row['staged'] * 1e6:>10.1f} "
                      f"{row['nccl'] * 1e6:>8.1f} {row['bound'] * 1e6:>9.1f} "
                      f"{row['of_bound']:>8.1%} {row['x_floor']:>7.1f} "
                      f"{row['staged_ratio']:>11.2f} {row['nccl_ratio']:>9.2f}"
                      + (" *" if row["first_use"] else ""),
                      flush=True)  # fmt: skip
            dev.release()
        results["rows"][coll] = rows
    if args.json and mpi.rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    nccl.close()
    comm.close()


if __name__ == "__main__":
    main()
