"""Reproducible mode's settings and its fold (ranks as threads: Communicator.local); the
matrix over processes, nodes and the emulated device is tests/ranks/test_reproducible.py."""

import threading

import numpy as np
import pytest

import pycollectives as pc
from pycollectives import _C
from pycollectives.ops import op_code
from pycollectives.options import Options
from pycollectives.runtime import bootstrap

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def code(dt):
    return pc.ops.DTYPES.index(dt.name)


def test_the_setting_from_the_environment_and_the_argument():
    assert Options.resolve(environ={}).reproducible is False
    assert Options.resolve(environ={"PYCOLL_REPRODUCIBLE": "1"}).reproducible is True
    assert Options.resolve(environ={"PYCOLL_REPRODUCIBLE": "on"}).reproducible is True
    assert (
        Options.resolve(reproducible=False, environ={"PYCOLL_REPRODUCIBLE": "1"}).reproducible
        is False
    )
    with pytest.raises(ValueError, match="PYCOLL_REPRODUCIBLE"):
        Options.resolve(environ={"PYCOLL_REPRODUCIBLE": "yes please"})


def test_fold_rows_by_hand():
    # float16 accumulates in float32: 2048 + 1 + 1 = 2050 (in float16, 2048 + 1 rounds back
    # to 2048 twice).
    out = np.empty(1, F16)
    _C.fold_rows(np.array([2048, 1, 1], F16), out, code(F16), op_code("sum"), 1)
    assert out[0] == 2050
    # In rank order: (1e8 + 1) - 1e8 is 0 in float32 (1 is below the spacing of 1e8, 8);
    # (1e8 - 1e8) + 1 would be 1.
    out = np.empty(1, F32)
    _C.fold_rows(np.array([1e8, 1, -1e8], F32), out, code(F32), op_code("sum"), 1)
    assert out[0] == 0
    # An average divides the sum once: (1 + 2 + 4) / 3.
    _C.fold_rows(np.array([1, 2, 4], F32), out, code(F32), op_code("avg"), 3)
    assert out[0] == np.float32(7) / np.float32(3)
    with pytest.raises(ValueError, match="whole rows"):
        _C.fold_rows(np.zeros(5, F32), np.empty(2, F32), code(F32), op_code("sum"), 1)


def test_ring_and_tree_sum_in_rank_order():
    n = 3
    rows = np.array([[1e8, 3.0], [1.0, -1e8], [-1e8, 1e8]], F32)
    want = (rows[0] + rows[1]) + rows[2]  # numpy, in rank order: [0, 3] where others give 1, 0
    for reproducible, differs in ((True, False), (None, True)):
        comms = pc.Communicator.local(n, timeout=30, reproducible=reproducible)
        got = {}

        def body(c, got=got):
            for algo in ("ring", "tree", "direct", None):
                x = np.repeat(rows[c.rank], 1000)  # several pieces of every rank's block
                c.all_reduce(x, algorithm=algo)
                got[c.rank, algo] = x.copy()
            c.close()

        threads = [threading.Thread(target=body, args=(c,)) for c in comms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        full = np.repeat(want, 1000)
        ordered = {k: np.array_equal(v, full) for k, v in got.items()}
        if not differs:
            assert all(ordered.values()), ordered
        else:  # without the mode the ring adds some blocks out of rank order
            assert not all(ordered[r, "ring"] for r in range(n)), ordered


def test_ranks_that_disagree_on_the_setting_refuse_to_start():
    n = 2
    shared = bootstrap.ThreadGroup.shared(n)
    groups = [bootstrap.ThreadGroup(r, shared, 30.0) for r in range(n)]
    errors = [None] * n

    def make(r):
        try:
            pc.Communicator(groups[r], reproducible=r == 0).close()
        except ValueError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e is not None and "reproducible" in e for e in errors), errors


def test_a_calls_setting_must_be_a_bool():
    (comm,) = pc.Communicator.local(1, timeout=10)
    with pytest.raises(TypeError, match="reproducible must be True, False or None"):
        comm.all_reduce(np.ones(4, F32), reproducible=1)
    comm.close()
