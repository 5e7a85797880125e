"""Data parallelism for models held as parameter and gradient arrays."""

from __future__ import annotations

import sys

import numpy as np

from pycollectives import checkpoint
from pycollectives.parallel.data.bucketer import GradientBucketer
from pycollectives.runtime import arrays


def _array_module(params):
    """numpy for host parameters, cupy for GPU ones; TypeError for anything else or a mix."""
    kinds = set()
    for i, p in enumerate(params):
        try:
            info = arrays.describe(p)
        except TypeError:
            info = None
        if info is None or info.library not in ("numpy", "cupy"):
            raise TypeError(f"parameter {i} must be a numpy or cupy array, got {type(p).__name__}")
        if not info.contiguous or info.readonly:
            raise TypeError(f"parameter {i} must be a writeable C-contiguous array")
        kinds.add(info.library)
    if len(kinds) > 1:
        raise TypeError("parameters must all be numpy arrays or all cupy arrays, not a mix")
    return sys.modules["cupy"] if kinds == {"cupy"} else np


class DataParallel:
    """Replicates parameters across ranks and averages their gradients in buckets.

    At construction every parameter is broadcast from rank 0 (in place), so replicas start
    identical. Gradients live in ``grads`` (views into the buckets; read the list again after
    the first ``synchronize``, which may lay the buckets out anew). Parameters are numpy
    arrays (collectives over shared memory) or cupy arrays (collectives on the GPU, ordered on
    cupy's current stream).

    Example::

        dp = pc.DataParallel(comm, [w1, b1, w2, b2])
        for x, y in batches:
            g = dp.grads
            ...backward, writing g[3], g[2], g[1], g[0] and calling dp.mark_ready(i) on each...
            dp.synchronize()
            for p, gi in zip(dp.params, dp.grads):
                p -= lr * gi
        dp.save("ckpt.npz", meta={"epoch": e})  # rank 0 writes, atomically; all wait for it
        meta = dp.load("ckpt.npz")        # every rank gets rank 0's copy
    """

    def __init__(
        self,
        comm,
        params,
        bucket_cap_mb=25.0,
        first_bucket_mb=1.0,
        names=None,
        rebuild=True,
        algorithm=None,
    ):
        self.params = list(params)
        self._xp = _array_module(self.params)
        self._buckets = (bucket_cap_mb, first_bucket_mb, names, rebuild, algorithm)
        self.rebind(comm)

    def rebind(self, comm, sync_params: bool = True):
        """Goes on over `comm`: what ``Communicator.shrink`` returned after a death, or
        ``grow`` when ranks joined. New buckets over it; with `sync_params` the parameters
        from its rank 0 (a joining rank receives them: its ``DataParallel(comm, params)``
        makes the same calls). The gradients of an unfinished step are dropped: do the step
        again. Collective over `comm`. Construction is ``rebind`` of the first
        communicator."""
        self.comm = comm
        if sync_params:
            for p in self.params:
                comm.broadcast(p, root=0)
        cap, first, names, rebuild, algorithm = self._buckets
        self.bucketer = GradientBucketer(
            comm,
            [(p.shape, p.dtype) for p in self.params],
            cap,
            first,
            names,
            rebuild,
            algorithm=algorithm,
            array_module=self._xp,
        )

    @property
    def grads(self):
        return self.bucketer.grads

    def mark_ready(self, i: int):
        self.bucketer.mark_ready(i)

    def synchronize(self):
        self.bucketer.synchronize()

    def no_sync(self):
        return self.bucketer.no_sync()

    def save(self, path, state=None, meta=None):
        """Rank 0 writes the parameters to `path` (.npz), with `state` (name -> array, e.g.
        optimizer buffers, identical on every rank) and `meta` (a JSON-able dict: epoch,
        step, ...), atomically (``pycollectives.checkpoint``); returns on every rank once
        written."""
        if self.comm.rank == 0:
            saved = {f"arr_{i}": self._host(p) for i, p in enumerate(self.params)}
            saved.update({f"state/{k}": self._host(v) for k, v in (state or {}).items()})
            checkpoint.save(path, saved, meta)
        self.comm.barrier()

    def load(self, path, state=None) -> dict:
        """Restores the parameters, and the arrays of `state` (as given to ``save``), on
        every rank from rank 0's reading of `path`; returns the saved `meta`."""
        state = state or {}
        expect = {f"arr_{i}": p for i, p in enumerate(self.params)}
        expect.update({f"state/{k}": v for k, v in state.items()})
        meta, error = {}, None
        if self.comm.rank == 0:
            try:
                saved, meta = checkpoint.load(path)
            except (OSError, ValueError) as e:
                saved, error = {}, f"cannot read {path}: {e}"
            for k, a in expect.items():
                got = saved.get(k)
                if error is None and (got is None or got.shape != a.shape or got.dtype != a.dtype):
                    error = f"{path} does not hold this model's {k.replace('arr_', 'parameter ')}"
            if error is None:
                for k, a in expect.items():
                    a[...] = self._xp.asarray(saved[k])
        # every rank learns whether rank 0 could read it, and what it says
        error, meta = self.comm.broadcast_object((error, meta), root=0)
        if error is not None:
            raise ValueError(error)
        for a in expect.values():
            self.comm.broadcast(a, root=0)
        return meta

    def _host(self, p):
        return p if self._xp is np else self._xp.asnumpy(p)
