"""Buffers every rank maps (Communicator.empty) on thread ranks, and its argument errors."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pycollectives as pc


def test_thread_ranks_share_buffers(monkeypatch):
    monkeypatch.setenv("PYCOLL_SHARED_BYTES", "0")
    comms = pc.Communicator.local(3)

    def work(c):
        x = c.empty((4, 1000), np.float64)
        assert pc.runtime.shared.is_shared(x) and not pc.runtime.shared.is_shared(np.ones(3))
        x[:] = c.rank + 1
        c.all_reduce(x)
        g = c.empty((3, 4, 1000), np.float64)
        c.all_gather(x, g)
        c.broadcast(g, root=2)
        return x.copy(), g.copy()

    try:
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(work, comms))
    finally:
        for c in comms:
            c.close()
    for got, gathered in results:
        assert got.shape == (4, 1000) and (got == 6).all()
        assert (gathered == 6).all()


def test_empty_argument_errors():
    comms = pc.Communicator.local(1)
    try:
        c = comms[0]
        with pytest.raises(ValueError, match="negative"):
            c.empty((2, -1))
        with pytest.raises(TypeError, match="plain data"):
            c.empty(3, object)
        z = c.zeros((2, 3), np.int32)
        assert z.shape == (2, 3) and not z.any() and z.flags.writeable
        assert c.empty(0).size == 0
    finally:
        comms[0].close()
