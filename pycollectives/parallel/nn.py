"""Layers for models held as numpy or cupy arrays: forward returns a cache, backward takes it.

Each layer has ``params`` and ``grads`` (lists of arrays of the same shapes; the trainers may
point them at views of their own flat buffers), ``forward(x) -> (y, cache)`` and
``backward(dy, cache) -> dx``, which adds the parameters' gradients to ``grads`` (accumulating,
as torch does, until ``zero_grad``). The cache keeps what backward needs, so several
micro-batches may be in flight at once (pipeline schedules). Array module: numpy or cupy,
whichever the parameters are.

Example::

    rng = np.random.default_rng(0)
    model = Sequential([Linear(64, 128, rng), ReLU(), Linear(128, 10, rng)])
    logits, cache = model.forward(x)
    loss, dlogits = softmax_cross_entropy(logits, y)
    model.zero_grad()
    model.backward(dlogits, cache)
"""

from __future__ import annotations

import sys

import numpy as np


def array_module(a):
    """numpy, or cupy for a cupy array."""
    mod = type(a).__module__.split(".")[0]
    return sys.modules["cupy"] if mod == "cupy" else np


def draw_weight(n_in: int, n_out: int, rng=None, dtype=np.float64) -> np.ndarray:
    """A (n_in, n_out) weight from N(0, 2/n_in), drawn by `rng` (default: seed 0). Every layer
    that splits a weight across ranks draws the whole one this way and keeps its block."""
    rng = np.random.default_rng(0) if rng is None else rng
    return rng.normal(0.0, np.sqrt(2.0 / n_in), (n_in, n_out)).astype(dtype)


def flat_views(flat, shapes) -> list:
    """Views of consecutive blocks of the 1-d `flat`, shaped as `shapes`."""
    out, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(flat[at : at + n].reshape(shape))
        at += n
    return out


def hand_out(layers, params, grads):
    """Gives each of `layers`, in order, as many of `params` and `grads` as it holds (views of
    a trainer's flat buffers, or None while a trainer has freed them)."""
    at = 0
    for layer in layers:
        n = len(layer.params)
        layer.params, layer.grads = list(params[at : at + n]), list(grads[at : at + n])
        at += n


class Layer:
    params: list = []
    grads: list = []

    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy, cache):
        raise NotImplementedError

    def zero_grad(self):
        for g in self.grads:
            if g is not None:
                g[...] = 0


class Linear(Layer):
    """``y = x @ w + b``: `w` of shape (n_in, n_out), drawn from N(0, 2/n_in) by `rng`."""

    def __init__(self, n_in: int, n_out: int, rng=None, dtype=np.float64, xp=np, bias=True):
        w = draw_weight(n_in, n_out, rng, dtype)
        self.params = [xp.asarray(w)] + ([xp.zeros(n_out, dtype)] if bias else [])
        self.grads = [xp.zeros_like(p) for p in self.params]
        self.n_in, self.n_out = n_in, n_out

    def forward(self, x):
        y = x @ self.params[0]
        if len(self.params) > 1:
            y += self.params[1]
        return y, x

    def backward(self, dy, x):
        self.grads[0] += x.T @ dy
        if len(self.params) > 1:
            self.grads[1] += dy.sum(axis=0)
        return dy @ self.params[0].T


class ReLU(Layer):
    def __init__(self):
        self.params, self.grads = [], []

    def forward(self, x):
        mask = x > 0
        return x * mask, mask

    def backward(self, dy, mask):
        return dy * mask


class Sequential(Layer):
    """Layers applied in order; ``params``/``grads`` are theirs, concatenated. ``backward``
    calls ``ready(i)`` for each parameter index i once its gradient is final, last layer
    first (so a bucket of gradients can start its reduction while backward goes on)."""

    def __init__(self, layers):
        self.layers = list(layers)

    @property
    def params(self):
        return [p for layer in self.layers for p in layer.params]

    @property
    def grads(self):
        return [g for layer in self.layers for g in layer.grads]

    def param_slices(self):
        """(first, end) parameter index of each layer."""
        out, at = [], 0
        for layer in self.layers:
            out.append((at, at + len(layer.params)))
            at += len(layer.params)
        return out

    def forward(self, x):
        caches = []
        for layer in self.layers:
            x, c = layer.forward(x)
            caches.append(c)
        return x, caches

    def backward(self, dy, caches, ready=None):
        slices = self.param_slices()
        for layer, c, (lo, hi) in reversed(list(zip(self.layers, caches, slices))):
            dy = layer.backward(dy, c)
            if ready is not None:
                for i in reversed(range(lo, hi)):
                    ready(i)
        return dy

    def zero_grad(self):
        for layer in self.layers:
            layer.zero_grad()


def mlp(sizes, rng=None, dtype=np.float64, xp=np) -> Sequential:
    """Linear layers of ``sizes[i] -> sizes[i+1]`` with ReLU between them."""
    rng = np.random.default_rng(0) if rng is None else rng
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(ReLU())
        layers.append(Linear(a, b, rng, dtype, xp))
    return Sequential(layers)


def softmax_cross_entropy(logits, labels, denom=None):
    """(summed cross-entropy / `denom`, its gradient w.r.t. `logits`). `denom` defaults to the
    batch size (the mean); a shard of a larger batch passes the whole batch's size, so that the
    shards' gradients sum to the whole batch's."""
    xp = array_module(logits)
    denom = len(labels) if denom is None else denom
    z = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    rows = xp.arange(len(labels))
    loss = -xp.log(p[rows, labels] + 1e-30).sum() / denom
    p[rows, labels] -= 1
    p /= denom
    return loss, p


def mse(pred, target, denom=None):
    """(sum of squared errors / (2 `denom`), its gradient); `denom` as in softmax_cross_entropy."""
    denom = len(target) if denom is None else denom
    d = pred - target
    return (d * d).sum() / (2 * denom), d / denom
