"""Data-parallel training of a small classifier on scikit-learn's bundled digits.

    mpiexec -n 4 python -m pycollectives.examples.train [--epochs 20] [--batch-size 32]

Every rank holds a replica of a two-layer MLP (pc.DataParallel) and trains on its own shard
of each epoch's shuffled data (pc.DistributedSampler). Backward writes gradients into bucket
views, last layer first, and each full bucket starts its all-reduce while backward goes on.
Parameters start identical (broadcast from rank 0), so the replicas stay bit-identical,
which the job checks at the end. With a GPU and cupy (``--device auto``, the default) the
model, data and gradient buckets live on the GPU and the all-reduces run there (CUDA IPC);
otherwise everything stays in host memory.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pycollectives as pc


class MLP:
    """in -> hidden -> out with ReLU, as four parameter arrays [w1, b1, w2, b2] of the array
    module `xp` (numpy, or cupy on the GPU)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, rng: np.random.Generator, xp=np):
        self.xp = xp
        host = [
            rng.normal(0, np.sqrt(2 / n_in), (n_in, n_hidden)).astype(np.float32),
            np.zeros(n_hidden, np.float32),
            rng.normal(0, np.sqrt(2 / n_hidden), (n_hidden, n_out)).astype(np.float32),
            np.zeros(n_out, np.float32),
        ]
        self.params = [xp.asarray(p) for p in host]

    def forward(self, x):
        w1, b1, w2, b2 = self.params
        h = self.xp.maximum(x @ w1 + b1, 0)
        return h, h @ w2 + b2

    def loss_and_backward(self, x, y, grads, ready=lambda i: None):
        """Mean cross-entropy; writes gradients into `grads` last layer first, calling
        ready(i) as each one is final (so its bucket can start averaging)."""
        xp = self.xp
        w1, b1, w2, b2 = self.params
        h, logits = self.forward(x)
        logits = logits - logits.max(axis=1, keepdims=True)
        p = xp.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        rows = xp.arange(len(y))
        loss = -xp.log(p[rows, y] + 1e-12).mean()
        d = p
        d[rows, y] -= 1
        d /= len(y)
        grads[3][...] = d.sum(axis=0)
        ready(3)
        xp.matmul(h.T, d, out=grads[2])
        ready(2)
        dh = (d @ w2.T) * (h > 0)
        grads[1][...] = dh.sum(axis=0)
        ready(1)
        xp.matmul(x.T, dh, out=grads[0])
        ready(0)
        return loss  # a 0-d array: reading it on the host would wait for the GPU


def array_module(device: str, comm):
    """(numpy or cupy, where it runs) for --device; every rank makes the same choice."""
    if device == "cpu":
        return np, "the CPU (shared memory)"
    from pycollectives.cuda import cuda_available

    ok, why = cuda_available()
    if ok:
        try:
            import cupy
        except ImportError:
            ok, why = False, "cupy is not installed"
    # The GPU only if every rank can use it.
    votes = np.array([1 if ok else 0], np.int32)
    comm.all_reduce(votes, op="min")
    if votes[0]:
        from pycollectives.cuda import choose_device

        local_rank = comm.topology.local_of[comm.rank]
        device = choose_device(None, local_rank, cupy.cuda.runtime.getDeviceCount())
        cupy.cuda.Device(device).use()  # the GPU the communicator picks for this rank
        return cupy, f"the GPU (device {device} on rank {comm.rank}, CUDA IPC)"
    if device == "gpu":
        raise SystemExit(f"--device gpu: {why or 'a rank has no usable GPU'}")
    return np, "the CPU (shared memory)"


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
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="gpu: model and all-reduces on the GPU (needs cupy); auto: gpu when usable",
    )
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
    xp, where = array_module(args.device, comm)
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    x_train, y_train, x_test, y_test = (xp.asarray(a) for a in (x_train, y_train, x_test, y_test))
    model = MLP(x_train.shape[1], args.hidden, 10, np.random.default_rng(args.seed + rank), xp)
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
            f"{steps} steps/epoch of {args.batch_size}/rank, on {where}"
        )
    t0 = time.perf_counter()
    stats = np.zeros(2, np.float64)  # loss sum, batches
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        shard = sampler.indices()
        loss_sum = xp.zeros((), xp.float64)
        for step in range(steps):
            idx = xp.asarray(shard[step * args.batch_size : (step + 1) * args.batch_size])
            loss_sum += model.loss_and_backward(x_train[idx], y_train[idx], dp.grads, dp.mark_ready)
            dp.synchronize()
            for p, g in zip(model.params, dp.grads):
                p -= args.lr * g
            if rank == 0:
                progress(step + 1, steps, f"epoch {epoch + 1}/{args.epochs}")
        stats[:] = (float(loss_sum), steps)
        comm.all_reduce(stats)
        _, logits = model.forward(x_test)
        acc = float((logits.argmax(axis=1) == y_test).mean())
        if rank == 0:
            if sys.stderr.isatty():
                sys.stderr.write("\r" + " " * 60 + "\r")
            print(f"epoch {epoch + 1:3d}  loss {stats[0] / stats[1]:.4f}  test accuracy {acc:.4f}")
    elapsed = time.perf_counter() - t0

    # Replicas must be bit-identical: gather every rank's parameters and compare bytes.
    flat = xp.concatenate([p.ravel() for p in model.params])
    gathered = xp.empty(size * flat.size, xp.float32)
    comm.all_gather(flat, gathered)
    replicas = gathered.reshape(size, -1)
    identical = all(
        bool(xp.array_equal(replicas[0].view(xp.uint32), r.view(xp.uint32))) for r in replicas
    )
    if rank == 0:
        print(f"final test accuracy {acc:.4f} after {args.epochs} epochs in {elapsed:.1f} s")
        print(f"replicas bit-identical across {size} ranks: {'yes' if identical else 'NO'}")
    comm.close()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
