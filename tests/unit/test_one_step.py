"""The one-step path of blocking calls on numpy arrays (Communicator._run_now, the core's
run_now): which calls take it, that they agree with numpy and with the general path, and that
its errors reach Python as the general path's do."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pycollectives as pc
from pycollectives.ops import collective_code

torch = pytest.importorskip("torch")


def run_ranks(comms, fn):
    with ThreadPoolExecutor(len(comms)) as pool:
        return list(pool.map(fn, comms))


def spy(comm) -> list:
    """What each of `comm`'s calls to the one-step path returned, in order."""
    returned, real = [], comm._run_now

    def recorded(*args):
        returned.append(real(*args))
        return returned[-1]

    comm._run_now = recorded
    return returned


def test_one_step_calls_and_fallbacks_agree_with_numpy():
    n = 2
    comms = pc.Communicator.local(n, timeout=30)
    inputs = [np.random.default_rng(r).normal(size=64).astype(np.float32) for r in range(n)]
    total = np.sum(inputs, axis=0)

    def body(c):
        r, seen = c.rank, spy(c)
        got = {}
        # Taken in one step: numpy arrays, a ReduceOp or its name, root an int, algorithm None
        # or a name.
        got["sum"] = c.all_reduce(inputs[r].copy())
        got["by_name"] = c.all_reduce(inputs[r].copy(), op="min")
        got["by_upper_name"] = c.all_reduce(inputs[r].copy(), op="MIN")
        got["max_ring"] = c.all_reduce(inputs[r].copy(), op=pc.MAX, algorithm="ring")
        out = np.empty(64, np.float32)
        got["oop"] = c.all_reduce(inputs[r], out) is out and out
        got["ag"] = c.all_gather(inputs[r], np.empty(n * 64, np.float32))
        got["rs"] = c.reduce_scatter(np.concatenate([inputs[r]] * n), np.empty(64, np.float32))
        got["bc"] = c.broadcast(inputs[r].copy(), root=1)
        got["red"] = c.reduce(inputs[r].copy(), root=0)
        t = torch.from_numpy(inputs[r].copy())  # torch CPU tensors too
        got["torch"] = c.all_reduce(t).numpy()
        one_step = list(seen)
        # Not taken (False, then the general path): torch.distributed's op, async_op, a numpy
        # integer root, split lists (never offered).
        got["torch_op"] = c.all_reduce(inputs[r].copy(), op=torch.distributed.ReduceOp.MIN)
        got["async"] = c.all_reduce(inputs[r].copy(), async_op=True).wait() and None
        got["np_root"] = c.broadcast(inputs[r].copy(), root=np.int64(1))
        c.all_gather(inputs[r][: r + 1], np.empty(3, np.float32), counts=[1, 2])
        return one_step, seen[len(one_step) :], got

    results = run_ranks(comms, body)
    for r, (one_step, general, got) in enumerate(results):
        assert one_step == [True] * 10
        assert general == [False] * 3  # counts= never reaches the one-step path
        np.testing.assert_allclose(got["sum"], total, rtol=1e-6)
        np.testing.assert_array_equal(got["max_ring"], np.maximum(*inputs))
        np.testing.assert_allclose(got["oop"], total, rtol=1e-6)
        np.testing.assert_array_equal(got["ag"], np.concatenate(inputs))
        np.testing.assert_allclose(got["rs"], total, rtol=1e-6)  # block r of every rank
        np.testing.assert_array_equal(got["bc"], inputs[1])
        if r == 0:
            np.testing.assert_allclose(got["red"], total, rtol=1e-6)
        for name in ("by_name", "by_upper_name", "torch_op"):
            np.testing.assert_array_equal(got[name], np.minimum(*inputs))
        np.testing.assert_array_equal(got["np_root"], inputs[1])
        np.testing.assert_allclose(got["torch"], total, rtol=1e-6)
    for c in comms:
        c.close()


def test_one_step_errors_are_the_general_paths():
    """An error raised in the core on the one-step path is translated as pybind11 translates
    every other: TypeError, ValueError, and the package's CollectiveError, not a SystemError."""
    (c,) = pc.Communicator.local(1, timeout=30)
    now, ar, bc = c._run_now, collective_code("all_reduce"), collective_code("broadcast")
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        now(ar, np.ones(4, np.complex64), None, pc.SUM, 0, None, False, None)
    with pytest.raises(ValueError, match="root 3 is out of range"):
        now(bc, np.ones(4, np.float32), None, 0, 3, None, False, None)
    with pytest.raises(TypeError, match="8 positional arguments"):
        now(bc, np.ones(4, np.float32))
    with pytest.raises(RuntimeError, match="no error pending"):  # not a crash
        pc._C._raise_pending()
    # Not for the one-step path: False, nothing run.
    seq = c.seq
    assert now(ar, np.ones(4, np.float32), None, 0, 0, None, False, None) is False  # int op
    assert now(ar, np.ones(4, np.float32), None, pc.SUM, 0, "nope", False, None) is False
    assert now(ar, np.ones(4, np.float32), None, "Sum", 0, None, False, None) is False
    assert now(ar, np.ones(4, np.float32), None, pc.SUM, 2**70, None, False, None) is False
    for code in (99, -1, 2**70):
        assert now(code, np.ones(4, np.float32), None, pc.SUM, 0, None, False, None) is False
    assert c.seq == seq
    assert now(ar, np.ones(4, np.float32), None, pc.SUM, 0, "auto", False, None) is True
    assert c.seq == seq + 1
    c._host.c.abort("stopped by the test")
    with pytest.raises(pc.CollectiveError, match="stopped by the test"):
        c.all_reduce(np.ones(4, np.float32))
    c.close()


