"""The one-step path of blocking calls on device arrays (``_C.HostComm.run_now_via``,
csrc/python/device_route.h): which calls it hands to a device's C interface and with what, which
it leaves to the general path, that the arrays stay referenced until the device is done with
them, and the collectives' results on the emulated device against numpy. Arrays here are
stand-ins with cupy's attributes over numpy memory; the devices are the emulated module's
(``_emu.NullComm`` records each call and moves nothing)."""

import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pycollectives as pc
from pycollectives.ops import DTYPES, algo_code, collective_code, op_code

_emu = pytest.importorskip("pycollectives._emu")
from pycollectives.torch.backend import emulated_device  # noqa: E402 - needs _emu

STREAM = 0x5000


class DevArray:
    """cupy's attributes (data.ptr, data.device_id, size, dtype, flags.c_contiguous) over a
    numpy array's memory."""

    def __init__(self, a: np.ndarray, device: int = 0):
        self.a = a
        self.data = types.SimpleNamespace(ptr=a.__array_interface__["data"][0], device_id=device)
        self.size, self.dtype = a.size, a.dtype
        self.flags = types.SimpleNamespace(c_contiguous=a.flags.c_contiguous)

    @property
    def ptr(self) -> int:
        return self.data.ptr


def current_stream():
    return types.SimpleNamespace(ptr=STREAM)


def routed(comm, device_api, dev, keep=None):
    """`comm`'s one-step path with a route to `dev` (an address's owner) for DevArray on
    device 0; returns the path's function, also installed as comm._run_now."""
    now = comm._host.c.run_now_via(
        device_api, dev.address, dev if keep is None else keep, DevArray, current_stream, 0
    )
    comm._run_now = now
    return now


@pytest.fixture
def null_comm():
    (comm,) = pc.Communicator.local(1, timeout=30)
    dev = _emu.NullComm(0, 1)
    now = routed(comm, _emu.null_device_api, dev)
    yield comm, dev, now
    comm.close()


def f32(n, value=1.0):
    return DevArray(np.full(n, value, np.float32))


def test_blocking_calls_reach_the_device_as_checked_calls(null_comm):
    comm, dev, _ = null_comm
    x, out = f32(4), f32(4, 0.0)
    assert comm.all_reduce(x, out, op="max", stream=7) is out
    name, src, dst, count, dtype, op, root, algo, stream = dev.last
    assert (name, src, dst, count, op, root, algo, stream) == (
        "all_reduce",
        x.ptr,
        out.ptr,
        4,
        op_code("max"),
        0,
        "auto",
        7,
    )
    assert dtype == DTYPES.index("float32")
    assert comm.all_reduce(x) is x  # in place, on the current stream
    assert dev.last[1:3] == (x.ptr, x.ptr) and dev.last[8] == STREAM
    assert comm.broadcast(x, 0, "ring", stream=types.SimpleNamespace(cuda_stream=9)) is x
    assert dev.last[0] == "broadcast" and dev.last[7] == "ring" and dev.last[8] == 9
    assert comm.reduce(x, out, 0, "min") is out and dev.last[0] == "reduce"
    assert dev.last[5] == op_code("min")
    assert comm.all_gather(x, out) is out and dev.last[0] == "all_gather"
    assert comm.reduce_scatter(x, out) is out and dev.last[0] == "reduce_scatter"
    assert dev.runs == 6


def test_arrays_stay_referenced_until_the_device_has_finished():
    (comm,) = pc.Communicator.local(1, timeout=30)
    dev = _emu.NullComm(0, 1)
    routed(comm, _emu.null_device_api, dev)
    x, out = f32(4), f32(4, 0.0)
    before = sys.getrefcount(x), sys.getrefcount(out)
    dev.hold = True  # calls stay unfinished until finish()
    comm.all_reduce(x, out)
    comm.all_reduce(x, out)
    assert (sys.getrefcount(x), sys.getrefcount(out)) == (before[0] + 2, before[1] + 2)
    dev.finish()
    dev.hold = False
    y = f32(2)
    comm.all_reduce(y)  # finished calls are let go at the next
    assert (sys.getrefcount(x), sys.getrefcount(out)) == before
    dev.hold = True
    comm.all_reduce(x, out)
    assert sys.getrefcount(x) == before[0] + 1
    comm.close()  # the route, and what it holds, go with the communicator's one-step path
    assert sys.getrefcount(x) == before[0]


