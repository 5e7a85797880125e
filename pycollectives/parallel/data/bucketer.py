"""Gradient bucketing: gradients live in flat buckets, each all-reduced as soon as it is full.

Example (every rank)::

    bucketer = pc.GradientBucketer(comm, [(w.shape, w.dtype) for w in params])
    grads = bucketer.grads              # views into the buckets: write gradients here
    for i in reversed(range(len(params))):   # backward, last layer first
        grads[i][...] = compute_grad(i)
        bucketer.mark_ready(i)          # a full bucket starts its all-reduce at once
    bucketer.synchronize()              # all buckets averaged; grads[i] is the mean
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from pycollectives.ops import AVG

MB = 1 << 20


@dataclass
class Bucket:
    """A flat buffer holding the gradients of `params` (indices) at `offsets`."""

    index: int
    dtype: np.dtype
    params: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    size: int = 0  # elements
    buffer: np.ndarray | None = None


def assign_buckets(shapes_dtypes, order, first_bytes, cap_bytes):
    """Buckets for the gradients, filled in `order` (parameter indices): the first bucket holds
    up to `first_bytes`, the others `cap_bytes`; a gradient is never split (one larger than
    the cap gets a bucket of its own) and a bucket holds one dtype."""
    buckets: list[Bucket] = []
    for i in order:
        shape, dtype = shapes_dtypes[i]
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        cur = buckets[-1] if buckets else None
        cap = first_bytes if cur is not None and cur.index == 0 else cap_bytes
        if (
            cur is None
            or cur.dtype != dtype
            or (cur.size and (cur.size + n) * dtype.itemsize > cap)
        ):
            cur = Bucket(len(buckets), dtype)
            buckets.append(cur)
        cur.params.append(i)
        cur.offsets.append(cur.size)
        cur.size += n
    return buckets


class GradientBucketer:
    """Averages gradients across ranks, bucket by bucket, overlapping with backward.

    Args:
        comm: a ``pc.Communicator``.
        shapes_dtypes: ``(shape, dtype)`` of every parameter, in registration order.
        bucket_cap_mb: capacity of every bucket but the first (MiB, default 25).
        first_bucket_mb: capacity of the first bucket (MiB, default 1), so that the first
            all-reduce starts early in backward.
        names: parameter names for error messages.
        rebuild: after the first step, lay the buckets out again in the order gradients
            actually arrived (rank 0's order, so every rank agrees), as torch DDP does. The
            gradient views change once then; read ``grads`` again after ``synchronize``.
        array_module: numpy (default): the buckets come from ``comm.zeros`` (memory the
            ranks of a machine can map, so a bucket's all-reduce reads and writes each byte
            once; ``pycollectives.runtime.shared``) where `comm` has it, else ``numpy.zeros``;
            or cupy for gradients on the GPU: the buckets then come from ``comm.zeros`` on the
            current GPU (registered buffers, whose all-reduces read every rank's bucket
            directly: the two-shot), and their all-reduces run on the GPU, queued on cupy's
            current stream; ``synchronize`` orders that stream after them.

    Buckets are filled in reverse registration order (backward produces the last layer's
    gradients first) and their all-reduces always start in bucket order, on every rank.
    """

    def __init__(
        self,
        comm,
        shapes_dtypes,
        bucket_cap_mb=25.0,
        first_bucket_mb=1.0,
        names=None,
        rebuild=True,
        op=AVG,
        algorithm=None,
        array_module=None,
    ):
        self.comm = comm
        self._xp = np if array_module is None else array_module
        self._shapes = [(tuple(s), np.dtype(d)) for s, d in shapes_dtypes]
        self._names = (
            list(names) if names is not None else [f"param{i}" for i in range(len(self._shapes))]
        )
        if len(self._names) != len(self._shapes):
            raise ValueError("names must have one entry per parameter")
        self._first = int(first_bucket_mb * MB)
        self._cap = int(bucket_cap_mb * MB)
        if self._first <= 0 or self._cap <= 0:
            raise ValueError("bucket sizes must be positive")
        self._op, self._algorithm = op, algorithm
        self._rebuild_pending = rebuild
        # Every rank lays the buckets out alike, so the collective allocation agrees: host
        # buckets from comm.zeros (shared memory), GPU ones from comm.zeros on the current GPU
        # (registered buffers: a bucket's all-reduce reads its peers' buckets directly).
        self._zeros = self._xp.zeros
        if callable(getattr(comm, "zeros", None)):
            if self._xp is np:
                self._zeros = comm.zeros
            elif getattr(self._xp, "__name__", "") == "cupy":
                self._zeros = self._gpu_zeros
        self._no_sync = False
        # reduce(bucket) -> an object with wait(): replaces the all-reduce (a comm hook).
        self.reduce = None
        self.launch_times: list[float] = []  # perf_counter() when each bucket's all-reduce began
        self._layout(list(reversed(range(len(self._shapes)))))

    def _gpu_zeros(self, size, dtype):
        return self.comm.zeros(size, dtype, device=self._xp.cuda.Device().id)

    # -- layout -------------------------------------------------------------------------------

    def _layout(self, order, keep=None):
        self.buckets = assign_buckets(self._shapes, order, self._first, self._cap)
        self._where = [None] * len(self._shapes)
        self._views = [None] * len(self._shapes)
        for b in self.buckets:
            b.buffer = self._zeros(b.size, b.dtype)
            for i, off in zip(b.params, b.offsets):
                n = int(np.prod(self._shapes[i][0], dtype=np.int64))
                self._where[i] = b.index
                self._views[i] = b.buffer[off : off + n].reshape(self._shapes[i][0])
                if keep is not None:
                    self._views[i][...] = keep[i]
        self._reset_step()

    def _reset_step(self):
        self._ready = [False] * len(self._shapes)
        self._pending = [len(b.params) for b in self.buckets]
        self._next = 0  # next bucket to launch
        self._works = []
        self._arrival: list[int] = []

    @property
    def grads(self) -> list:
        """The gradient of every parameter: views into the bucket buffers."""
        return list(self._views)

    def bucket_of(self, i: int) -> int:
        return self._where[i]

    # -- a step -------------------------------------------------------------------------------

    def mark_ready(self, i: int):
        """Gradient `i` is final for this step; a bucket whose gradients are all final starts
        its all-reduce (after every lower-numbered bucket)."""
        if self._ready[i]:
            raise RuntimeError(f"gradient {self._names[i]} marked ready twice in one step")
        self._ready[i] = True
        self._arrival.append(i)
        b = self._where[i]
        self._pending[b] -= 1
        if self._no_sync:
            return
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            bucket = self.buckets[self._next]
            self.launch_times.append(time.perf_counter())
            if self.reduce is not None:
                self._works.append(self.reduce(bucket))
            else:
                self._works.append(
                    self.comm.all_reduce(
                        bucket.buffer, op=self._op, algorithm=self._algorithm, async_op=True
                    )
                )
            self._next += 1

    def synchronize(self):
        """Waits for every bucket's all-reduce; afterwards each gradient holds the average.

        Raises RuntimeError naming the gradients never marked ready this step. Inside
        ``no_sync()`` it only resets the step (gradients keep accumulating locally)."""
        missing = [self._names[i] for i, r in enumerate(self._ready) if not r]
        if missing:
            raise RuntimeError(
                "gradients never marked ready in this step: "
                + ", ".join(missing)
                + " (every parameter must get a gradient, or be left out of the bucketer)"
            )
        if self._no_sync:
            self._reset_step()
            return
        for w in self._works:
            w.wait()
        arrival = self._arrival
        self._reset_step()
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._rebuild(arrival)

    def _rebuild(self, arrival):
        order = np.array(arrival, np.int64)
        self.comm.broadcast(order, root=0)  # every rank takes rank 0's order
        keep = [v.copy() for v in self._views]
        self._layout([int(i) for i in order], keep)

    @property
    def syncing(self) -> bool:
        """False inside ``no_sync()``."""
        return not self._no_sync

    @contextlib.contextmanager
    def no_sync(self):
        """Steps inside skip communication: gradients accumulate locally, and the first step
        after the block averages the accumulated sums."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False
