"""torch.distributed operations on the "pycollectives" backend vs gloo, same run.

    mpiexec -n 2 python benchmarks/torch_backend_vs_gloo.py [--sizes 8,65536,16777216]

The default process group is pycollectives (``pycollectives.torch.init_process_group``), and a
gloo group spans the same ranks. For each size (bytes of float32), µs per call of
``dist.all_reduce``, ``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor`` (best
of --rounds batches, slowest rank), and gloo's time over ours (>1: ours is faster).
"""

from __future__ import annotations

import argparse
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
    n, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        print(f"# {n} ranks, torch {torch.__version__}; us per call, best of {args.rounds}")
        print(f"# {'op':<16}{'bytes':>10}{'ours':>12}{'gloo':>12}{'gloo/ours':>11}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = max(1, nbytes // 4)
        iters = int(min(2000, max(5, (64 << 20) // max(nbytes, 1) // 4)))
        x = torch.ones(count)
        big = torch.ones(count * n)
        cases = {
            "all_reduce": lambda g, x=x: dist.all_reduce(x, group=g),
            "all_gather": lambda g, x=x, big=big: dist.all_gather_into_tensor(big, x, group=g),
            "reduce_scatter": lambda g, x=x, big=big: dist.reduce_scatter_tensor(x, big, group=g),
        }
        for name, fn in cases.items():
            ours = timed(lambda fn=fn: fn(None), iters, args.rounds)
            theirs = timed(lambda fn=fn: fn(gloo), iters, args.rounds)
            if r == 0:
                print(
                    f"  {name:<16}{nbytes:>10}{ours:>12.1f}{theirs:>12.1f}{theirs / ours:>10.2f}x"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
