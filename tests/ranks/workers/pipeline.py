"""Pipeline (GPipe and 1F1B) on several ranks against the same model in one process."""

from __future__ import annotations

import numpy as np
from checks import run_each, run_main

from pycollectives.parallel import nn, optim
from pycollectives.parallel.pipeline import SCHEDULES, Pipeline, split_stages, theoretical_bubble

SIZES = [12, 16, 16, 16, 16, 5]  # five Linear layers: enough for 4 stages
BATCH = 24


def data(n, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, SIZES[0])).astype(dtype), rng.integers(0, SIZES[-1], n)


def model(dtype=np.float64):
    return nn.mlp(SIZES, np.random.default_rng(0), dtype)


def inputs(comm, x, y):
    return (x if comm.rank == 0 else None), (y if comm.rank == comm.size - 1 else None)


def reference_step(ref, x, y):
    """Whole-batch mean loss and gradients, in one process."""
    logits, caches = ref.forward(x)
    loss, d = nn.softmax_cross_entropy(logits, y)
    ref.zero_grad()
    ref.backward(d, caches)
    return float(loss)


def gradients(comm):
    """One step of either schedule leaves the whole batch's gradients on the stages' layers."""
    p, r = comm.size, comm.rank
    x, y = data(BATCH)
    ref = model()
    ref_loss = reference_step(ref, x, y)
    ref_stage = split_stages(ref, p)[r]
    for schedule in SCHEDULES:
        for m in (1, 3, 4, 8):
            full = model()
            stages = split_stages(full, p)
            assert [a for s in stages for a in s.layers] == full.layers
            assert all(a is b for a, b in zip((a for s in stages for a in s.layers), full.layers))
            stage = stages[r]
            pipe = Pipeline(comm, stage, m, schedule)
            loss = pipe.train_step(*inputs(comm, x, y))
            what = f"{schedule}, m={m}, rank {r}"
            for g, want in zip(stage.grads, ref_stage.grads):
                np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-13, err_msg=what)
            if r == p - 1:
                assert abs(loss - ref_loss) < 1e-12, (what, loss, ref_loss)
            else:
                assert loss is None, what
            st = pipe.last_stats
            assert st["theoretical_bubble"] == (p - 1) / (m + p - 1), st
            assert st["micro_batch_size"] == BATCH // m and st["stages"] == p, st
            assert 0 <= st["compute_s"] <= st["wall_s"], st
            assert -1e-9 <= st["bubble_fraction"] <= 1, st
            # GPipe holds every micro-batch's activations; 1F1B at most p - r of them.
            held = m if schedule == "gpipe" else min(p - r, m)
            assert st["peak_in_flight"] == held, (what, st["peak_in_flight"], held)
            # zero_grad=False accumulates a second step's gradients onto the first's.
            if m == 4:
                pipe.train_step(*inputs(comm, x, y), zero_grad=False)
                for g, want in zip(stage.grads, ref_stage.grads):
                    np.testing.assert_allclose(g, 2 * want, rtol=1e-10, atol=1e-13)
    # float32: the stage's dtype goes through the pipe (x given as float64 is cast).
    stage = split_stages(model(np.float32), p)[r]
    Pipeline(comm, stage, 4, "1f1b").train_step(*inputs(comm, x, y))
    for g, want in zip(stage.grads, ref_stage.grads):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-5)


def training(comm, steps=5):
    """Several steps with an optimizer end where one process's training does."""
    p, r = comm.size, comm.rank
    x, y = data(steps * BATCH, seed=2)
    for schedule, name, kw in (("gpipe", "sgd", {"momentum": 0.9}), ("1f1b", "adam", {})):
        lr = 0.05 if name == "sgd" else 1e-2
        ref = model()
        ref_opt = optim.make(name, ref.params, lr, **kw)
        stage = split_stages(model(), p)[r]
        opt = optim.make(name, stage.params, lr, **kw)
        pipe = Pipeline(comm, stage, 4, schedule)
        for k in range(steps):
            xb, yb = x[k * BATCH : (k + 1) * BATCH], y[k * BATCH : (k + 1) * BATCH]
            ref_loss = reference_step(ref, xb, yb)
            ref_opt.step(ref.grads)
            loss = pipe.train_step(*inputs(comm, xb, yb))
            opt.step(stage.grads)
            if r == p - 1:
                assert abs(loss - ref_loss) < 1e-10, (schedule, k, loss, ref_loss)
        for q, want in zip(stage.params, split_stages(ref, p)[r].params):
            np.testing.assert_allclose(q, want, rtol=1e-10, atol=1e-12, err_msg=schedule)


def raises(fn, *words):
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), (str(e), words)
        return str(e)
    raise AssertionError(f"no ValueError (expected one saying {words})")


def bad_input(comm):
    """Bad arguments raise ValueError on every rank before anything moves; the pipe still
    works afterwards."""
    p, r = comm.size, comm.rank
    x, y = data(BATCH)
    stage = split_stages(model(), p)[r]
    raises(lambda: Pipeline(comm, stage, 4, "interleaved"), "schedule", "interleaved")
    raises(lambda: Pipeline(comm, stage, 0), "micro_batches")
    # Stages that do not chain: every rank learns it at construction.
    odd = nn.Sequential([nn.Linear(8, 8), nn.ReLU()]) if r < p - 1 else nn.mlp([9, 5])
    raises(lambda: Pipeline(comm, odd, 2), "outputs width 8", "takes 9")
    pipe = Pipeline(comm, stage, 4, "1f1b")
    pipe.train_step(*inputs(comm, x, y))
    before = [g.copy() for g in stage.grads]
    first, last = r == 0, r == p - 1

    def step(xb, yb):
        return lambda: pipe.train_step(xb if first else None, yb if last else None)

    raises(step(x[:10], y[:10]), "batch of 10", "4 equal micro-batches")
    raises(step(x[:0], y[:0]), "batch of 0")
    raises(step(x, y[:-4]), "x has 24 rows", "labels has 20")
    msg = raises(step(x[:, :5], y), "rank")
    assert ("(batch, 12)" in msg) if first else ("rank(s) [0]" in msg), msg
    msg = raises(step(x, y.astype(np.float64)), "rank")
    assert ("integer" in msg) if last else (f"rank(s) [{p - 1}]" in msg), msg
    msg = raises(step(None, y), "rank")
    assert ("rank 0 needs x" in msg) if first else ("rank(s) [0]" in msg), msg
    for g, b in zip(stage.grads, before):  # untouched: nothing ran
        assert np.array_equal(g, b)
    ref = model()
    reference_step(ref, x, y)
    pipe.train_step(*inputs(comm, x, y))
    for g, want in zip(stage.grads, split_stages(ref, p)[r].grads):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-13)
    assert theoretical_bubble(p, 4) == (p - 1) / (p + 3)


def main():
    run_each((gradients, training, bad_input), "pipeline {size}")


if __name__ == "__main__":
    run_main(main)
