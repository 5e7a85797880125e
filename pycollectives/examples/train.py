"""Data-parallel training of a small classifier on scikit-learn's bundled digits.

    mpiexec -n 4 python -m pycollectives.examples.train [--epochs 20] [--batch-size 32]
    python -m pycollectives.launch -n 4 --max-restarts 3 -- \
        python -m pycollectives.examples.train --checkpoint-dir ckpt

Every rank holds a replica of a two-layer MLP (pc.DataParallel) and trains on its own shard
of each epoch's shuffled data (pc.DistributedSampler). Backward writes gradients into bucket
views, last layer first, and each full bucket starts its all-reduce while backward goes on.
Parameters start identical (broadcast from rank 0), so the replicas stay bit-identical,
which the job checks at the end. With a GPU and cupy (``--device auto``, the default) the
model, data and gradient buckets live on the GPU and the all-reduces run there (CUDA IPC);
otherwise everything stays in host memory.

With ``--checkpoint-dir`` rank 0 saves the parameters, the optimizer's momentum, and where
training stands (epoch, step, the sampler's position) at the end of every epoch (or every
``--checkpoint-every`` steps), atomically; a job started again (by ``pycollectives.launch``
after a rank died, or by hand) resumes from there and ends where an undisturbed run ends.
``--fail-rank R --fail-at-step S`` makes rank R kill itself (SIGKILL) at global step S, on
the first run only (``PYCOLL_RESTART_COUNT`` 0): a drill for the restart.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import numpy as np

import pycollectives as pc
from pycollectives import trace
from pycollectives.examples.common import digits_mlp_parser, digits_split


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
    from pycollectives.backends.cuda import cuda_available

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
        from pycollectives.backends.cuda import choose_device

        local_rank = comm.topology.local_of[comm.rank]
        device = choose_device(None, local_rank, cupy.cuda.runtime.getDeviceCount())
        cupy.cuda.Device(device).use()  # the GPU the communicator picks for this rank
        return cupy, f"the GPU (device {device} on rank {comm.rank}, CUDA IPC)"
    if device == "gpu":
        raise SystemExit(f"--device gpu: {why or 'a rank has no usable GPU'}")
    return np, "the CPU (shared memory)"


def progress(done: int, total: int, text: str):
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}")
    sys.stderr.flush()


def relaunch(ranks: int, argv) -> int:
    """Runs this job again under mpiexec (the one next to this Python, else on PATH)."""
    import subprocess

    from pycollectives.launch import find_mpiexec

    args = list(sys.argv[1:] if argv is None else argv)
    cmd = [
        find_mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "pycollectives.examples.train",
        *args,
    ]
    return subprocess.call(cmd)


def main(argv=None):
    ap = digits_mlp_parser("data-parallel MLP on sklearn digits", epochs=20)
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
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
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here (rank 0) and resume from the latest one at start",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="save every STEPS steps (default 0: at the end of every epoch)",
    )
    ap.add_argument("--fail-rank", type=int, default=None, help="drill: this rank dies ...")
    ap.add_argument(
        "--fail-at-step", type=int, default=None, help="... at this global step (first run only)"
    )
    args = ap.parse_args(argv)
    if (args.fail_rank is None) != (args.fail_at_step is None):
        ap.error("--fail-rank and --fail-at-step go together")
    if args.checkpoint_every < 0:
        ap.error(f"--checkpoint-every must be at least 0, got {args.checkpoint_every}")
    if args.ranks is not None:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() == 1 and args.ranks > 1:
            return relaunch(args.ranks, argv)

    comm = pc.Communicator()
    rank, size = comm.rank, comm.size
    xp, where = array_module(args.device, comm)
    (x_train, y_train), (x_test, y_test) = digits_split(args.seed)
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
    velocity = [xp.zeros_like(p) for p in model.params] if args.momentum else []
    state = {f"velocity/{i}": v for i, v in enumerate(velocity)}
    ckpt = os.path.join(args.checkpoint_dir, "checkpoint.npz") if args.checkpoint_dir else None
    # What a checkpoint must agree on to be resumed by this run.
    run_key = {
        "ranks": size,
        "batch_size": args.batch_size,
        "hidden": args.hidden,
        "seed": args.seed,
        "momentum": args.momentum,
    }
    start_epoch = start_step = 0
    loss_carry = 0.0  # the loss summed over the steps of start_epoch before start_step
    if ckpt and os.path.exists(ckpt):
        meta = dp.load(ckpt, state)
        if meta.get("run") != run_key:
            raise SystemExit(f"{ckpt} was saved by a different run ({meta.get('run')})")
        start_epoch, start_step, loss_carry = meta["epoch"], meta["step"], meta["loss_sum"]
        if rank == 0:
            print(
                f"resumed from {ckpt}: epoch {start_epoch + 1}, step {start_step} "
                f"(global step {meta['global_step']}, sampler at sample "
                f"{meta['sampler_offset']} of its epoch-{meta['sampler_epoch']} order)",
                flush=True,
            )
    drill = args.fail_rank == rank and os.environ.get("PYCOLL_RESTART_COUNT", "0") == "0"

    def save(epoch, step, global_step, loss_sum):
        meta = {
            "run": run_key,
            "epoch": epoch,
            "step": step,
            "global_step": global_step,
            "loss_sum": float(loss_sum),
            "sampler_epoch": epoch,
            "sampler_offset": step * args.batch_size,
        }
        with trace.span("checkpoint", step=global_step):
            dp.save(ckpt, state, meta)

    def accuracy():
        _, logits = model.forward(x_test)
        return float((logits.argmax(axis=1) == y_test).mean())

    acc = accuracy()  # as it stands (the value printed if a checkpoint says training is over)
    t0 = time.perf_counter()
    stats = np.zeros(2, np.float64)  # loss sum, batches
    global_step = start_epoch * steps + start_step
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        shard = sampler.indices()
        first = start_step if epoch == start_epoch else 0
        loss_sum = xp.full((), loss_carry if epoch == start_epoch else 0.0, xp.float64)
        for step in range(first, steps):
            if drill and global_step == args.fail_at_step:
                print(f"rank {rank}: dying at global step {global_step} (--fail-rank)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            with trace.span("step", epoch=epoch, step=global_step):
                idx = xp.asarray(shard[step * args.batch_size : (step + 1) * args.batch_size])
                loss_sum += model.loss_and_backward(
                    x_train[idx], y_train[idx], dp.grads, dp.mark_ready
                )
                dp.synchronize()
                if velocity:
                    for p, v, g in zip(model.params, velocity, dp.grads):
                        v *= args.momentum
                        v += g
                        p -= args.lr * v
                else:
                    for p, g in zip(model.params, dp.grads):
                        p -= args.lr * g
            global_step += 1
            if rank == 0:
                progress(step + 1, steps, f"epoch {epoch + 1}/{args.epochs}")
            if ckpt and args.checkpoint_every and global_step % args.checkpoint_every == 0:
                if step + 1 < steps:  # the end of an epoch is saved below, with its loss
                    save(epoch, step + 1, global_step, loss_sum)
        stats[:] = (float(loss_sum), steps)
        comm.all_reduce(stats)
        acc = accuracy()
        if rank == 0:
            if sys.stderr.isatty():
                sys.stderr.write("\r" + " " * 60 + "\r")
            print(f"epoch {epoch + 1:3d}  loss {stats[0] / stats[1]:.4f}  test accuracy {acc:.4f}")
        if ckpt:
            save(epoch + 1, 0, global_step, 0.0)
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
        digest = hashlib.sha256(gathered[: flat.size].tobytes()).hexdigest()[:16]
        print(f"parameters sha256 {digest}")
        print(f"replicas bit-identical across {size} ranks: {'yes' if identical else 'NO'}")
    comm.close()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
