"""Tensor-parallel layers on several ranks (numpy, float64) against one process's nn layers."""

from __future__ import annotations

import numpy as np
from checks import run_each, run_main

from pycollectives.parallel import nn, optim
from pycollectives.parallel.tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    full_gradients,
    full_parameters,
)

TOL = dict(rtol=1e-12, atol=1e-12)


class CountingComm:
    """The communicator, counting the collectives called through it."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.calls = {"all_reduce": 0, "all_gather": 0}

    def all_reduce(self, *a, **k):
        self.calls["all_reduce"] += 1
        return self.comm.all_reduce(*a, **k)

    def all_gather(self, *a, **k):
        self.calls["all_gather"] += 1
        return self.comm.all_gather(*a, **k)

    def take(self) -> dict:
        out, self.calls = self.calls, {"all_reduce": 0, "all_gather": 0}
        return out


def data(batch, n_in, n_out, seed=1):
    """(x, dy), the same on every rank."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, n_in)), rng.normal(size=(batch, n_out))


def close(got, want, what):
    np.testing.assert_allclose(got, want, err_msg=what, **TOL)


def reference(layer, x, dy):
    y, cache = layer.forward(x)
    return y, layer.backward(dy, cache), layer.grads


def sharded(comm, cls, n_in, n_out, seed, what, block_shape, **kw):
    """A `cls` layer over a CountingComm (its count zeroed), built from the same draws as
    nn.Linear(n_in, n_out) with `seed`: its block has `block_shape` and its full parameters
    are the whole layer's."""
    cc = CountingComm(comm)
    layer = cls(cc, n_in, n_out, np.random.default_rng(seed), **kw)
    assert layer.params[0].shape == block_shape
    for got, want in zip(
        full_parameters(layer), nn.Linear(n_in, n_out, np.random.default_rng(seed)).params
    ):
        assert np.array_equal(got, want), f"{what}: full_parameters"
    cc.take()
    return cc, layer


def step(cc, layer, x, dy, want, calls, g_ref, what, case):
    """One forward and backward of `layer` on (x, dy): y and dx against `want` (y, dx), the
    full gradients against `g_ref`, and the collectives each pass called against `calls`
    (forward's, backward's)."""
    y, cache = layer.forward(x)
    assert cc.take() == calls[0]
    close(y, want[0], f"{what} forward {case}")
    dx = layer.backward(dy, cache)
    assert cc.take() == calls[1]
    close(dx, want[1], f"{what} dx {case}")
    for got, want_g in zip(full_gradients(layer), g_ref):
        close(got, want_g, f"{what} grads {case}")


