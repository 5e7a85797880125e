"""Buffers the ranks of a machine can map: ``Communicator.empty`` and ``Communicator.zeros``.

A collective whose buffers lie in such memory on every rank runs without staging slots, each
rank reading its peers' buffers directly and writing every byte once (the memory bound; the
staged schedules copy it once more between cores): an all-reduce reduces each rank's shard of
every input into every output; reduce-scatter and reduce, each rank's block or shard into the
output that needs it; all-gather and broadcast copy straight from the sources. See
``csrc/host/shared_buffers.h``. Any other array still works everywhere; the mapped path runs
for all-reduces from ``PYCOLL_SHARED_BYTES`` (16 KiB) up, for reduce-scatter, all-gather,
broadcast and reduce (even counts) from 8 times that, where every rank's buffers are shared."""

from __future__ import annotations

import math

import numpy as np

from pycollectives import _C
from pycollectives.backends import HostBackend


def _shape(shape) -> tuple:
    try:
        dims = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    return dims


def empty(comm, shape, dtype=np.float32) -> np.ndarray:
    """A numpy array of `shape` and `dtype`, uninitialised, in memory `comm`'s peers can map.
    Collective: every rank calls it with the same shape and dtype (ValueError on every rank
    otherwise)."""
    dims, dtype = _shape(shape), np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"shared buffers hold plain data, not {dtype}")
    nbytes = math.prod(dims) * dtype.itemsize
    # Every rank learns whether all asked for the same: [max, -min] of the sizes and dtypes.
    mine = np.array([nbytes, -nbytes, dtype.num, -dtype.num], np.int64)
    agreed = comm.all_reduce(mine.copy(), op="max")
    if agreed[0] != -agreed[1] or agreed[2] != -agreed[3]:
        raise ValueError(
            f"Communicator.empty: ranks asked for different buffers (this rank: {dims} "
            f"{dtype}, {nbytes} bytes; sizes range {-agreed[1]}..{agreed[0]} bytes)"
        )
    host = comm._backend()
    if isinstance(host, HostBackend):  # one machine: eligible collectives trade descriptors
        host.c.enable_shared()
    buf = _C.SharedBuffer(nbytes)
    # The array's base chain holds the buffer: the memory lives as long as any view of it.
    return np.frombuffer(buf, np.uint8, count=nbytes).view(dtype).reshape(dims)


def zeros(comm, shape, dtype=np.float32) -> np.ndarray:
    """As ``empty``, filled with zeros (fresh shared memory is zero already)."""
    return empty(comm, shape, dtype)


def is_shared(x) -> bool:
    """Whether numpy array `x` lies in a buffer from ``Communicator.empty``."""
    return isinstance(x, np.ndarray) and x.size > 0 and _C.is_shared(x)
