"""Data-parallel training of a small classifier on scikit-learn's bundled digits.

    mpiexec -n 4 python -m pycollectives.examples.train [--epochs 20] [--batch-size 32]

Every rank holds a replica of a two-layer MLP and trains on its own shard of each epoch's
shuffled data; after each backward pass the gradients (views into one flat buffer) are
averaged with one all-reduce. Parameters start identical (broadcast from rank 0), so the
replicas stay bit-identical, which the job checks at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pycollectives as pc


class MLP:
    """784 -> hidden -> 10 with ReLU; parameters and gradients live in flat float32 buffers."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, rng: np.random.Generator):
        shapes = [(n_in, n_hidden), (n_hidden,), (n_hidden, n_out), (n_out,)]
        sizes = [int(np.prod(s)) for s in shapes]
        self.flat = np.zeros(sum(sizes), np.float32)
        self.grad = np.zeros_like(self.flat)
        self.params, self.grads, offset = [], [], 0
        for shape, size in zip(shapes, sizes):
            self.params.append(self.flat[offset : offset + size].reshape(shape))
            self.grads.append(self.grad[offset : offset + size].reshape(shape))
            offset += size
        self.params[0][...] = rng.normal(0, np.sqrt(2 / n_in), shapes[0])
        self.params[2][...] = rng.normal(0, np.sqrt(2 / n_hidden), shapes[2])

    def forward(self, x):
        w1, b1, w2, b2 = self.params
        h = np.maximum(x @ w1 + b1, 0)
        return h, h @ w2 + b2

    def loss_and_backward(self, x, y):
        w1, b1, w2, b2 = self.params
        h, logits = self.forward(x)
        logits = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
        d = p
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        gw1, gb1, gw2, gb2 = self.grads
        gw2[...] = h.T @ d
        gb2[...] = d.sum(axis=0)
        dh = (d @ w2.T) * (h > 0)
        gw1[...] = x.T @ dh
        gb1[...] = dh.sum(axis=0)
        return float(loss)


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def progress(done: int, total: int, text: str):
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}")
    sys.stderr.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description="data-parallel MLP on sklearn digits")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    comm = pc.Communicator()
    rank, size = comm.rank, comm.size
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    model = MLP(x_train.shape[1], args.hidden, 10, np.random.default_rng(args.seed + rank))
    comm.broadcast(model.flat, root=0)  # identical replicas, whatever each rank drew

    # Each epoch: one shared permutation, padded to a multiple of size, strided shards.
    steps = int(np.ceil(len(x_train) / size / args.batch_size))
    if rank == 0:
        print(
            f"training on {len(x_train)} digits with {size} ranks, "
            f"{model.flat.size} parameters, {steps} steps/epoch of {args.batch_size}/rank"
        )
    t0 = time.perf_counter()
    stats = np.zeros(2, np.float64)  # loss sum, batches
    for epoch in range(args.epochs):
        perm = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))
        perm = np.resize(perm, steps * args.batch_size * size)
        shard = perm[rank::size]
        stats[:] = 0
        for step in range(steps):
            idx = shard[step * args.batch_size : (step + 1) * args.batch_size]
            stats[0] += model.loss_and_backward(x_train[idx], y_train[idx])
            stats[1] += 1
            comm.all_reduce(model.grad, op=pc.AVG)
            model.flat -= args.lr * model.grad
            if rank == 0:
                progress(step + 1, steps, f"epoch {epoch + 1}/{args.epochs}")
        comm.all_reduce(stats)
        _, logits = model.forward(x_test)
        acc = float((logits.argmax(axis=1) == y_test).mean())
        if rank == 0:
            if sys.stderr.isatty():
                sys.stderr.write("\r" + " " * 60 + "\r")
            print(f"epoch {epoch + 1:3d}  loss {stats[0] / stats[1]:.4f}  test accuracy {acc:.4f}")
    elapsed = time.perf_counter() - t0

    # Replicas must be bit-identical: gather every rank's parameters and compare bytes.
    gathered = np.empty(size * model.flat.size, np.float32)
    comm.all_gather(model.flat, gathered)
    replicas = gathered.reshape(size, -1)
    identical = all(
        np.array_equal(replicas[0].view(np.uint32), r.view(np.uint32)) for r in replicas
    )
    if rank == 0:
        print(f"final test accuracy {acc:.4f} after {args.epochs} epochs in {elapsed:.1f} s")
        print(f"replicas bit-identical across {size} ranks: {'yes' if identical else 'NO'}")
    comm.close()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
