"""ZeRO-sharded data-parallel training of an MLP, checked against training in one process.

    mpiexec -n 4 python -m pycollectives.examples.zero [--stage 1|2|3] [--optimizer adam|sgd]
        [--steps 20] [--batch-size 64] [--accumulate K] [--dtype float64|float32]

Every rank builds the same MLP from one seed and trains on its own equal part of each batch
with ``parallel.ZeroDataParallel`` (stage 3 by default: parameters, gradients and optimizer
state all sharded). ``--accumulate K`` splits each rank's part into K micro-batches, the first
K-1 under ``no_sync``. At the end rank 0 trains the same model in one process on the whole
batches and compares the final parameters: ``matches single-process training: yes (...)``.
The job also prints how much model state one rank holds, against an unsharded replica.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np

import pycollectives as pc
from pycollectives.examples.common import (
    batches,
    blas_share,
    classification_data,
    limit_blas_threads,
    report_match,
    train_one_process,
)
from pycollectives.parallel import nn
from pycollectives.parallel.zero import ZeroDataParallel

MIB = 2**20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m pycollectives.examples.zero", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-3 (adam), 0.05 (sgd)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64, help="the whole batch, all ranks")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per rank and step")
    ap.add_argument("--sizes", default="32,256,256,256,10", help="layer widths")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--bucket-cap-mb", type=float, default=0.25, help="stages 1, 2: unit size")
    return ap.parse_args(argv)


def setup(args):
    """(model, optimizer keywords, data) alike on every rank."""
    sizes = [int(s) for s in args.sizes.split(",")]
    lr = args.lr if args.lr is not None else (1e-3 if args.optimizer == "adam" else 0.05)
    kw = {"momentum": 0.9} if args.optimizer == "sgd" else {}
    x, y = classification_data(args.batch_size * args.steps, sizes[0], sizes[-1], seed=1,
                               dtype=args.dtype)  # fmt: skip
    return nn.mlp(sizes, np.random.default_rng(0), args.dtype), lr, kw, (x, y)


def train_single(args) -> list:
    """The same training in one process: the whole batch at once."""
    model, lr, kw, data = setup(args)
    return train_one_process(model, batches(*data, args.batch_size), args.optimizer, lr, **kw)


def train_zero(comm, args, log=print):
    """Trains with ZeRO; returns the ZeroDataParallel."""
    model, lr, kw, data = setup(args)
    zero = ZeroDataParallel(comm, model, args.optimizer, lr, stage=args.stage,
                            bucket_cap_mb=args.bucket_cap_mb, **kw)  # fmt: skip
    per_rank = args.batch_size // comm.size
    micro = per_rank // args.accumulate
    t0 = time.perf_counter()
    for step, (xb, yb) in enumerate(batches(*data, args.batch_size)):
        mine_x = xb[comm.rank * per_rank : (comm.rank + 1) * per_rank]
        mine_y = yb[comm.rank * per_rank : (comm.rank + 1) * per_rank]
        loss = 0.0
        for k in range(args.accumulate):
            rows = slice(k * micro, (k + 1) * micro)
            last = k == args.accumulate - 1
            with zero.no_sync() if not last else contextlib.nullcontext():
                out, caches = zero.forward(mine_x[rows])
                part, d = nn.softmax_cross_entropy(out, mine_y[rows], denom=per_rank)
                zero.backward(d, caches)
            loss += float(part)
        zero.step()
        if step % 5 == 0 or step == args.steps - 1:
            log(f"step {step:3d}  loss (rank {comm.rank}'s part) {loss:.4f}")
    zero.seconds = time.perf_counter() - t0
    return zero


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = pc.Communicator()
    limit_blas_threads(blas_share(comm.size))  # the ranks share this machine's cores
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    if args.batch_size % (comm.size * args.accumulate):
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {comm.size} ranks "
                         f"x {args.accumulate} micro-batches")  # fmt: skip
    say(f"ZeRO stage {args.stage}, {args.optimizer}, {comm.size} ranks, batch {args.batch_size}, "
        f"layers {args.sizes}, {args.dtype}")  # fmt: skip
    zero = train_zero(comm, args, say)
    held = zero.state_bytes()
    got = zero.full_parameters()
    say(f"{args.steps} steps in {zero.seconds:.2f} s")
    frac = held["total"] / held["unsharded"]
    say(f"per-rank model state: {held['total'] / MIB:.3f} MiB = {frac:.2f} "
        f"of {held['unsharded'] / MIB:.3f} MiB (parameters {held['params'] / MIB:.3f}, gradients "
        f"{held['grads'] / MIB:.3f}, optimizer {held['optimizer'] / MIB:.3f} MiB)")  # fmt: skip
    ok = True
    if comm.rank == 0:
        ok = report_match(got, train_single(args), args.dtype)
    ok = comm.broadcast_object(ok, root=0)
    comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
