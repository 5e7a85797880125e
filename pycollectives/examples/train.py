"""Data-parallel training of a small classifier on scikit-learn's bundled digits.

    mpiexec -n 4 python -m pycollectives.examples.train [--epochs 20] [--batch-size 32]

Every rank holds a replica of a two-layer MLP (pc.DataParallel) and trains on its own shard
of each epoch's shuffled data (pc.DistributedSampler). Backward writes gradients into bucket
views, last layer first, and each full bucket starts its all-reduce while backward goes on.
Parameters start identical (broadcast from rank 0), so the replicas stay bit-identical,
which the job checks at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pycollectives as pc


class MLP:
    """in -> hidden -> out with ReLU, as four parameter arrays [w1, b1, w2, b2]."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, rng: np.random.Generator):
        self.params = [
            rng.normal(0, np.sqrt(2 / n_in), (n_in, n_hidden)).astype(np.float32),
            np.zeros(n_hidden, np.float32),
            rng.normal(0, np.sqrt(2 / n_hidden), (n_hidden, n_out)).astype(np.float32),
            np.zeros(n_out, np.float32),
        ]

    def forward(self, x):
        w1, b1, w2, b2 = self.params
        h = np.maximum(x @ w1 + b1, 0)
        return h, h @ w2 + b2

    def loss_and_backward(self, x, y, grads, ready=lambda i: None):
        """Mean cross-entropy; writes gradients into `grads` last layer first, calling
        ready(i) as each one is final (so its bucket can start averaging)."""
        w1, b1, w2, b2 = self.params
        h, logits = self.forward(x)
        logits = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
        d = p
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        grads[3][...] = d.sum(axis=0)
        ready(3)
        np.matmul(h.T, d, out=grads[2])
        ready(2)
        dh = (d @ w2.T) * (h > 0)
        grads[1][...] = dh.sum(axis=0)
        ready(1)
        np.matmul(x.T, dh, out=grads[0])
        ready(0)
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


def relaunch(ranks: int, argv) -> int:
    """Runs this job again under mpiexec (the one next to this Python, else on PATH)."""
    import os
    import shutil
    import subprocess

    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = here if os.path.exists(here) else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("--ranks needs mpiexec (pip install mpich)")
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "pycollectives.examples.train", *args]
    return subprocess.call(cmd)


def main(argv=None):
    ap = argparse.ArgumentParser(description="data-parallel MLP on sklearn digits")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--first-bucket-mb", type=float, default=1.0)
    ap.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="started without mpiexec: relaunch under mpiexec with this many ranks",
    )
    args = ap.parse_args(argv)
    if args.ranks is not None:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() == 1 and args.ranks > 1:
            return relaunch(args.ranks, argv)

    comm = pc.Communicator()
    rank, size = comm.rank, comm.size
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    model = MLP(x_train.shape[1], args.hidden, 10, np.random.default_rng(args.seed + rank))
    # Broadcasts rank 0's parameters (replicas start identical, whatever each rank drew).
    dp = pc.DataParallel(
        comm, model.params, args.bucket_cap_mb, args.first_bucket_mb, names=["w1", "b1", "w2", "b2"]
    )
    sampler = pc.DistributedSampler(len(x_train), size, rank, shuffle=True, seed=args.seed)
    steps = int(np.ceil(len(sampler) / args.batch_size))
    nparams = sum(p.size for p in model.params)
    if rank == 0:
        print(
            f"training on {len(x_train)} digits with {size} ranks, {nparams} parameters, "
            f"{steps} steps/epoch of {args.batch_size}/rank"
        )
    t0 = time.perf_counter()
    stats = np.zeros(2, np.float64)  # loss sum, batches
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        shard = sampler.indices()
        stats[:] = 0
        for step in range(steps):
            idx = shard[step * args.batch_size : (step + 1) * args.batch_size]
            stats[0] += model.loss_and_backward(x_train[idx], y_train[idx], dp.grads, dp.mark_ready)
            stats[1] += 1
            dp.synchronize()
            for p, g in zip(model.params, dp.grads):
                p -= args.lr * g
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
    flat = np.concatenate([p.ravel() for p in model.params])
    gathered = np.empty(size * flat.size, np.float32)
    comm.all_gather(flat, gathered)
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
