"""Tensor parallelism (Megatron-LM style): one layer's weight split across the ranks.

Every rank sees the same (replicated) input. ``ColumnParallelLinear`` keeps a block of the
weight's columns, so each rank computes a block of the output; ``RowParallelLinear`` keeps a
block of the rows and takes that block of its input, so each rank computes a partial output
that an all-reduce sums. ``ParallelMLP`` chains them (column, ReLU, row) with one all-reduce
in forward (the row layer's sum) and one in backward (the column layer's input gradient, a
sum of every rank's part). Outputs and input gradients come out identical on every rank, so
the replicated layers around a parallel block stay in step with no more communication.

Layers follow ``pycollectives.parallel.nn`` (``params``, ``grads``, ``forward(x) -> (y,
cache)``, ``backward(dy, cache) -> dx`` accumulating into ``grads``). Each draws the *full*
weight from `rng` exactly as ``nn.Linear(n_in, n_out, rng, dtype)`` does and keeps its block,
so every rank must pass a generator in the same state (same seed), and one process's
``nn.Linear`` built from that seed is the reference. Arrays: numpy, or cupy with ``xp=cupy``.
Example::

    comm = pc.Communicator()
    rng = np.random.default_rng(0)                      # the same seed on every rank
    mlp = ParallelMLP(comm, 64, 256, 64, rng)            # 256/P hidden units on each rank
    y, cache = mlp.forward(x)                            # x, y: (batch, 64), on every rank
    dx = mlp.backward(dy, cache)
    w1, b1, w2, b2 = full_parameters(mlp)                # the unsplit weights, on every rank
"""

from __future__ import annotations

import numpy as np

from pycollectives.parallel.nn import Linear, ReLU, Sequential, draw_weight


