"""Optimizers for lists of numpy or cupy arrays, updated in place with whole-array operations.

An optimizer holds its state (momentum, Adam's moments) per parameter array. The ZeRO trainer
gives it the shard of a flat buffer that one rank owns, so the state is sharded with it. Example::

    opt = Adam(model.params, lr=1e-3)
    ...backward into model.grads...
    opt.step(model.grads)
"""

from __future__ import annotations

from pycollectives.parallel.nn import array_module


class Optimizer:
    state_names: tuple = ()

    def __init__(self, params):
        self.params = list(params)
        self.state = [
            {n: array_module(p).zeros_like(p) for n in self.state_names} for p in self.params
        ]
        self.steps = 0

    def step(self, grads):
        grads = list(grads)
        if len(grads) != len(self.params):
            raise ValueError(f"step: {len(grads)} gradients for {len(self.params)} parameters")
        self.steps += 1
        for p, g, s in zip(self.params, grads, self.state):
            self._update(p, g, s)

    def _update(self, p, g, s):
        raise NotImplementedError

    def state_arrays(self) -> dict:
        """name -> array of the state (``"<buffer>/<parameter index>"``), for checkpoints."""
        return {f"{n}/{i}": a for i, s in enumerate(self.state) for n, a in s.items()}

    def state_bytes(self) -> int:
        return sum(a.nbytes for s in self.state for a in s.values())


class SGD(Optimizer):
    """``v = momentum * v + g + weight_decay * p; p -= lr * v`` (torch's SGD, dampening 0)."""

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        self.state_names = ("momentum",) if momentum else ()
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def _update(self, p, g, s):
        if self.weight_decay:
            g = g + self.weight_decay * p
        if self.momentum:
            v = s["momentum"]
            v *= self.momentum
            v += g
            g = v
        p -= self.lr * g


class Adam(Optimizer):
    """Adam (Kingma & Ba), bias-corrected, as torch's ``Adam`` without amsgrad."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def _update(self, p, g, s):
        b1, b2 = self.betas
        if self.weight_decay:
            g = g + self.weight_decay * p
        m, v = s["exp_avg"], s["exp_avg_sq"]
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        xp = array_module(p)
        c1, c2 = 1 - b1**self.steps, 1 - b2**self.steps
        p -= (self.lr / c1) * m / (xp.sqrt(v / c2) + self.eps)


NAMES = ("sgd", "adam")


def make(name: str, params, lr: float, **kw) -> Optimizer:
    """An optimizer by name ("sgd", "adam")."""
    if name == "sgd":
        return SGD(params, lr, **kw)
    if name == "adam":
        return Adam(params, lr, **kw)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")


__all__ = ["SGD", "Adam", "Optimizer", "make"]