def column(comm):
    n_in, n_out = 10, 4 * comm.size
    x, dy = data(6, n_in, n_out)
    y_ref, dx_ref, g_ref = reference(nn.Linear(n_in, n_out, np.random.default_rng(3)), x, dy)
    for gather in (False, True):
        block = (n_in, n_out // comm.size)
        cc, col = sharded(
            comm, ColumnParallelLinear, n_in, n_out, 3, "column", block, gather_output=gather
        )
        lo, hi = col.lo, col.hi
        dy_in, y_want = (dy, y_ref) if gather else (dy[:, lo:hi], y_ref[:, lo:hi])
        calls = ({"all_reduce": 0, "all_gather": int(gather)}, {"all_reduce": 1, "all_gather": 0})
        step(cc, col, x, dy_in, (y_want, dx_ref), calls, g_ref, "column", f"gather={gather}")


def row(comm):
    n_in, n_out = 4 * comm.size, 7
    x, dy = data(6, n_in, n_out)
    y_ref, dx_ref, g_ref = reference(nn.Linear(n_in, n_out, np.random.default_rng(4)), x, dy)
    for parallel in (True, False):
        block = (n_in // comm.size, n_out)
        cc, r = sharded(
            comm, RowParallelLinear, n_in, n_out, 4, "row", block, input_is_parallel=parallel
        )
        lo, hi = r.lo, r.hi
        x_in, dx_want = (x[:, lo:hi], dx_ref[:, lo:hi]) if parallel else (x, dx_ref)
        calls = (
            {"all_reduce": 1, "all_gather": 0},
            {"all_reduce": 0, "all_gather": int(not parallel)},
        )
        step(cc, r, x_in, dy, (y_ref, dx_want), calls, g_ref, "row", f"parallel={parallel}")
    try:
        RowParallelLinear(comm, n_in, n_out).forward(x)  # the full input where a block belongs
    except ValueError as e:
        assert "input_is_parallel=False" in str(e), e
    else:
        raise AssertionError("row: a full input to input_is_parallel=True was accepted")


def mlp(comm):
    sizes = (10, 6 * comm.size, 5)
    x, dy = data(8, sizes[0], sizes[-1])
    y_ref, dx_ref, g_ref = reference(nn.mlp(sizes, np.random.default_rng(5)), x, dy)
    cc = CountingComm(comm)
    m = ParallelMLP(cc, *sizes, np.random.default_rng(5))
    for _ in range(2):  # gradients accumulate, as nn's do
        y, cache = m.forward(x)
        assert cc.take() == {"all_reduce": 1, "all_gather": 0}, "one all-reduce per forward"
        close(y, y_ref, "mlp forward")
        dx = m.backward(dy, cache)
        assert cc.take() == {"all_reduce": 1, "all_gather": 0}, "one all-reduce per backward"
        close(dx, dx_ref, "mlp dx")
    assert m.collectives == {"forward": 2, "backward": 2}, m.collectives
    for got, want in zip(full_gradients(m), g_ref):
        close(got, 2 * want, "mlp grads")


def training(comm, steps=5):
    """Replicated Linear, ReLU, two ParallelMLPs, replicated Linear: trains as one process."""
    h, f, n_in, classes = 8, 4 * comm.size, 6, 3
    x, labels = data(16, n_in, 1)[0], np.arange(16) % classes
    for name, lr in (("sgd", 0.1), ("adam", 0.01)):
        rng = np.random.default_rng(6)
        model = nn.Sequential([nn.Linear(n_in, h, rng), nn.ReLU(), ParallelMLP(comm, h, f, h, rng),
                               nn.ReLU(), ParallelMLP(comm, h, f, h, rng), nn.ReLU(),
                               nn.Linear(h, classes, rng)])  # fmt: skip
        ref = nn.mlp((n_in, h, f, h, f, h, classes), np.random.default_rng(6))
        for net in (model, ref):
            opt = optim.make(name, net.params, lr)
            for _ in range(steps):
                logits, cache = net.forward(x)
                _, dlogits = nn.softmax_cross_entropy(logits, labels)
                net.zero_grad()
                net.backward(dlogits, cache)
                opt.step(net.grads)
        got = full_parameters(model)
        assert len(got) == len(ref.params)
        for a, b in zip(got, ref.params):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=f"training {name}")
        # The replicated layers stay bit-identical across the ranks.
        first = np.concatenate([p.ravel() for p in model.layers[0].params])
        everyone = np.empty(comm.size * first.size)
        comm.all_gather(first, everyone)
        assert all(np.array_equal(r, first) for r in everyone.reshape(comm.size, -1))


def indivisible(comm):
    bad = comm.size + 1  # not a multiple of 2 or 4
    for make, what in (
        (lambda rng: ColumnParallelLinear(comm, 8, bad, rng), "n_out"),
        (lambda rng: RowParallelLinear(comm, bad, 8, rng), "n_in"),
        (lambda rng: ParallelMLP(comm, 8, bad, 8, rng), "n_hidden"),
    ):
        rng = np.random.default_rng(7)
        try:
            make(rng)
        except ValueError as e:
            msg = str(e)
            assert f"{what}={bad} is not divisible by the {comm.size} ranks" in msg, msg
            assert "multiple of" in msg, msg
        else:
            raise AssertionError(f"{what}={bad} on {comm.size} ranks was accepted")
        # Nothing moved: the generator was not drawn from.
        assert rng.normal() == np.random.default_rng(7).normal(), "rng drawn before the check"


def main():
    run_each((column, row, mlp, training, indivisible), "tensor_parallel")


if __name__ == "__main__":
    run_main(main)