def test_what_the_route_does_not_take_goes_to_the_general_path(null_comm):
    comm, dev, now = null_comm
    ar, ag, gather = (collective_code(c) for c in ("all_reduce", "all_gather", "gather"))
    sum_ = pc.SUM
    x = f32(4)
    strided = DevArray(np.ones(8, np.float32)[::2])
    elsewhere = DevArray(np.ones(4, np.float32), device=1)
    complex_ = DevArray(np.ones(4, np.complex64))
    other = types.SimpleNamespace(**vars(f32(4)))  # the attributes, another type
    no_data = DevArray(np.ones(4, np.float32))
    del no_data.data
    declined = [
        (ar, strided, None, sum_, 0, None, False, None),
        (ar, elsewhere, None, sum_, 0, None, False, None),
        (ar, complex_, None, sum_, 0, None, False, None),
        (ar, x, DevArray(np.ones(4, np.float64)), sum_, 0, None, False, None),
        (ar, other, None, sum_, 0, None, False, None),
        (ar, no_data, None, sum_, 0, None, False, None),
        (ar, x, None, sum_, 0, None, True, None),  # async_op: a Work, made in Python
        (ar, x, None, sum_, 0, None, False, "stream"),
        (ag, x, None, 0, 0, None, False, None),  # all_gather needs out
        (gather, x, f32(4), 0, 0, None, False, None),
        (ar, x, None, 99.0, 0, None, False, None),  # op, root and algorithm as run_now takes
        (ar, x, None, sum_, "0", None, False, None),
        (ar, x, None, sum_, 0, algo_code("ring"), False, None),
    ]
    for args in declined:
        assert now(*args) is False, args
    assert dev.runs == 0
    failing = comm._host.c.run_now_via(
        _emu.null_device_api, dev.address, dev, DevArray, lambda: 1 / 0, 0
    )
    assert failing(ar, x, None, sum_, 0, None, False, None) is False and dev.runs == 0
    # numpy arrays still run on the host
    y = np.arange(4, dtype=np.float32)
    assert now(ar, y, None, sum_, 0, None, False, None) is True and dev.runs == 0


def test_bad_calls_raise_before_the_device_runs(null_comm):
    comm, dev, _ = null_comm
    x = f32(4)
    with pytest.raises(ValueError, match="all_gather: out has 3 elements, expected 4"):
        comm.all_gather(x, f32(3))
    with pytest.raises(ValueError, match="root"):
        comm.broadcast(x, 3)
    ints = DevArray(np.ones(4, np.int32))
    with pytest.raises(ValueError, match="op avg is not supported for integer dtype int32"):
        comm.all_reduce(ints, op="avg")
    assert dev.runs == 0


def test_route_arguments_are_checked():
    (comm,) = pc.Communicator.local(1, timeout=30)
    try:
        dev = _emu.NullComm(0, 1)
        via = comm._host.c.run_now_via
        with pytest.raises(ValueError):
            via(_emu.null_device_api, 0, dev, DevArray, current_stream, 0)
        with pytest.raises(TypeError):
            via(_emu.null_device_api, dev.address, dev, "DevArray", current_stream, 0)
        with pytest.raises(TypeError):
            via(_emu.null_device_api, dev.address, dev, DevArray, 5, 0)
    finally:
        comm.close()


@pytest.mark.emulated
def test_collectives_on_the_emulated_device_agree_with_numpy():
    n, count = 3, 1000
    comms = pc.Communicator.local(n, timeout=60)
    rng = np.random.default_rng(7)
    inputs = [rng.integers(-50, 50, n * count).astype(np.float32) for _ in range(n)]
    total = np.sum(inputs, axis=0)

    def body(c):
        r = c.rank
        dev = emulated_device(c)
        stream = _emu.EmuStream(dev, 20)  # each call starts late: the host must not wait
        routed(c, _emu.device_api, stream)
        started = dev.completed
        x = DevArray(inputs[r][:count].copy())
        ar_out = DevArray(np.zeros(count, np.float32))
        c.all_reduce(x, ar_out)
        rs_out = DevArray(np.zeros(count, np.float32))
        c.reduce_scatter(DevArray(inputs[r].copy()), rs_out)
        ag_out = DevArray(np.zeros(n * count, np.float32))
        c.all_gather(x, ag_out)
        b = DevArray(np.full(count, float(r), np.float32))
        c.broadcast(b, 1)
        red = DevArray(inputs[r][:count].copy())
        c.reduce(red, None, 2, "max")
        # The inputs made for one call are referenced by the route alone while the stream
        # runs them late. Once the device has run all five, the route goes, then the stream.
        deadline = time.monotonic() + 30
        while dev.completed < started + 5:
            assert time.monotonic() < deadline, f"{dev.completed - started} of 5 calls ran"
            time.sleep(0.001)
        c._run_now = _not_now
        del stream
        expect_max = np.max([a[:count] for a in inputs], axis=0)
        np.testing.assert_array_equal(ar_out.a, total[:count])
        np.testing.assert_array_equal(rs_out.a, total[r * count : (r + 1) * count])
        np.testing.assert_array_equal(ag_out.a, np.concatenate([a[:count] for a in inputs]))
        np.testing.assert_array_equal(b.a, np.full(count, 1.0, np.float32))
        if r == 2:
            np.testing.assert_array_equal(red.a, expect_max)
        return True

    from pycollectives.communicator import _not_now

    try:
        with ThreadPoolExecutor(n) as pool:
            assert all(pool.map(body, comms))
    finally:
        for c in comms:
            c.close()


def test_close_raises_what_a_device_wait_left():
    """A blocking call the route took keeps no Work in Python, so close() asks the transport
    for what a failed device wait left (the error the next call would have raised)."""
    (comm,) = pc.Communicator.local(1, timeout=30)
    dev = _emu.NullComm(0, 1)
    routed(comm, _emu.null_device_api, dev)
    comm.all_reduce(f32(4))
    assert dev.runs == 1 and not comm._inflight._works

    class Transport:  # what close() asks of the CUDA transport
        closed = False

        def check(self):
            raise pc.CollectiveError("all_reduce #1: a device wait timed out")

        def close(self):
            self.closed = True

    comm._cuda = Transport()
    with pytest.raises(pc.CollectiveError, match="a device wait timed out"):
        comm.close()
