"""send/recv of GPU arrays (pycollectives/backends/cuda/p2p.py) without a GPU: host memory
stands in for device memory, and a fake ``pycollectives._cuda`` queues the copies on
per-stream queues that run only when a stream is synchronised or a mark on it is waited for, as a
GPU's would. So a receive's data reaches its array only through its stream, and a staging buffer
whose copy has not run yet must not be handed out again.

Usage: mpiexec -n N python p2p_gpu_staged.py CASE
  matrix     every dtype and size class, a ring of batch_p2p, against the values sent
  semantics  async receives posted in the other tag order; data only after wait() and the
             stream; buffers reused only once their copies ran; host and GPU ops in one batch
  mismatch   GPU send of 10, GPU recv of 12: CollectiveMismatch on both ranks, buffers back
  bad        bad arrays refused before anything moves, the communicator stays usable
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections import defaultdict

import numpy as np
from checks import BFLOAT16, DTYPES, expect, make_input, run_main

import pycollectives
import pycollectives as pc


class FakeGpu:
    """Streams as queues of copies; marks as positions in them."""

    def __init__(self):
        self.queues = defaultdict(list)  # stream -> copies not run yet
        self.ran = defaultdict(int)  # stream -> copies run so far
        self.queued = defaultdict(int)

    def run(self, stream, upto=None):
        q = self.queues[stream]
        upto = self.queued[stream] if upto is None else upto
        while self.ran[stream] < upto:
            dst, src, n = q.pop(0)
            ctypes.memmove(dst, src, n)
            self.ran[stream] += 1

    def synchronize(self):
        for s in list(self.queues):
            self.run(s)


GPU = FakeGpu()


class PinnedBuffer(bytearray):
    def __init__(self, nbytes):
        super().__init__(nbytes)
        self._c = (ctypes.c_char * nbytes).from_buffer(self)

    @property
    def ptr(self):
        return ctypes.addressof(self._c)

    @property
    def nbytes(self):
        return len(self)


class StreamMark:
    def __init__(self, device, stream):
        self.stream, self.at = stream, GPU.queued[stream]

    def done(self):
        return GPU.ran[self.stream] >= self.at

    def wait(self, timeout, what):
        GPU.run(self.stream, self.at)


def copy_async(dst, src, nbytes, device, stream):
    if nbytes:
        GPU.queues[stream].append((dst, src, nbytes))
        GPU.queued[stream] += 1


def install_fake_native():
    fake = types.ModuleType("pycollectives._cuda")
    fake.PinnedBuffer, fake.StreamMark, fake.copy_async = PinnedBuffer, StreamMark, copy_async
    fake.pointer_device = lambda ptr: -1
    sys.modules["pycollectives._cuda"] = fake
    pycollectives._cuda = fake


class FakeCudaArray:
    """A numpy array's memory behind ``__cuda_array_interface__`` (device 0, stream 7)."""

    def __init__(self, a, stream=7, strides=None):
        self.host = a
        self.dtype = a.dtype  # bfloat16's typestr is "<V2": the name tells it apart
        self.device = 0
        self.__cuda_array_interface__ = {
            "shape": a.shape if strides is None else (a.size // 2,),
            "typestr": a.dtype.str,
            "data": (a.__array_interface__["data"][0], False),
            "strides": strides,
            "version": 3,
            "stream": stream,
        }


def gpu(a, **kw):
    return FakeCudaArray(np.ascontiguousarray(a), **kw)


def check_matrix(comm):
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dt in DTYPES:
        for count in (0, 1, 1000, 5000, 70_000, 300_000):
            x = gpu(make_input(r, count, dt, "sum"))
            out = gpu(np.zeros(count, dt))
            comm.batch_p2p([pc.P2POp("recv", out, prv, 4), pc.P2POp("send", x, nxt, 4)])
            want = make_input(prv, count, dt, "sum")
            if count:  # nothing lands before the stream runs
                assert GPU.queued[7] > GPU.ran[7], (dt, count)
            GPU.synchronize()
            assert np.array_equal(out.host.view(np.uint8), want.view(np.uint8)), (dt, count)
    print(f"staged matrix ranks={n} bfloat16={BFLOAT16 is not None}")


def check_semantics(comm, staged_pool):
    r = comm.rank
    if r == 0:
        a, b = gpu(np.arange(5000, dtype=np.int64)), gpu(np.full(3, 10, np.float32))
        work = comm.batch_p2p([pc.P2POp("send", a, 1, 1), pc.P2POp("send", b, 1, 2)], True)
        work.wait()
        # Host and GPU arrays in one batch, both ways.
        h_out, g_out = np.zeros(8, np.int32), gpu(np.zeros(8, np.int32))
        comm.batch_p2p(
            [
                pc.P2POp("send", np.arange(8, dtype=np.int32), 1, 5),
                pc.P2POp("send", gpu(np.arange(8, dtype=np.int32) * 2), 1, 6),
                pc.P2POp("recv", h_out, 1, 7),
                pc.P2POp("recv", g_out, 1, 8),
            ]
        )
        GPU.synchronize()
        assert (h_out == 3).all() and (g_out.host == 4).all()
    else:
        got_a, got_b = gpu(np.zeros(5000, np.int64)), gpu(np.zeros(3, np.float32))
        w2 = comm.recv(got_b, 0, tag=2, async_op=True)  # the other order than sent
        w1 = comm.recv(got_a, 0, tag=1, async_op=True, stream=9)
        w2.wait()
        w1.wait()
        assert not got_a.host.any(), "landed before its stream ran"
        pool = staged_pool()
        copying = {b.ptr for idle in pool._idle.values() for b, _ in idle}
        assert len(copying) == 2, "both receives' buffers wait for their copies"
        fresh = pool.take(5000 * 8)
        assert fresh.ptr not in copying, "a buffer was handed out under a running copy"
        assert not w1.is_completed()
        GPU.run(9)
        assert w1.is_completed() and (got_a.host == np.arange(5000)).all()
        GPU.synchronize()
        assert (got_b.host == 10).all()
        again = pool.take(5000 * 8)
        assert again.ptr in copying, "a buffer whose copy ran was not reused"
        pool.give(fresh)
        pool.give(again)
        h_in, g_in = np.zeros(8, np.int32), gpu(np.zeros(8, np.int32))
        comm.batch_p2p(
            [
                pc.P2POp("recv", g_in, 0, 5),  # a host send into a GPU receive
                pc.P2POp("recv", h_in, 0, 6),  # and the other way
                pc.P2POp("send", np.full(8, 3, np.int32), 0, 7),
                pc.P2POp("send", gpu(np.full(8, 4, np.int32)), 0, 8),
            ]
        )
        GPU.synchronize()
        assert (g_in.host == np.arange(8)).all() and (h_in == np.arange(8) * 2).all()
    print(f"staged semantics rank={r}")


def check_mismatch(comm, staged_pool):
    r = comm.rank
    if r == 0:
        expect(pc.CollectiveMismatch, lambda: comm.send(gpu(np.zeros(10, np.float32)), 1), "10")
    else:
        expect(pc.CollectiveMismatch, lambda: comm.recv(gpu(np.zeros(12, np.float32)), 0), "12")
    GPU.synchronize()
    assert staged_pool().idle_buffers() >= 1, "the failed batch kept its buffer"
    print(f"staged mismatch rank={r}")


def check_bad(comm):
    r, peer = comm.rank, 1 - comm.rank
    a = np.zeros(8, np.float32)
    expect(ValueError, lambda: comm.send(gpu(a, strides=(8,)), peer), "C-contiguous")
    expect(TypeError, lambda: comm.send(gpu(np.zeros(4, np.complex64)), peer), "unsupported dtype")
    ro = gpu(a)
    ro.__cuda_array_interface__["data"] = (ro.__cuda_array_interface__["data"][0], True)
    expect(ValueError, lambda: comm.recv(ro, peer), "read-only")
    expect(ValueError, lambda: comm.send(gpu(a), r), "peer")
    assert not GPU.queued, "a copy was queued for a refused call"
    out = gpu(np.zeros(4, np.float32))
    comm.batch_p2p(
        [pc.P2POp("send", gpu(np.full(4, r, np.float32)), peer), pc.P2POp("recv", out, peer)]
    )
    GPU.synchronize()
    assert (out.host == peer).all()
    print(f"staged bad rank={r}")


def main():
    GPU.__init__()  # a fresh fake GPU per run (a rank pool runs several in one process)
    install_fake_native()
    case = sys.argv[1]
    with pc.Communicator(timeout=30) as comm:

        def pool():
            return comm._staged_p2p().pool

        if case == "matrix":
            check_matrix(comm)
        elif case == "semantics":
            check_semantics(comm, pool)
        elif case == "mismatch":
            check_mismatch(comm, pool)
        elif case == "bad":
            check_bad(comm)
        else:
            raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    run_main(main)
