"""ZeroDataParallel on several ranks against the same training in one process (numpy)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from checks import run_each, run_main

import pycollectives as pc
from pycollectives.examples import zero as example
from pycollectives.parallel import nn
from pycollectives.parallel.zero import ZeroDataParallel


def args(**kw):
    a = example.parse_args(["--steps", "4", "--batch-size", "16", "--sizes", "6,20,12,5"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def matches_single_process(comm):
    """Every stage, both optimizers, with and without accumulation, ends where one process
    ends; only stage 3 frees the parameters between uses."""
    for stage in (1, 2, 3):
        for opt, acc in (("adam", 1), ("sgd", 2)):
            a = args(stage=stage, optimizer=opt, accumulate=acc, bucket_cap_mb=0.001)
            z = example.train_zero(comm, a, log=lambda *_: None)
            want = example.train_single(a)
            for got, ref in zip(z.full_parameters(), want):
                np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12, err_msg=f"{a}")
            held = [layer.params[0] is None for layer in z.model.layers if layer.params]
            assert all(held) == (stage == 3), (stage, held)
            assert len(z.units) > 1


def sharded_state(comm):
    """Stage 3 holds 1/N of the model state; stage 1 all of the parameters and gradients."""
    for stage, want in ((1, None), (3, 1 / comm.size)):
        z = ZeroDataParallel(comm, nn.mlp([64, 64, 64], np.random.default_rng(0)), "adam",
                             stage=stage)  # fmt: skip
        held = z.state_bytes()
        total = held["total"] / held["unsharded"]
        if want is None:
            assert held["params"] == held["grads"] >= held["unsharded"] / 4
            assert held["optimizer"] * comm.size >= held["unsharded"] / 2
        else:
            assert abs(total - want) < 0.01, held


def prefetch(comm):
    """Stage 3 starts gathering the next layer before the current one computes."""
    events = []

    class Recording:
        def __getattr__(self, name):
            attr = getattr(comm, name)
            if name != "all_gather":
                return attr

            def gather(*a, **k):
                events.append("gather")
                return attr(*a, **k)

            return gather

    model = nn.mlp([4, 8, 8, 8, 3], np.random.default_rng(0))
    for layer in model.layers:
        if layer.params:
            fwd = layer.forward
            layer.forward = lambda x, fwd=fwd: events.append("compute") or fwd(x)
    z = ZeroDataParallel(Recording(), model, "sgd", 0.1, stage=3)
    events.clear()
    z.forward(np.ones((2, 4)))
    # gather 0, gather 1 (prefetched), compute 0, gather 2, compute 1, ...
    assert events[:3] == ["gather", "gather", "compute"], events
    assert events.count("gather") == 4 and events[3] == "gather", events


def checkpoints(comm):
    """save gathers the whole state on rank 0; load scatters it back, into any stage; the run
    that resumes ends bit-identical with the run that did not stop."""
    path = os.path.join(tempfile.gettempdir(), f"zero-ckpt-{os.getpid() if comm.rank == 0 else 0}")
    path = comm.broadcast_object(path + ".npz", root=0)
    a = args(stage=3, steps=2)
    z = example.train_zero(comm, a, log=lambda *_: None)
    z.save(path, meta={"step": 2})
    x, y = example.classification_data(16, 6, 5, seed=9)
    mine = slice(comm.rank * 16 // comm.size, (comm.rank + 1) * 16 // comm.size)

    def more(t):
        for _ in range(3):
            out, c = t.forward(x[mine])
            t.backward(nn.softmax_cross_entropy(out, y[mine], denom=16 // comm.size)[1], c)
            t.step()
        return t.full_parameters()

    straight = more(z)
    for stage in (1, 3):
        fresh = ZeroDataParallel(comm, nn.mlp([6, 20, 12, 5], np.random.default_rng(5)), "adam",
                                 1e-3, stage=stage)  # fmt: skip
        assert fresh.load(path) == {"step": 2}
        for p, q in zip(more(fresh), straight):
            assert np.array_equal(p, q), stage
    # DataParallel reads the same parameters from it
    model = nn.mlp([6, 20, 12, 5], np.random.default_rng(7))
    dp = pc.DataParallel(comm, model.params)
    dp.load(path)
    comm.barrier()
    if comm.rank == 0:
        os.unlink(path)
    try:
        fresh.load(path + ".missing")
    except ValueError as e:
        assert "cannot read" in str(e)
    else:
        raise AssertionError("loading a missing checkpoint did not raise")


def bad_input(comm):
    model = nn.mlp([3, 4], np.random.default_rng(0))
    for kw, err in (({"stage": 4}, ValueError), ({"optimizer": "lamb"}, ValueError)):
        try:
            ZeroDataParallel(comm, model, **kw)
        except err:
            pass
        else:
            raise AssertionError(f"{kw} accepted")
    z = ZeroDataParallel(comm, model, "sgd", 0.1, stage=2)
    try:
        z.step()
    except RuntimeError as e:
        assert "no reduced gradients" in str(e)
    else:
        raise AssertionError("step without backward accepted")


def main():
    run_each((matches_single_process, sharded_state, prefetch, checkpoints, bad_input), "zero")


if __name__ == "__main__":
    run_main(main)
