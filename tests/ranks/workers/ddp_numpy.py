"""DataParallel / GradientBucketer behaviour on several ranks (numpy model)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from checks import run_each, run_main
from mpi4py import MPI

import pycollectives as pc
from pycollectives.examples.train import MLP

MB = 1 << 20


def data(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 20)).astype(np.float32), rng.integers(0, 5, n)


def equivalence(comm, steps=6, b=8, lr=0.2):
    """N ranks with local batch b end where 1 rank with batch N*b does."""
    n, r = comm.size, comm.rank
    x, y = data(steps * n * b)
    ref = MLP(20, 32, 5, np.random.default_rng(0))
    ref_grads = [np.zeros_like(p) for p in ref.params]
    # Other ranks draw different weights: construction must replace them with rank 0's.
    model = MLP(20, 32, 5, np.random.default_rng(0 if r == 0 else 100 + r))
    dp = pc.DataParallel(comm, model.params, bucket_cap_mb=2048 / MB, first_bucket_mb=512 / MB)
    assert len(dp.bucketer.buckets) > 1
    for k in range(steps):
        lo = k * n * b
        ref.loss_and_backward(x[lo : lo + n * b], y[lo : lo + n * b], ref_grads)
        for p, g in zip(ref.params, ref_grads):
            p -= lr * g
        mine = slice(lo + r * b, lo + (r + 1) * b)
        model.loss_and_backward(x[mine], y[mine], dp.grads, dp.mark_ready)
        dp.synchronize()
        for p, g in zip(model.params, dp.grads):
            p -= lr * g
    for p, q in zip(model.params, ref.params):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    flat = np.concatenate([p.ravel() for p in model.params])
    assert len(set(MPI.COMM_WORLD.allgather(flat.tobytes()))) == 1, "replicas differ"


def overlap(comm):
    """The first bucket's all-reduce starts while backward is still going."""
    shapes = [((1000,), np.float32)] * 4
    bk = pc.GradientBucketer(comm, shapes, bucket_cap_mb=4000 / MB, first_bucket_mb=4000 / MB)
    assert len(bk.buckets) == 4
    g = bk.grads
    for i in (3, 2, 1, 0):  # backward: last layer first, with compute in between
        g[i][...] = comm.rank + i
        bk.mark_ready(i)
        if i:
            time.sleep(0.05)
    backward_done = time.perf_counter()
    bk.synchronize()
    assert bk.launch_times[0] < backward_done - 0.1, (bk.launch_times, backward_done)
    for i in range(4):
        assert np.allclose(bk.grads[i], np.mean(range(comm.size)) + i)


def no_sync(comm):
    """Gradients accumulate locally inside no_sync; the next step averages the sums."""
    n, r = comm.size, comm.rank
    bk = pc.GradientBucketer(comm, [((5,), np.float64), ((3,), np.float64)], rebuild=False)
    for micro in range(3):
        ctx = bk.no_sync() if micro < 2 else _null()
        with ctx:
            for i in (1, 0):
                bk.grads[i][...] += (r + 1) * (micro + 1)
                bk.mark_ready(i)
            bk.synchronize()
        if micro < 2:  # nothing communicated yet: still local sums
            assert np.all(bk.grads[0] == (r + 1) * sum(range(1, micro + 2)))
    want = sum((q + 1) * 6 for q in range(n)) / n
    assert np.allclose(bk.grads[0], want) and np.allclose(bk.grads[1], want)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def missed_gradient(comm):
    bk = pc.GradientBucketer(comm, [((4,), np.float32)] * 3, names=["w1", "w2", "w3"])
    bk.mark_ready(2)
    bk.mark_ready(0)
    try:
        bk.synchronize()
    except RuntimeError as e:
        assert "w2" in str(e) and "never marked ready" in str(e), str(e)
    else:
        raise AssertionError("a missing gradient went unnoticed")


def rebuild(comm):
    """After the first step the buckets follow the order gradients arrived (rank 0's)."""
    bk = pc.GradientBucketer(
        comm, [((1000,), np.float32)] * 4, bucket_cap_mb=4000 / MB, first_bucket_mb=4000 / MB
    )
    assert [b.params for b in bk.buckets] == [[3], [2], [1], [0]]
    for i in (0, 1, 2, 3):  # arrives in registration order instead
        bk.grads[i][...] = i + comm.rank
        bk.mark_ready(i)
    bk.synchronize()
    assert [b.params for b in bk.buckets] == [[0], [1], [2], [3]]
    for i in range(4):  # values survive the new layout
        assert np.allclose(bk.grads[i], i + np.mean(range(comm.size)))


def shared_buckets(comm):
    """numpy buckets come from comm.zeros (memory the ranks map, so large bucket all-reduces
    take one pass), before and after the rebuild, and average correctly."""
    bk = pc.GradientBucketer(
        comm, [((10000,), np.float32)] * 3, bucket_cap_mb=40000 / MB, first_bucket_mb=40000 / MB
    )
    for step in range(2):  # the second step runs on the rebuilt layout
        assert all(pc.runtime.shared.is_shared(b.buffer) for b in bk.buckets), step
        for i in (0, 2, 1):
            bk.grads[i][...] = np.arange(10000) * (comm.rank + 1) + i
            bk.mark_ready(i)
        bk.synchronize()
        mean_factor = (comm.size + 1) / 2
        for i in range(3):
            assert np.allclose(bk.grads[i], np.arange(10000) * mean_factor + i), (step, i)
    assert [b.params for b in bk.buckets] == [[0], [2], [1]]


def checkpoint(comm):
    model = MLP(20, 8, 3, np.random.default_rng(comm.rank))
    dp = pc.DataParallel(comm, model.params)
    saved = [p.copy() for p in model.params]
    path = MPI.COMM_WORLD.bcast(tempfile.mktemp(suffix=".npz") if comm.rank == 0 else None)
    dp.save(path)
    for p in model.params:
        p[...] = comm.rank + 7
    dp.load(path)
    for p, s in zip(model.params, saved):
        assert np.array_equal(p, s)
    MPI.COMM_WORLD.Barrier()
    if comm.rank == 0:
        os.unlink(path)


def main():
    tests = (equivalence, overlap, no_sync, missed_gradient, rebuild, shared_buckets, checkpoint)
    run_each(tests, "ddp_numpy")


if __name__ == "__main__":
    run_main(main)
