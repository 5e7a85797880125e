"""Data parallelism for models held as parameter and gradient arrays."""

from __future__ import annotations

import sys

import numpy as np

from pycollectives import arrays
from pycollectives.ddp.bucketer import GradientBucketer


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
        dp.save("ckpt.npz")               # rank 0 writes; every rank returns once it is there
        dp.load("ckpt.npz")               # every rank gets rank 0's copy
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
        self.comm = comm
        self.params = list(params)
        self._xp = _array_module(self.params)
        for p in self.params:
            comm.broadcast(p, root=0)
        self.bucketer = GradientBucketer(
            comm,
            [(p.shape, p.dtype) for p in self.params],
            bucket_cap_mb,
            first_bucket_mb,
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

    def save(self, path):
        """Rank 0 writes the parameters to `path` (.npz); returns on every rank once written."""
        if self.comm.rank == 0:
            np.savez(path, *[self._host(p) for p in self.params])
        self.comm.barrier()

    def load(self, path):
        """Restores the parameters on every rank from rank 0's reading of `path`."""
        ok = np.zeros(1, np.int32)
        if self.comm.rank == 0:
            with np.load(path) as f:
                saved = [f[f"arr_{i}"] for i in range(len(f.files))]
            if len(saved) == len(self.params) and all(
                a.shape == p.shape and a.dtype == p.dtype for a, p in zip(saved, self.params)
            ):
                ok[0] = 1
                for a, p in zip(saved, self.params):
                    p[...] = self._xp.asarray(a)
        self.comm.broadcast(ok, root=0)  # every rank learns whether rank 0 could read it
        if not ok[0]:
            raise ValueError(f"{path} does not hold this model's parameters")
        for p in self.params:
            self.comm.broadcast(p, root=0)

    def _host(self, p):
        return p if self._xp is np else self._xp.asnumpy(p)
