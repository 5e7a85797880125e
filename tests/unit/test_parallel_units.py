"""The layers and optimizers the parallel trainers build on, against finite differences and
torch's optimizers (no MPI)."""

import numpy as np
import pytest

from pycollectives.parallel import nn, optim


def _numeric_grad(f, a, eps=1e-6):
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        old = a[i]
        a[i] = old + eps
        up = f()
        a[i] = old - eps
        down = f()
        a[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


def test_mlp_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    model = nn.mlp([5, 7, 4], rng)
    x, y = rng.normal(size=(6, 5)), rng.integers(0, 4, 6)

    def loss():
        return float(nn.softmax_cross_entropy(model.forward(x)[0], y)[0])

    logits, caches = model.forward(x)
    _, d = nn.softmax_cross_entropy(logits, y)
    model.zero_grad()
    seen = []
    dx = model.backward(d, caches, ready=seen.append)
    assert seen == [3, 2, 1, 0]  # last layer first
    for p, g in zip(model.params, model.grads):
        np.testing.assert_allclose(g, _numeric_grad(loss, p), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(dx, _numeric_grad(loss, x), rtol=1e-5, atol=1e-8)


def test_gradients_accumulate_until_zeroed():
    rng = np.random.default_rng(2)
    model = nn.mlp([3, 4, 2], rng)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 2))
    model.zero_grad()
    for rows in (slice(0, 4), slice(4, 8)):  # two micro-batches, each scaled by the whole batch
        out, c = model.forward(x[rows])
        model.backward(nn.mse(out, y[rows], denom=8)[1], c)
    acc = [g.copy() for g in model.grads]
    model.zero_grad()
    out, c = model.forward(x)
    model.backward(nn.mse(out, y)[1], c)
    for a, b in zip(acc, model.grads):
        np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("name,kw", [("sgd", {"momentum": 0.9, "weight_decay": 0.01}),
                                     ("sgd", {}), ("adam", {"weight_decay": 0.01})])  # fmt: skip
def test_optimizers_match_torch(name, kw):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    params = [rng.normal(size=(4, 3)), rng.normal(size=5)]
    ours = optim.make(name, [p.copy() for p in params], 0.05, **kw)
    theirs = [torch.tensor(p, requires_grad=True) for p in params]
    topt = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(theirs, lr=0.05, **kw)
    for _ in range(5):
        grads = [rng.normal(size=p.shape) for p in params]
        ours.step(grads)
        for t, g in zip(theirs, grads):
            t.grad = torch.tensor(g)
        topt.step()
    for a, t in zip(ours.params, theirs):
        np.testing.assert_allclose(a, t.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert ours.state_bytes() == sum(a.nbytes for a in ours.state_arrays().values())


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="'sgd' or 'adam'"):
        optim.make("lamb", [], 0.1)
