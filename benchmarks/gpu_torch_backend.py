"""torch.distributed on CUDA tensors over the "pycollectives" backend: its C++ device path
against the Python backend and gloo, same run, same GPU.

    mpiexec -n 2 python benchmarks/gpu_torch_backend.py [--max-bytes 128M] [--budget 1.5]

Groups of one job, every rank on its GPU (ranks sharing one where there are fewer):
  cxx     the default group: the C++ backend, CUDA tensors from torch's dispatcher to the CUDA
          transport on torch's current stream (no Python)
  python  the same backend with PYCOLL_TORCH_NATIVE=0: the Python ProcessGroup and Communicator
  gloo    torch's gloo (CUDA tensors staged through host memory)
(NCCL refuses two ranks on one GPU, so it is not a peer here.)

Reports, for float32 all-reduces of each size from 8 B: microseconds per call back to back
(calls queued, the stream synchronised once at the end) and synchronised (each call followed
by torch.cuda.synchronize()), the slowest rank's; then a step of stock DDP (an MLP of
--hidden x --layers, batch --batch) on each group and with no communication (local). Ratios
are to cxx from the same run. `--device cpu` with PYCOLL_TORCH_DEVICE=emulated runs the same
on the emulated device (CPU tensors standing for CUDA ones): a check of this script, not a
GPU figure.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch
import torch.distributed as dist
from mpi4py import MPI

import pycollectives.torch as pct
from pycollectives.bench.formulas import parse_size
from pycollectives.bench.timing import per_call, time_back_to_back, time_synchronised


def python_group():
    """A group of the same backend served by the Python ProcessGroup alone."""
    before = os.environ.get("PYCOLL_TORCH_NATIVE")
    os.environ["PYCOLL_TORCH_NATIVE"] = "0"  # read as the group's backend is made
    try:
        return dist.new_group(backend="pycollectives")
    finally:
        if before is None:
            del os.environ["PYCOLL_TORCH_NATIVE"]
        else:
            os.environ["PYCOLL_TORCH_NATIVE"] = before


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", type=parse_size, default=parse_size("128M"))
    ap.add_argument("--budget", type=float, default=1.5, help="seconds per measurement, at most")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    pct.init_process_group(timeout=120)
    if args.device == "cuda":
        torch.cuda.set_device(r % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())

        def sync():
            torch.cuda.synchronize(dev)
    else:
        dev = torch.device("cpu")

        def sync():
            pass

    groups = {"cxx": None, "python": python_group(), "gloo": dist.new_group(backend="gloo")}

    def report(line):
        if r == 0:
            print(line, flush=True)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the emulated device"
    report(f"# torch {torch.__version__} on {name}, {n} ranks; microseconds per all_reduce")
    report(f"{'bytes':>10} {'mode':>6} " + " ".join(f"{g:>10}" for g in groups) + "  ratios")
    nbytes = 8
    while nbytes <= args.max_bytes:
        t = torch.ones(nbytes // 4, device=dev)
        for mode in ("b2b", "sync"):
            got = {}
            for g, group in groups.items():

                def call(group=group, t=t):
                    dist.all_reduce(t, group=group)

                for _ in range(3):  # warm up: transports made, plans built
                    call()
                sync()
                one = per_call(mpi, call, 1, sync)
                calls = max(3, min(2000, int(args.budget / max(one, 1e-9))))
                if mode == "b2b":
                    got[g] = time_back_to_back(mpi, call, sync, calls)
                else:
                    got[g] = time_synchronised(mpi, call, sync, min(calls, 200))
            ratios = " ".join(f"{g}/cxx {got[g] / got['cxx']:.2f}" for g in groups if g != "cxx")
            cells = " ".join(f"{got[g] * 1e6:10.1f}" for g in groups)
            report(f"{nbytes:>10} {mode:>6} {cells}  {ratios}")
        nbytes *= 8 if nbytes < 1 << 20 else 2

    # Stock DDP: one step (forward, backward with its bucketed all-reduces, SGD).
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    base = torch.nn.Sequential(*layers[:-1]).to(dev)
    nparams = sum(p.numel() for p in base.parameters())
    x = torch.randn(args.batch, args.hidden, device=dev)
    models = {"local": copy.deepcopy(base)}
    for g, group in groups.items():
        models[g] = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), process_group=group
        )
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}

    def step(k):
        models[k](x).square().mean().backward()
        opts[k].step()
        opts[k].zero_grad()

    times = {}
    for k in models:
        for _ in range(3):
            step(k)
        sync()
        times[k] = statistics.median(
            per_call(mpi, lambda k=k: step(k), args.steps, sync) for _ in range(3)
        )
    report(f"# stock DDP, {nparams / 1e6:.1f} M parameters, batch {args.batch}/rank: ms per step")
    for k, v in times.items():
        ratio = "" if k in ("local", "cxx") else f"  {k}/cxx {v / times['cxx']:.2f}"
        report(f"  {k:>8}: {v * 1e3:8.2f}{ratio}")
    dist.destroy_process_group()
    mpi.Barrier()


if __name__ == "__main__":
    main()
