"""Tensor-parallel (Megatron-LM style) training of a small classifier, checked against one process.

    mpiexec -n 4 python -m pycollectives.examples.tensor_parallel [--steps 40] \
        [--optimizer sgd|adam] [--dtype float64|float32] [--blocks 2]

The model is a replicated input ``Linear`` and ReLU, then ``--blocks`` ``ParallelMLP`` blocks
(each: a ``ColumnParallelLinear`` to ``--ffn`` hidden units, ReLU, a ``RowParallelLinear`` back,
then ReLU), then a replicated output ``Linear``. Each rank holds ``ffn / ranks`` of every
block's hidden units: one all-reduce per block in forward, one in backward. Every rank sees the
same data (``classification_data``) and computes the same loss; the replicated layers get the
same gradients on every rank with no communication of their own.

At the end the job gathers the full parameters of every layer and compares them with a single
process training the same model built of plain ``nn.Linear``/``ReLU`` from the same seed, the
same way; it exits 1 when they differ by more than rounding (sums run in a different order).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pycollectives as pc
from pycollectives.examples.common import (
    blas_share,
    classification_data,
    limit_blas_threads,
    report_match,
)
from pycollectives.parallel import nn, optim
from pycollectives.parallel.tensor import ParallelMLP, full_parameters


def build(args, comm=None):
    """The model: tensor-parallel blocks with `comm`, or plain ``nn.Linear`` ones without it.
    Both draw the same weights from the same seed, in the same order."""
    rng = np.random.default_rng(args.seed)
    dt = np.dtype(args.dtype)
    layers = [nn.Linear(args.features, args.hidden, rng, dt), nn.ReLU()]
    for _ in range(args.blocks):
        if comm is None:
            block = [nn.Linear(args.hidden, args.ffn, rng, dt), nn.ReLU(),
                     nn.Linear(args.ffn, args.hidden, rng, dt)]  # fmt: skip
        else:
            block = [ParallelMLP(comm, args.hidden, args.ffn, args.hidden, rng, dt)]
        layers += block + [nn.ReLU()]
    layers.append(nn.Linear(args.hidden, args.classes, rng, dt))
    return nn.Sequential(layers)


def train(model, args, x, labels, log=None):
    """`args.steps` full-batch steps; returns the last loss."""
    opt = optim.make(args.optimizer, model.params, args.lr)
    loss = float("nan")
    for step in range(args.steps):
        logits, cache = model.forward(x)
        loss, dlogits = nn.softmax_cross_entropy(logits, labels)
        model.zero_grad()
        model.backward(dlogits, cache)
        opt.step(model.grads)
        if log is not None and (step % max(args.steps // 5, 1) == 0 or step == args.steps - 1):
            acc = float((logits.argmax(axis=1) == labels).mean())
            log(f"step {step + 1:4d}  loss {float(loss):.4f}  accuracy {acc:.3f}")
    return float(loss)


def main(argv=None):
    ap = argparse.ArgumentParser(description="tensor-parallel MLP checked against one process")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--lr", type=float, default=None, help="default: 0.1 (sgd), 0.01 (adam)")
    ap.add_argument("--blocks", type=int, default=2, help="ParallelMLP blocks (default 2)")
    ap.add_argument("--hidden", type=int, default=32, help="width between blocks")
    ap.add_argument("--ffn", type=int, default=96, help="hidden units of each block, split")
    ap.add_argument("--features", type=int, default=20)
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.blocks < 1:
        ap.error("--steps and --blocks must be at least 1")
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 0.01

    comm = pc.Communicator()
    limit_blas_threads(blas_share(comm.size))  # the ranks share this machine's cores
    rank, size = comm.rank, comm.size
    if args.ffn % size:
        if rank == 0:
            print(f"--ffn {args.ffn} does not split over {size} ranks: pass a multiple of {size}")
        comm.close()
        return 2
    x, labels = classification_data(args.samples, args.features, args.classes, args.seed,
                                    np.dtype(args.dtype))  # fmt: skip
    model = build(args, comm)
    blocks = [layer for layer in model.layers if isinstance(layer, ParallelMLP)]

    def log(line):
        if rank == 0:
            print(line, flush=True)

    log(f"{size} ranks, {args.blocks} ParallelMLP blocks of {args.ffn} hidden units "
        f"({args.ffn // size} on each rank), {args.optimizer}, {args.dtype}, "
        f"{args.steps} steps on {args.samples} samples")  # fmt: skip
    t0 = time.perf_counter()
    train(model, args, x, labels, log)
    elapsed = time.perf_counter() - t0
    counts = [b.collectives for b in blocks]
    fwd = {c["forward"] // args.steps for c in counts}
    bwd = {c["backward"] // args.steps for c in counts}
    per = "/".join(str(n) for n in sorted(fwd))
    log(f"each ParallelMLP block: {per} all-reduce per forward, "
        f"{'/'.join(str(n) for n in sorted(bwd))} per backward ({elapsed:.2f} s)")  # fmt: skip

    got = [np.asarray(p) for p in full_parameters(model)]  # collective: every rank gathers
    ok = True
    if rank == 0:
        reference = build(args)
        train(reference, args, x, labels)
        ok = report_match(got, reference.params, args.dtype)
    ok = comm.broadcast_object(ok)
    comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
