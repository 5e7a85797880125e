"""Pipeline parallelism over send/recv: GPipe and 1F1B schedules for numpy or cupy models.

Rank r holds stage r, a ``Sequential`` of consecutive layers of the whole model
(``split_stages``). Stage 0 takes the input batch, the last stage computes the loss. A step
splits the batch into micro-batches; activations go forward and gradients backward with
``comm.batch_p2p``, a step's send and receive paired in one batch (as Megatron's
``send_forward_recv_backward``). Gradients accumulate over the micro-batches into the stage's
``grads``, scaled so they equal the whole batch's mean-loss gradient; the caller then runs
its optimizer on ``stage.params``/``stage.grads``. Schedules:

- ``"gpipe"``: every micro-batch forward, then every one backward (m activations held).
- ``"1f1b"``: PipeDream-flush (Megatron): p-r-1 warmup forwards, then one forward one
  backward, then the remaining backwards (at most p-r micro-batches held on stage r).

Both idle a fraction (p-1)/(m+p-1) of the step in theory (``theoretical_bubble``); 1F1B
needs less memory. Example (every rank builds the same model from one seed)::

    model = nn.mlp([32, 256, 256, 10], np.random.default_rng(0))
    stage = split_stages(model, comm.size)[comm.rank]
    pipe = Pipeline(comm, stage, micro_batches=8, schedule="1f1b")
    opt = optim.make("adam", stage.params, lr=1e-3)
    loss = pipe.train_step(x if comm.rank == 0 else None,
                           labels if comm.rank == comm.size - 1 else None)
    opt.step(stage.grads)            # loss: the batch's mean loss on the last rank, else None
"""

from __future__ import annotations

import functools
import time
from collections import deque

import numpy as np

from pycollectives.backends import P2POp
from pycollectives.parallel.nn import Sequential, array_module, softmax_cross_entropy

SCHEDULES = ("gpipe", "1f1b")
ACT_TAG = 0x5A_0001  # activations, stage r -> r+1
GRAD_TAG = 0x5A_0002  # gradients of activations, stage r+1 -> r


def theoretical_bubble(p: int, m: int) -> float:
    """The idle fraction (p-1)/(m+p-1) of a GPipe or 1F1B step of `m` micro-batches over `p`
    stages, forward and backward taking the same time on every stage.
    ``theoretical_bubble(4, 8) == 3 / 11``."""
    if int(p) < 1 or int(m) < 1:
        raise ValueError(
            f"theoretical_bubble needs p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}"
        )
    return (p - 1) / (m + p - 1)


def split_stages(model: Sequential, nstages: int, by: str = "params") -> list[Sequential]:
    """`model`'s layers in `nstages` consecutive ``Sequential`` stages, balanced by parameter
    count (``by="params"``, the largest stage as small as it can be) or by the number of
    parameter-holding layers (``by="layers"``). A layer without parameters (ReLU) stays with
    the layer before it; the layer objects are the model's own (no copies). Example::

        stages = split_stages(nn.mlp([32, 64, 64, 10]), 3)   # one Linear (and ReLU) each
    """
    if by not in ("params", "layers"):
        raise ValueError(f"split_stages: by must be 'params' or 'layers', got {by!r}")
    if int(nstages) < 1:
        raise ValueError(f"split_stages: nstages must be at least 1, got {nstages}")
    # Blocks: a layer with parameters and the parameter-free layers after it.
    blocks: list[list] = []
    for layer in model.layers:
        if layer.params or not blocks:
            blocks.append([layer])
        else:
            blocks[-1].append(layer)
    if len(blocks) > 1 and not blocks[0][0].params:  # leading parameter-free layers
        lead = blocks.pop(0)
        blocks[0][:0] = lead
    if len(blocks) < nstages:
        raise ValueError(
            f"split_stages: {len(blocks)} layers with parameters cannot fill "
            f"{nstages} stages; use fewer stages or a deeper model"
        )
    w = [sum(int(np.prod(q.shape)) for x in b for q in x.params) for b in blocks]
    w = w if by == "params" else [1] * len(w)
    n, pre = len(w), np.concatenate([[0], np.cumsum(w)]).tolist()

    @functools.cache
    def best(i, k):  # (largest stage, end of the first) of blocks[i:] in k stages
        if k == 1:
            return pre[n] - pre[i], n
        return min((max(pre[c] - pre[i], best(c, k - 1)[0]), c) for c in range(i + 1, n - k + 2))

    bounds = [0]
    for k in range(int(nstages), 0, -1):
        bounds.append(best(bounds[-1], k)[1])
    return [Sequential([x for b in blocks[a:e] for x in b]) for a, e in zip(bounds, bounds[1:])]


def _width(stage, attr: str, first: bool) -> int:
    layers = stage.layers if first else stage.layers[::-1]
    for layer in layers:
        if hasattr(layer, attr):
            return int(getattr(layer, attr))
    raise ValueError(
        f"Pipeline: the stage has no layer with {attr!r} (a Linear) to tell its "
        f"{'input' if first else 'output'} width; give every stage a Linear"
    )


