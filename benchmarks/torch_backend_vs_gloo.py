"""torch.distributed operations on the "pycollectives" backend vs gloo, same run.

    mpiexec -n 2 python benchmarks/torch_backend_vs_gloo.py [--sizes 8,65536,16777216]

The default process group is pycollectives (``pycollectives.torch.init_process_group``), and
a gloo group and a second pycollectives group on its Python backend alone
(``PYCOLL_TORCH_NATIVE=0``) span the same ranks. For each size (bytes of float32), µs per call
of ``dist.all_reduce``, ``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor`` and the
list forms ``dist.all_gather`` and ``dist.reduce_scatter`` (best of --rounds batches, slowest
rank) on each, the same call on the communicator itself (numpy
arrays, no torch: what the torch layers add is the difference), and gloo's time over ours
(>1: ours is faster). First, where the time of one 8-byte all_reduce goes, layer by layer:
torch's Python ``dist.all_reduce``, the ProcessGroup binding and torch's dispatcher, our
backend called directly, the communicator alone.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist

import pycollectives.torch as pct

warnings.filterwarnings("ignore", category=FutureWarning)


def timed(fn, iters, rounds):
    for _ in range(min(iters, 20)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, float(elapsed))
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,1024,65536,1048576,16777216")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pct.init_process_group()
    gloo = dist.new_group(backend="gloo")
    os.environ["PYCOLL_TORCH_NATIVE"] = "0"
    python = dist.new_group(backend=pct.BACKEND)
    del os.environ["PYCOLL_TORCH_NATIVE"]
    comm = pct.communicator()
    n, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        print(f"# {n} ranks, torch {torch.__version__}; us per call, best of {args.rounds}")
        print("# ours: the C++ backend; python: the Python one; comm: the communicator itself")
    t, opts = torch.zeros(2), dist.AllreduceOptions()
    world, x = dist.group.WORLD, t.numpy()
    backend = world._get_backend(torch.device("cpu"))
    layers = {
        "dist.all_reduce(t)": lambda: dist.all_reduce(t),
        "ProcessGroup.allreduce([t], opts) (dispatcher)": lambda: world.allreduce([t], opts),
        "our Backend.allreduce([t], opts)": lambda: backend.allreduce([t], opts),
        "Communicator.all_reduce(numpy array)": lambda: comm.all_reduce(x),
    }
    for name, fn in layers.items():
        us = timed(fn, 5000, args.rounds)
        if r == 0:
            print(f"# 8 B all_reduce, {name:<48}{us:8.2f} us")
    if r == 0:
        head = "".join(f"{k:>10}" for k in ("ours", "python", "comm", "gloo"))
        print(f"# {'op':<20}{'bytes':>10}{head}{'gloo/ours':>11}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = max(1, nbytes // 4)
        iters = int(min(2000, max(5, (64 << 20) // max(nbytes, 1) // 4)))
        x = torch.ones(count)
        big = torch.ones(count * n)
        xa, biga = x.numpy(), big.numpy()
        outs, parts = [torch.empty(count) for _ in range(n)], list(big.chunk(n))
        cases = {
            "all_reduce": (
                lambda g, x=x: dist.all_reduce(x, group=g),
                lambda x=xa: comm.all_reduce(x),
            ),
            "all_gather": (
                lambda g, x=x, big=big: dist.all_gather_into_tensor(big, x, group=g),
                lambda x=xa, big=biga: comm.all_gather(x, big),
            ),
            "reduce_scatter": (
                lambda g, x=x, big=big: dist.reduce_scatter_tensor(x, big, group=g),
                lambda x=xa, big=biga: comm.reduce_scatter(big, x),
            ),
        }
        # The list forms, beside the same direct calls.
        cases["all_gather list"] = (
            lambda g, x=x, outs=outs: dist.all_gather(outs, x, group=g),
            cases["all_gather"][1],
        )
        cases["reduce_scatter list"] = (
            lambda g, x=x, parts=parts: dist.reduce_scatter(x, parts, group=g),
            cases["reduce_scatter"][1],
        )
        for name, (fn, direct) in cases.items():
            t = {k: timed(lambda fn=fn, g=g: fn(g), iters, args.rounds)
                 for k, g in (("ours", None), ("python", python))}  # fmt: skip
            t["comm"] = timed(direct, iters, args.rounds)
            t["gloo"] = timed(lambda fn=fn: fn(gloo), iters, args.rounds)
            if r == 0:
                cols = "".join(f"{v:>10.1f}" for v in t.values())
                print(f"  {name:<20}{nbytes:>10}{cols}{t['gloo'] / t['ours']:>10.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
