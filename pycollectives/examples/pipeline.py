"""Pipeline-parallel training of an MLP, one stage a rank, checked against one process.

    mpiexec -n 4 python -m pycollectives.examples.pipeline [--schedule gpipe|1f1b] \
        [--micro-batches 8] [--steps 20] [--optimizer sgd|adam] [--dtype float64|float32] \
        [--batch-size 64] [--layers L] [--hidden 256] [--blas-threads 1]

Every rank builds the same MLP from one seed (at least one Linear layer a rank) and keeps its
stage of it (``split_stages``, balanced by parameter count). Each step the batch, on rank 0,
is cut into micro-batches that flow through the stages (``Pipeline``, GPipe or 1F1B);
activations go forward and their gradients backward with send/recv, and each rank then runs
its optimizer on its own stage. The job prints the loss, the measured bubble (the fraction
of a step the ranks spent not computing) beside the theoretical (p-1)/(m+p-1), and finally
gathers every stage's parameters on rank 0 and compares them with the same model trained
there in one process on the whole batches: ``matches single-process training: yes`` (exit
code 1 if not). With more ranks than cores the measured bubble also counts the time a rank
waits for a core, so it lies well above the theory.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pycollectives as pc
from pycollectives.examples.common import (
    batches,
    classification_data,
    limit_blas_threads,
    report_match,
    train_one_process,
)
from pycollectives.parallel import nn, optim
from pycollectives.parallel.pipeline import Pipeline, split_stages, theoretical_bubble

N_IN, N_CLASSES = 32, 10


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def main(argv=None):
    ap = argparse.ArgumentParser(description="pipeline-parallel MLP (one stage a rank)")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64, help="whole batch of a step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=None, help="default 0.05 (sgd), 1e-3 (adam)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="Linear layers (default max(4, N))")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="BLAS threads a rank (default 1: one rank a core; needs threadpoolctl, else the "
        "BLAS default)",
    )
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    if args.micro_batches < 1 or args.batch_size % args.micro_batches:
        ap.error(f"--batch-size {args.batch_size} must split into --micro-batches "
                 f"{args.micro_batches} equal parts")  # fmt: skip
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 1e-3)
    dtype = np.dtype(args.dtype)

    limit_blas_threads(args.blas_threads)
    comm = pc.Communicator()
    rank, p = comm.rank, comm.size
    layers = args.layers or max(4, p)
    if layers < p:
        ap.error(f"--layers {layers} cannot fill {p} stages; use at least {p}")
    sizes = [N_IN] + [args.hidden] * (layers - 1) + [N_CLASSES]

    def build():
        return nn.mlp(sizes, np.random.default_rng(args.seed), dtype)

    stage = split_stages(build(), p)[rank]
    pipe = Pipeline(comm, stage, args.micro_batches, args.schedule)
    opt = optim.make(args.optimizer, stage.params, lr)
    x_all, y_all = classification_data(args.steps * args.batch_size, N_IN, N_CLASSES,
                                       seed=args.seed + 1, dtype=dtype)  # fmt: skip
    steps = batches(x_all, y_all, args.batch_size)
    if rank == 0:
        nparams = [sum(q.size for q in s.params) for s in split_stages(build(), p)]
        print(f"pipeline of {p} stages ({args.schedule}, {args.micro_batches} micro-batches "
              f"of {args.batch_size // args.micro_batches}), MLP {sizes}, parameters per "
              f"stage {nparams}, {args.optimizer} lr {lr}, {dtype}", flush=True)  # fmt: skip

    losses, bubbles = [], []
    t0 = time.perf_counter()
    for x, y in steps:
        loss = pipe.train_step(x if rank == 0 else None, y if rank == p - 1 else None)
        opt.step(stage.grads)
        losses.append(loss)
        bubbles.append(pipe.last_stats["bubble_fraction"])
    elapsed = time.perf_counter() - t0
    losses = comm.broadcast_object(losses, root=p - 1)
    measured = float(np.mean(bubbles[1:] if len(bubbles) > 1 else bubbles))  # step 1: warm-up
    if rank == 0:
        every = max(1, args.steps // 10)
        for k, loss in enumerate(losses):
            if k % every == 0 or k == args.steps - 1:
                print(f"step {k + 1:3d}  loss {loss:.4f}")
        print(f"{args.steps} steps in {elapsed:.2f} s")
        print(f"bubble fraction: measured {measured:.2f}, theoretical (p-1)/(m+p-1) = "
              f"{theoretical_bubble(p, args.micro_batches):.2f}", flush=True)  # fmt: skip

    got = comm.all_gather_object([host(q) for q in stage.params])
    ok = True
    if rank == 0:
        want = train_one_process(build(), steps, args.optimizer, lr)
        ok = report_match([q for ps in got for q in ps], [host(q) for q in want], dtype)
    ok = comm.broadcast_object(ok)
    comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