class Pipeline:
    """Trains `stage` (this rank's part of the model) in a pipeline over `comm`'s ranks.

    Args:
        comm: the communicator; rank r holds stage r of ``comm.size`` stages.
        stage: a ``Sequential``; its first layer with ``n_in`` (a Linear) gives the input
            width, its last with ``n_out`` the output width, its parameters the dtype.
        micro_batches: m, how many equal micro-batches a step's batch is cut into.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``.
        loss: ``loss(logits, labels, denom) -> (loss, dlogits)``, on the last stage.

    Construction is collective: the ranks check once that the stages' widths chain, and that
    they agree on dtype, micro-batches and schedule. The batch size is not fixed: every step
    starts with one tiny int64 ``all_reduce`` that tells every rank the batch size (from rank
    0's x and the last rank's labels) and whether some rank's input is bad, so bad input
    raises ``ValueError`` on every rank before any activation moves. ``last_stats`` holds the
    last step's timings. Example: see the module's docstring.
    """

    def __init__(
        self,
        comm,
        stage: Sequential,
        micro_batches: int,
        schedule: str = "1f1b",
        loss=softmax_cross_entropy,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"Pipeline: schedule must be one of {SCHEDULES}, got {schedule!r}")
        if isinstance(micro_batches, bool) or int(micro_batches) != micro_batches:
            raise ValueError(f"Pipeline: micro_batches must be an int, got {micro_batches!r}")
        if micro_batches < 1:
            raise ValueError(f"Pipeline: micro_batches must be at least 1, got {micro_batches}")
        if not stage.params:
            raise ValueError("Pipeline: the stage has no parameters; give every rank layers")
        self.comm, self.stage, self.loss = comm, stage, loss
        self.micro_batches, self.schedule = int(micro_batches), schedule
        self.rank, self.size = comm.rank, comm.size
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        self.n_in, self.n_out = _width(stage, "n_in", True), _width(stage, "n_out", False)
        self.dtype = stage.params[0].dtype
        self.xp = array_module(stage.params[0])
        mine = (self.n_in, self.n_out, str(self.dtype), self.micro_batches, schedule)
        views = comm.all_gather_object(mine)
        for name, at in (("dtype", 2), ("micro_batches", 3), ("schedule", 4)):
            if len({v[at] for v in views}) != 1:
                seen = [v[at] for v in views]
                raise ValueError(f"Pipeline: ranks disagree on {name} ({seen}); pass one value")
        for r in range(self.size - 1):
            if views[r][1] != views[r + 1][0]:
                raise ValueError(
                    f"Pipeline: stage {r} outputs width {views[r][1]} but stage {r + 1} takes "
                    f"{views[r + 1][0]}; split one model with split_stages"
                )
        self.last_stats: dict = {}

    # -- the step ------------------------------------------------------------------------------

    def _agree(self, x, labels) -> int:
        """The batch size, agreed by every rank; ValueError everywhere on bad input."""
        info = np.zeros(2 + self.size, np.int64)  # x rows, labels, one bad-input flag a rank
        error = None
        if self.first:
            if x is None or getattr(x, "ndim", None) != 2 or x.shape[1] != self.n_in:
                error = (
                    f"train_step: rank 0 needs x of shape (batch, {self.n_in}), got "
                    f"{None if x is None else getattr(x, 'shape', type(x).__name__)}"
                )
            else:
                info[0] = x.shape[0]
        if self.last and error is None:
            dt = getattr(labels, "dtype", None)
            if labels is None or getattr(labels, "ndim", None) != 1 or dt.kind not in "iu":
                error = (
                    "train_step: the last rank needs labels, a 1-d integer array, got "
                    f"{labels if labels is None else getattr(labels, 'shape', labels)}"
                    f"{'' if dt is None else ' of ' + str(dt)}"
                )
            else:
                info[1] = labels.shape[0]
        info[2 + self.rank] = error is not None
        self.comm.all_reduce(info)
        if error is not None:
            raise ValueError(error)
        bad = np.flatnonzero(info[2:]).tolist()
        if bad:
            raise ValueError(f"train_step: rank(s) {bad} got bad input (see their error)")
        b, m = int(info[0]), self.micro_batches
        if b != info[1]:
            raise ValueError(
                f"train_step: x has {b} rows (rank 0) but labels has {info[1]} "
                f"(rank {self.size - 1}); give both the same batch"
            )
        if b == 0 or b % m:
            raise ValueError(
                f"train_step: a batch of {b} does not split into {m} equal "
                f"micro-batches; use a batch size that is a multiple of {m}"
            )
        return b

    def train_step(self, x, labels, zero_grad: bool = True):
        """One step: forward and backward of every micro-batch, gradients left (accumulated,
        equal to the whole batch's mean-loss gradient) in ``stage.grads``.

        Args:
            x: the batch, (batch, n_in), on rank 0 (ignored elsewhere; pass None).
            labels: its labels, on the last rank (ignored elsewhere; pass None).
            zero_grad: zero ``stage.grads`` first (False: add to them).

        Returns the loss of the whole batch (a float, the mean over samples) on the last rank,
        None on the others.
        """
        batch = self._agree(x, labels)
        xp, m = self.xp, self.micro_batches
        self._mb = batch // m
        if self.first:
            self._xs = xp.asarray(x).astype(self.dtype, copy=False)
        if self.last:
            self._labels = xp.asarray(labels)
        self._batch, self._next_in, self._next_label = batch, 0, 0
        self._caches, self._dys, self._losses = deque(), deque(), []
        self._compute, self._peak = 0.0, 0
        if zero_grad:
            self.stage.zero_grad()
        t0 = time.perf_counter()
        (self._gpipe if self.schedule == "gpipe" else self._one_f_one_b)()
        wall = time.perf_counter() - t0
        loss = float(sum(self._losses)) if self.last else None
        self._xs = self._labels = None
        mine = 1.0 - self._compute / wall if wall > 0 else 0.0
        avg = np.array([mine], np.float64)
        self.comm.all_reduce(avg)
        self.last_stats = {
            "schedule": self.schedule,
            "stages": self.size,
            "micro_batches": m,
            "micro_batch_size": self._mb,
            "wall_s": wall,
            "compute_s": self._compute,
            "bubble_fraction_rank": mine,
            "bubble_fraction": float(avg[0]) / self.size,
            "theoretical_bubble": theoretical_bubble(self.size, m),
            "peak_in_flight": self._peak,
            "loss": loss,
        }
        return loss

    def _gpipe(self):
        m = self.micro_batches
        x, _ = self._p2p(recv_act=True)
        for i in range(m):
            y = self._forward(x)
            x, _ = self._p2p(send_act=y, recv_act=i + 1 < m)
        _, dy = self._p2p(recv_grad=True)
        for i in range(m):
            dx = self._backward(dy)
            _, dy = self._p2p(send_grad=dx, recv_grad=i + 1 < m)

    def _one_f_one_b(self):
        m = self.micro_batches
        warmup = min(self.size - self.rank - 1, m)
        steady = m - warmup
        for _ in range(warmup):
            x, _ = self._p2p(recv_act=True)
            self._p2p(send_act=self._forward(x))
        if steady:
            x, _ = self._p2p(recv_act=True)
        for i in range(steady):
            _, dy = self._p2p(send_act=self._forward(x), recv_grad=True)
            dx = self._backward(dy)
            x, _ = self._p2p(send_grad=dx, recv_act=i + 1 < steady)
        for _ in range(warmup):
            _, dy = self._p2p(recv_grad=True)
            self._p2p(send_grad=self._backward(dy))

    # -- compute and messages ------------------------------------------------------------------

    def _tick(self, t0):
        """Adds the time since `t0` (once the GPU's work is done, on cupy) to compute."""
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()
        self._compute += time.perf_counter() - t0

    def _forward(self, x):
        """This stage's forward of one micro-batch; the output to send (None on the last,
        which computes the loss and keeps its gradient for the backward)."""
        t = time.perf_counter()
        y, cache = self.stage.forward(x)
        self._caches.append(cache)
        self._peak = max(self._peak, len(self._caches))
        if self.last:
            lo = self._next_label
            self._next_label += self._mb
            loss, dy = self.loss(y, self._labels[lo : self._next_label], self._batch)
            self._losses.append(loss)
            self._dys.append(dy)
            y = None
        else:
            y = self.xp.ascontiguousarray(y)
        self._tick(t)
        return y

    def _backward(self, dy):
        """This stage's backward of the oldest micro-batch in flight; the gradient of its input
        to send (None on the first stage)."""
        t = time.perf_counter()
        dx = self.stage.backward(dy, self._caches.popleft())
        dx = None if self.first else self.xp.ascontiguousarray(dx)
        self._tick(t)
        return dx

    def _p2p(self, send_act=None, send_grad=None, recv_act=False, recv_grad=False):
        """Sends and receives of one step in one ``batch_p2p``: (activation received,
        gradient received). Stage 0 "receives" its next micro-batch of x, the last stage its
        next loss gradient; sends off the ends of the pipeline are dropped."""
        ops, act, grad = [], None, None
        if send_act is not None and not self.last:
            ops.append(P2POp("send", send_act, self.rank + 1, ACT_TAG))
        if send_grad is not None and not self.first:
            ops.append(P2POp("send", send_grad, self.rank - 1, GRAD_TAG))
        if recv_act:
            if self.first:
                lo = self._next_in
                self._next_in += self._mb
                act = self._xs[lo : self._next_in]
            else:
                act = self.xp.empty((self._mb, self.n_in), self.dtype)
                ops.append(P2POp("recv", act, self.rank - 1, ACT_TAG))
        if recv_grad:
            if self.last:
                grad = self._dys.popleft()
            else:
                grad = self.xp.empty((self._mb, self.n_out), self.dtype)
                ops.append(P2POp("recv", grad, self.rank + 1, GRAD_TAG))
        if ops:
            self.comm.batch_p2p(ops)
        return act, grad


__all__ = ["SCHEDULES", "Pipeline", "split_stages", "theoretical_bubble"]