TORCH_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")


def test_torch_cpu_tensors_in_one_step_agree_with_numpy():
    """Blocking calls on torch CPU tensors run in one native step, as numpy arrays do, on every
    dtype the host moves, in place and out of place; what the step does not take (other
    layouts, dtypes and types, a mix of numpy and torch) takes the general path, which says
    what is wrong as before."""
    n, count = 2, 24
    comms = pc.Communicator.local(n, timeout=30)

    def ref(r, dt):  # small integers: exact in every dtype, sums included
        return np.random.default_rng(r).integers(0, 5, count).astype(np.float64)

    def tensor(values, dt):
        return torch.tensor(values, dtype=getattr(torch, dt))

    def body(c):
        r, seen, got = c.rank, spy(c), {}
        for dt in TORCH_DTYPES:
            x = tensor(ref(r, dt), dt)
            got[dt, "ar"] = c.all_reduce(x.clone()).double().numpy()
            out = tensor(np.zeros(count), dt)
            got[dt, "ar_out"] = (c.all_reduce(x, out, op="max") is out) and out.double().numpy()
            ag = tensor(np.zeros(n * count), dt)
            got[dt, "ag"] = c.all_gather(x, ag).double().numpy()
            rs = tensor(np.zeros(count // n), dt)
            got[dt, "rs"] = c.reduce_scatter(x, rs).double().numpy()
            got[dt, "bc"] = c.broadcast(x.clone(), root=1).double().numpy()
            got[dt, "red"] = c.reduce(x.clone(), root=0).double().numpy()
        one_step = list(seen)
        # The general path: a strided view, a dtype the host does not move, a Parameter (a
        # subclass), numpy and torch mixed.
        with pytest.raises(ValueError, match="C-contiguous"):
            c.all_reduce(torch.ones(8)[::2])
        with pytest.raises(TypeError, match="bool"):
            c.all_reduce(torch.ones(4, dtype=torch.bool))
        p = torch.nn.Parameter(tensor(ref(r, "float32"), "float32"))
        got["param"] = c.all_reduce(p).detach().numpy().astype(np.float64)
        mixed = np.zeros(count, np.float32)
        got["mixed"] = c.all_reduce(tensor(ref(r, "float32"), "float32"), mixed).astype(np.float64)
        return one_step, seen[len(one_step) :], got

    results = run_ranks(comms, body)
    total = ref(0, None) + ref(1, None)
    for r, (one_step, general, got) in enumerate(results):
        assert one_step == [True] * (6 * len(TORCH_DTYPES)), one_step
        assert general == [False] * 4, general
        for dt in TORCH_DTYPES:
            np.testing.assert_array_equal(got[dt, "ar"], total, err_msg=dt)
            np.testing.assert_array_equal(got[dt, "ar_out"], np.maximum(ref(0, dt), ref(1, dt)))
            np.testing.assert_array_equal(got[dt, "ag"], np.concatenate([ref(0, dt), ref(1, dt)]))
            half = count // n
            np.testing.assert_array_equal(got[dt, "rs"], total[r * half : (r + 1) * half])
            np.testing.assert_array_equal(got[dt, "bc"], ref(1, dt))
            if r == 0:
                np.testing.assert_array_equal(got[dt, "red"], total, err_msg=dt)
        np.testing.assert_array_equal(got["param"], total)
        np.testing.assert_array_equal(got["mixed"], total)
    for c in comms:
        c.close()


def test_torch_cpu_tensors_without_a_required_out_are_refused_as_numpy_arrays_are():
    """all_gather and reduce_scatter need `out`: without it a tensor gets the general path's
    error, as a numpy array does (the single-array form is not theirs)."""
    (c,) = pc.Communicator.local(1, timeout=30)
    returned = spy(c)
    for fn in (c.all_gather, c.reduce_scatter):
        for x in (np.ones(4, np.float32), torch.ones(4)):
            with pytest.raises(TypeError, match="out must be a numpy.ndarray, got NoneType"):
                fn(x, None)
    # numpy's are refused in the step itself (it raises), the tensors' in the general path
    assert returned == [False] * 2 and c.seq == 0
    c.close()