def _block(comm, n: int, what: str, layer: str) -> tuple[int, int]:
    """(first, end) of this rank's block of `n`; ValueError unless the ranks split it evenly."""
    if n % comm.size:
        up = -(-n // comm.size) * comm.size
        raise ValueError(
            f"{layer}: {what}={n} is not divisible by the {comm.size} ranks of the communicator; "
            f"choose {what} a multiple of {comm.size} (e.g. {up}) or run on a number of ranks "
            f"that divides {n}"
        )
    k = n // comm.size
    return comm.rank * k, (comm.rank + 1) * k


class _Parallel(Linear):
    """What the parallel linear layers share: the communicator, counts of collectives, and
    ``Linear``'s algebra on this rank's block (``x @ w + b``; gradients of w and b, and
    ``dy @ w.T``)."""

    def _setup(self, comm, w_block, n_bias, bias, dtype, xp):
        self.comm, self.xp = comm, xp
        self.params = [xp.asarray(np.ascontiguousarray(w_block))]
        if bias:
            self.params.append(xp.zeros(n_bias, dtype))
        self.grads = [xp.zeros_like(p) for p in self.params]
        self.collectives = {"forward": 0, "backward": 0}

    def _all_reduce(self, x, phase):
        self.collectives[phase] += 1
        self.comm.all_reduce(x, op="sum")
        return x

    def _all_gather(self, x, phase=None):
        """Every rank's `x`, stacked rank-major: shape (size, *x.shape)."""
        if phase is not None:
            self.collectives[phase] += 1
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty((self.comm.size, *x.shape), x.dtype)
        self.comm.all_gather(x, out)
        return out

    def _full(self, arrays) -> list:
        raise NotImplementedError


class ColumnParallelLinear(_Parallel):
    """``y = x @ w + b`` with this rank holding columns ``[r*n_out/P, (r+1)*n_out/P)`` of `w`
    (and that slice of `b`).

    Forward takes the full input (the same on every rank) and returns this rank's block of the
    output, or with ``gather_output=True`` the full output (an all-gather). Backward takes the
    gradient of what forward returned (the block, or the full output) and returns the full
    input's gradient, summed over the ranks (an all-reduce: Megatron's "f", identity forward).
    Example::

        col = ColumnParallelLinear(comm, 64, 256, np.random.default_rng(0))
        y_block, cache = col.forward(x)               # (batch, 256 // comm.size)
        dx = col.backward(dy_block, cache)            # (batch, 64), the same on every rank
    """

    def __init__(
        self,
        comm,
        n_in: int,
        n_out: int,
        rng=None,
        dtype=np.float64,
        xp=np,
        gather_output: bool = False,
        bias: bool = True,
    ):
        self.lo, self.hi = _block(comm, n_out, "n_out", "ColumnParallelLinear")
        w = draw_weight(n_in, n_out, rng, dtype)
        self._setup(comm, w[:, self.lo : self.hi], self.hi - self.lo, bias, dtype, xp)
        self.n_in, self.n_out, self.gather_output = n_in, n_out, gather_output

    def forward(self, x):
        y, x = super().forward(x)
        if self.gather_output:  # (P, batch, n_out/P) -> (batch, P, n_out/P) -> (batch, n_out)
            y = self._all_gather(y, "forward").transpose(1, 0, 2).reshape(len(x), self.n_out)
        return y, x

    def backward(self, dy, x):
        if self.gather_output:
            dy = self.xp.ascontiguousarray(dy[:, self.lo : self.hi])
        return self._all_reduce(super().backward(dy, x), "backward")

    def _full(self, arrays):
        w = self._all_gather(arrays[0])  # (P, n_in, n_out/P)
        out = [w.transpose(1, 0, 2).reshape(self.n_in, self.n_out)]
        return out + [self._all_gather(b).reshape(self.n_out) for b in arrays[1:]]


class RowParallelLinear(_Parallel):
    """``y = x @ w + b`` with this rank holding rows ``[r*n_in/P, (r+1)*n_in/P)`` of `w`; `b`
    is whole on every rank (added once, after the sum).

    Forward takes this rank's block of the input's columns (``input_is_parallel=True``, what
    a ``ColumnParallelLinear`` without gather returns) or the full input, of which it takes its
    block itself; it all-reduces the partial products and returns the full output, the same on
    every rank. Backward takes the full output's gradient and returns the gradient of what
    forward took: the block with no communication, or the full input's (an all-gather).
    Example::

        row = RowParallelLinear(comm, 256, 64, np.random.default_rng(0))
        y, cache = row.forward(h_block)               # h_block: (batch, 256 // comm.size)
        dh_block = row.backward(dy, cache)
    """

    def __init__(
        self,
        comm,
        n_in: int,
        n_out: int,
        rng=None,
        dtype=np.float64,
        xp=np,
        input_is_parallel: bool = True,
        bias: bool = True,
    ):
        self.lo, self.hi = _block(comm, n_in, "n_in", "RowParallelLinear")
        w = draw_weight(n_in, n_out, rng, dtype)
        self._setup(comm, w[self.lo : self.hi], n_out, bias, dtype, xp)
        self.n_in, self.n_out, self.input_is_parallel = n_in, n_out, input_is_parallel

    def forward(self, x):
        if not self.input_is_parallel:
            x = x[:, self.lo : self.hi]
        elif x.shape[-1] != self.hi - self.lo:
            raise ValueError(
                f"RowParallelLinear: input has {x.shape[-1]} columns, this rank's block of "
                f"n_in={self.n_in} is {self.hi - self.lo}; pass the block (what "
                f"ColumnParallelLinear returns) or build it with input_is_parallel=False"
            )
        y = self._all_reduce(x @ self.params[0], "forward")
        if len(self.params) > 1:
            y += self.params[1]
        return y, x

    def backward(self, dy, x):
        dx = super().backward(dy, x)
        if self.input_is_parallel:
            return dx
        return self._all_gather(dx, "backward").transpose(1, 0, 2).reshape(len(dy), self.n_in)

    def _full(self, arrays):
        w = self._all_gather(arrays[0]).reshape(self.n_in, self.n_out)
        return [w] + [self.xp.array(b, copy=True) for b in arrays[1:]]


class ParallelMLP(Sequential):
    """``Linear(n_in, n_hidden)``, ReLU, ``Linear(n_hidden, n_out)`` with the hidden units
    split across the ranks: a ``ColumnParallelLinear`` (no gather), ReLU, and a
    ``RowParallelLinear``. One all-reduce per forward and one per backward; ``collectives``
    counts them. Draws from `rng` as ``nn.mlp([n_in, n_hidden, n_out], rng)`` does. Example::

        mlp = ParallelMLP(comm, 64, 256, 64, np.random.default_rng(0))
        y, cache = mlp.forward(x)
        mlp.collectives                               # {"forward": 1, "backward": 0}
    """

    def __init__(
        self,
        comm,
        n_in: int,
        n_hidden: int,
        n_out: int,
        rng=None,
        dtype=np.float64,
        xp=np,
        bias: bool = True,
    ):
        _block(comm, n_hidden, "n_hidden", "ParallelMLP")  # before either layer draws
        rng = np.random.default_rng(0) if rng is None else rng
        self.column = ColumnParallelLinear(comm, n_in, n_hidden, rng, dtype, xp, bias=bias)
        self.row = RowParallelLinear(comm, n_hidden, n_out, rng, dtype, xp, bias=bias)
        super().__init__([self.column, ReLU(), self.row])

    @property
    def collectives(self) -> dict:
        """Collective calls made so far by forward and by backward (all all-reduces)."""
        a, b = self.column.collectives, self.row.collectives
        return {k: a[k] + b[k] for k in a}


def _full(layer, arrays) -> list:
    if isinstance(layer, _Parallel):
        return layer._full(arrays)
    if isinstance(layer, Sequential):
        out = []
        for sub, (lo, hi) in zip(layer.layers, layer.param_slices()):
            out += _full(sub, arrays[lo:hi])
        return out
    return [a.copy() for a in arrays]  # replicated: already whole


def full_parameters(layer) -> list:
    """The unsplit parameters of `layer` on every rank (collective: every rank must call it):
    for a parallel layer its whole weight (n_in, n_out) and bias, for a ``Sequential`` those of
    each layer in turn, for any other layer copies of its own (replicated) ones. The list lines
    up with the ``params`` of the same model built from ``nn.Linear``. Example::

        w, b = full_parameters(ColumnParallelLinear(comm, 8, 16, np.random.default_rng(0)))
        # w == nn.Linear(8, 16, np.random.default_rng(0)).params[0]
    """
    return _full(layer, list(layer.params))


def full_gradients(layer) -> list:
    """The unsplit gradients of `layer`, as ``full_parameters`` gathers the parameters."""
    return _full(layer, list(layer.grads))


__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "RowParallelLinear",
    "full_gradients",
    "full_parameters",
]
