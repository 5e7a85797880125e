"""Training step time: pycollectives' DistributedDataParallel, and torch's on the pycollectives
backend and on gloo, same run.

    mpiexec -n 2 python benchmarks/ddp_vs_torch.py [--hidden 2048] [--layers 4] [--steps 20]

An MLP of --layers square layers (default ~16.8 M parameters), batch --batch per rank, SGD;
one thread per rank. Reports per step (slowest rank, median of --rounds batches): local
(no communication), ours (pycollectives.torch.DistributedDataParallel), torch DDP on the
"pycollectives" backend, torch DDP on gloo; the all-reduce of all gradients alone, on a plain
array (what torch DDP's buckets are) and on a Communicator.zeros one (what ours are:
allreduce_shared); and the fraction of that communication hidden behind backward:
1 - (step - local) / allreduce.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import pycollectives as pc
import pycollectives.torch as pct
from pycollectives.bench.timing import per_call
from pycollectives.torch import DistributedDataParallel as OurDDP


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--bucket-view",
        action="store_true",
        help="torch DDP with gradient_as_bucket_view=True (no copies into its buckets)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    n, r = world.size, world.rank
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    base = torch.nn.Sequential(*layers[:-1])
    nparams = sum(p.numel() for p in base.parameters())
    x = torch.randn(args.batch, args.hidden)

    pct.init_process_group()  # the default group: the "pycollectives" backend
    gloo = dist.new_group(backend="gloo")
    comm = pc.Communicator()

    def DDP(module, **kw):
        return torch.nn.parallel.DistributedDataParallel(
            module, gradient_as_bucket_view=args.bucket_view, **kw
        )

    models = {
        "local": copy.deepcopy(base),
        "ours": OurDDP(copy.deepcopy(base), comm),
        "torch_ours": DDP(copy.deepcopy(base)),
        "torch_gloo": DDP(copy.deepcopy(base), process_group=gloo),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}

    def step(k):
        m, o = models[k], opts[k]
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()

    flats = {"allreduce": np.zeros(nparams, np.float32), "allreduce_shared": comm.zeros(nparams)}

    def allreduce_only(k):
        comm.all_reduce(flats[k], op=pc.AVG)

    def timed(fn, k):
        return per_call(world, lambda: fn(k), args.steps)

    cases = [(k, step) for k in models] + [(k, allreduce_only) for k in flats]
    for k, fn in cases:  # warm up (bucket rebuild, allocations)
        for _ in range(3):
            fn(k)
    times = {k: [] for k, _ in cases}
    for _ in range(args.rounds):
        for k, fn in cases:
            times[k].append(timed(fn, k))
    t = {k: statistics.median(v) for k, v in times.items()}
    if r == 0:
        print(
            f"# {nparams / 1e6:.1f} M parameters, batch {args.batch}/rank, {n} ranks, "
            f"1 thread/rank, median of {args.rounds} x {args.steps} steps; torch DDP "
            f"gradient_as_bucket_view={args.bucket_view}"
        )
        for k in ("local", "ours", "torch_ours", "torch_gloo", *flats):
            print(f"  {k:>16}: {t[k] * 1e3:8.1f} ms")
        for k, alone in (("ours", "allreduce_shared"), ("torch_ours", "allreduce")):
            hidden = max(0.0, min(1.0, 1 - (t[k] - t["local"]) / t[alone]))
            print(
                f"  {k} / torch DDP (gloo): {t[k] / t['torch_gloo']:.2f}x step time, "
                f"{hidden * 100:.0f}% of the communication hidden behind backward"
            )
    comm.close()
    dist.destroy_process_group()
    world.Barrier()


if __name__ == "__main__":
    main()
