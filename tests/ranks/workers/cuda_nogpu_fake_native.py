"""How the CUDA communicator picks its device, with a fake ``pycollectives._cuda`` (two fake
GPUs, nothing dereferenced), so that it runs without a GPU.

Usage: mpiexec -n 3 python cuda_nogpu_fake_native.py CASE
  arrays        CudaComm(arrays=...) takes the arrays' device, not local_rank % device_count
  forced        PYCOLL_DEVICE=0 (set by the test), rank 1's arrays on device 1: CollectiveError
                naming rank 1 on every rank, and every rank's device memory released
  explicit      device=1 on every rank, rank 2's arrays on device 0: the same, naming rank 2
  split         rank 0's x on device 0 and out on device 1: CollectiveError on every rank
  communicator  pc.Communicator: the first GPU collective's arrays choose the device
  communicator_forced   pc.Communicator under PYCOLL_DEVICE=0, rank 1's arrays on device 1:
                CollectiveError on every rank, and later GPU calls say why
  communicator_new      pc.Communicator's all_to_all (splits), gather, scatter (arrays absent
                off the root) and uneven all_gather / reduce_scatter reach the native layer
                with their pointers, counts and lists
  register      CudaComm.register: every rank's handle reaches every rank's native registry in
                rank order; a rank whose array is not registrable (or not a CUDA array, or on
                another device) makes every rank raise CollectiveError naming it; a
                registration is released when its array goes
  communicator_register pc.Communicator.register: makes the CUDA communicator on the array's
                device (its first GPU operation) and registers through it
  residency     the blocks per launch and the mode every rank takes from every rank's GPU
                (PYCOLL_CUDA_SYNC=kernel, set by the test): the fake GPUs have 8 and 2 SMs
"""

from __future__ import annotations

import sys
import types

import numpy as np
from checks import expect, run_main
from mpi4py import MPI

import pycollectives

NDEV = 2
SMS = {0: 8, 1: 2}  # the fake GPUs' multiprocessors


class FakeNativeComm:
    """Stands in for ``_cuda.CudaComm``: records where it was made and what was asked of it."""

    made: list = []

    def __init__(self, rank, size, device, opts):
        if not 0 <= device < NDEV:
            raise ValueError(f"fake: no device {device}")
        self.rank, self.size, self.device, self.opts = rank, size, device, opts
        self.timeout = opts.timeout
        self.seq = 0
        self.poisoned = False
        self.closed = False
        self.calls = []
        self.ipc_handle = bytes([rank]) * 64
        self.shm_name = f"fake-{rank}"
        self.device_uuid = bytes([device]) * 16
        FakeNativeComm.made.append(self)

    def attach(self, handles, shm_names, sync_mode):
        assert len(handles) == len(shm_names) == self.size
        self.sync_mode = sync_mode

    def unlink(self):
        pass

    def set_flight_dump(self, path, rank, size, comm):
        self.flight = (path, rank, size, comm)

    def check(self):
        pass

    def run(self, call, x, out, stream):
        # The real module's checks, as the real run applies them before it queues anything.
        count = REAL_CHECK(call, x, out, self.rank, self.size)
        self.seq += 1
        self.calls.append((call.collective, x[0] if x else 0, out[0] if out else 0, count))
        self.lists = {k: getattr(call, k) for k in ("counts", "in_splits", "out_splits")}
        return FakeWork(self.seq)

    def barrier(self):
        self.seq += 1

    # Registered buffers: a handle is (key, handle bytes, allocation bytes, offset, bytes).
    def register_handle(self, ptr, nbytes):
        if ptr % 2:  # the fake's stand-in for memory the driver does not know
            raise ValueError("fake: not device memory")
        return (ptr >> 20, bytes([self.rank]) * 64, 1 << 20, ptr & 0xFFFFF, nbytes)

    def register_add(self, ptr, nbytes, handles):
        self.registered = getattr(self, "registered", {})
        number = len(self.registered) + 1
        self.registered[number] = (ptr, nbytes, list(handles))
        return number

    def register_release(self, number):
        del self.registered[number]

    def close(self):
        self.closed = True


class FakeWork:
    def __init__(self, seq):
        self.seq = seq

    def is_completed(self):
        return True

    def wait_on(self, stream):
        pass


REAL_CHECK = None


def install_fake_native():
    global REAL_CHECK
    from pycollectives import _cuda  # built without a GPU too: its checks need none

    REAL_CHECK = _cuda.check_args
    fake = types.ModuleType("pycollectives._cuda")
    fake.check_args = REAL_CHECK
    fake.device_count = lambda: (NDEV, "")
    fake.pointer_device = lambda ptr: -1
    fake.sm_count = lambda device: SMS[device]
    fake.device_uuid = lambda device: bytes([device]) * 16
    fake.resident_blocks_per_sm = lambda device: 1
    fake.has_stream_value_ops = lambda device: device == 1  # GPU 1 has them, GPU 0 not
    fake.CudaComm = FakeNativeComm
    fake.CudaCommOptions = _cuda.CudaCommOptions  # the real one: a field it lacks is refused
    fake.MAX_RANKS = 32
    sys.modules["pycollectives._cuda"] = fake
    pycollectives._cuda = fake


class FakeCudaArray:
    """``__cuda_array_interface__`` on a fake device; never dereferenced."""

    _next = 0x7F0000000000

    def __init__(self, count, device, typestr="<f4"):
        FakeCudaArray._next += 1 << 20
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": typestr,
            "data": (FakeCudaArray._next, False),
            "strides": None,
            "version": 3,
            "stream": 1,
        }
        self.device = device


def expect_everywhere(fn, *words):
    """`fn` raises CollectiveError containing `words` on this rank; returns the message."""
    from pycollectives.errors import CollectiveError

    return expect(CollectiveError, fn, *words)


def fields(opts) -> dict:
    """The native options' fields and values (for the message of a check that fails)."""
    return {k: getattr(opts, k) for k in dir(opts) if not k.startswith("_")}


def local_default(mpi):
    node = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=mpi.rank)
    local = node.Get_rank()
    node.Free()
    return local % NDEV


def ptr(a) -> int:
    return a.__cuda_array_interface__["data"][0]


def communicator_new(pc, mpi):
    """What the Communicator hands the native layer for the collectives with per-rank lists
    and for the rooted ones whose arrays are absent off the root."""
    r, n = mpi.rank, mpi.size
    dev = local_default(mpi)
    with pc.Communicator(timeout=20) as comm:
        send = [q + r for q in range(n)]  # rank q sends q + p to rank p: column p is p + q
        recv = [r + q for q in range(n)]
        x, out = FakeCudaArray(sum(send), dev), FakeCudaArray(sum(recv), dev)
        comm.all_to_all(x, out, send, recv)
        native = comm._cuda._c
        want = ("all_to_all", ptr(x), ptr(out), 0)
        assert native.calls[-1] == want, native.calls[-1]
        assert native.lists == {"counts": None, "in_splits": send, "out_splits": recv}
        counts = [1 + q for q in range(n)]
        x, out = FakeCudaArray(counts[r], dev), FakeCudaArray(sum(counts), dev)
        comm.all_gather(x, out, counts=counts)
        assert native.calls[-1][3] == sum(counts) and native.lists["counts"] == counts
        comm.reduce_scatter(out, x, counts=counts)
        assert native.calls[-1][1:] == (ptr(out), ptr(x), sum(counts)), native.calls[-1]
        x = FakeCudaArray(4, dev)
        full = FakeCudaArray(4 * n, dev) if r == 1 else None
        comm.gather(x, full, root=1)
        assert native.calls[-1][1:] == (ptr(x), ptr(full) if r == 1 else 0, 4), native.calls[-1]
        comm.scatter(full, x, root=1)
        assert native.calls[-1][1:] == (ptr(full) if r == 1 else 0, ptr(x), 4), native.calls[-1]
        assert native.lists == {"counts": None, "in_splits": None, "out_splits": None}
        mine, too_long = FakeCudaArray(counts[r], dev), FakeCudaArray(sum(counts) + 1, dev)
        expect(ValueError, lambda: comm.all_gather(mine, too_long, counts=counts), "out has")


def register(mpi, CudaComm):
    r, n = mpi.rank, mpi.size
    dev = local_default(mpi)
    comm = CudaComm(mpi, r, n, timeout=20)
    native = comm._c
    x = FakeCudaArray(100, dev)
    assert comm.register(x) is x
    everyone = mpi.allgather(native.register_handle(ptr(x), 400))
    ((got_ptr, got_bytes, handles),) = native.registered.values()
    assert (got_ptr, got_bytes) == (ptr(x), 400), (got_ptr, got_bytes)
    assert [tuple(h) for h in handles] == everyone, handles
    assert [h[1][0] for h in handles] == list(range(n)), "handles not in rank order"
    del x  # its registration goes with it (the fake array is its memory's owner)
    assert native.registered == {}, native.registered
    odd = FakeCudaArray(10, dev)
    if r == 1:
        odd.__cuda_array_interface__["data"] = (ptr(odd) + 1, False)
    expect_everywhere(lambda: comm.register(odd), "rank 1", "not device memory")
    host = np.zeros(4, np.float32) if r == 2 else FakeCudaArray(4, dev)
    expect_everywhere(lambda: comm.register(host), "rank 2", "CUDA array")
    assert native.registered == {}, native.registered
    comm.close()


def residency(mpi, CudaComm):
    """Kernel mode forced: the blocks every rank's launch may have so that all of them on one
    GPU are resident at once (backends/cuda/residency.py), the same on every rank."""
    import os
    import warnings

    from pycollectives.options import Options

    r, n = mpi.rank, mpi.size

    def made(device, blocks, sync="kernel"):
        env = {**os.environ, "PYCOLL_CUDA_BLOCKS": blocks, "PYCOLL_CUDA_SYNC": sync}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            comm = CudaComm(
                mpi, r, n, device=device, options=Options.resolve(timeout=20, environ=env)
            )
        mine = FakeNativeComm.made[-1]
        comm.close()
        told = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
        return comm.sync_mode, mine.opts.nblocks, told

    # auto, each rank on local_rank % 2: ranks 0 and 2 share GPU 0 (8 SMs): 4 blocks each fit;
    # rank 1 alone on GPU 1 (2 SMs) fits 2: every rank takes 2, and auto says nothing.
    mode, blocks, told = made(None, "auto")
    assert (mode, blocks, told) == ("kernel", 2, []), (mode, blocks, told)
    # Kernel mode makes no interprocess events (stepped mode's fences); stepped mode does.
    assert FakeNativeComm.made[-1].opts.stepped_events is False
    # 4 asked, all 3 on GPU 0: 8 // 3 = 2 each; rank 0 says why.
    mode, blocks, told = made(0, "4")
    assert (mode, blocks) == ("kernel", 2), (mode, blocks)
    if r == 0:
        assert len(told) == 1 and "2 blocks per launch instead of PYCOLL_CUDA_BLOCKS=4" in told[0]
        assert "3 ranks share GPU-00000000 (8 SMs, 1 block of the kernel per SM)" in told[0]
    else:
        assert told == [], told
    # All 3 on GPU 1 (2 SMs): not one block of each fits: stepped mode, every rank.
    mode, blocks, told = made(1, "4")
    assert (mode, blocks) == ("stepped", 4), (mode, blocks)
    # Stepped mode's fences: on counters where every rank's GPU has stream memory operations
    # (all on GPU 1 here), else on interprocess events.
    opts = FakeNativeComm.made[-1].opts
    assert (opts.stepped_events, opts.fence_counters) == (True, True), fields(opts)
    made(None, "4", sync="stepped")  # ranks 0 and 2 on GPU 0, which has none: events everywhere
    opts = FakeNativeComm.made[-1].opts
    assert (opts.stepped_events, opts.fence_counters) == (True, False), fields(opts)
    os.environ["PYCOLL_CUDA_FENCE_COUNTERS"] = "0"  # and where the user says so
    made(1, "4", sync="stepped")
    del os.environ["PYCOLL_CUDA_FENCE_COUNTERS"]
    opts = FakeNativeComm.made[-1].opts
    assert (opts.stepped_events, opts.fence_counters) == (True, False), fields(opts)
    assert r != 0 or "stepped mode instead of kernel mode" in told[0], told
    # Ranks that ask for different counts hear of it before anything is made.
    env = {**os.environ, "PYCOLL_CUDA_BLOCKS": "3" if r == 1 else "4"}
    expect(
        ValueError,
        lambda: CudaComm(mpi, r, n, device=0, options=Options.resolve(timeout=20, environ=env)),
        "PYCOLL_CUDA_BLOCKS",
    )


def main():
    case = sys.argv[1]
    install_fake_native()
    import pycollectives as pc
    from pycollectives.backends.cuda import CudaComm

    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    assert n >= 3, "run on 3 ranks"
    other = (local_default(mpi) + 1) % NDEV  # never the device local_rank % count would pick
    if case == "arrays":
        x = FakeCudaArray(8, other)
        comm = CudaComm(mpi, r, n, timeout=20, arrays=(x, None))
        assert comm.device == other, (comm.device, other)
        assert FakeNativeComm.made[-1].device == other
        comm.all_reduce(x, None, 0)  # the arrays' device: accepted
        comm.close()
    elif case in ("forced", "explicit", "split"):
        out, device = None, None
        if case == "forced":  # PYCOLL_DEVICE=0 in the environment
            x = FakeCudaArray(8, 1 if r == 1 else 0)
            words = ("rank 1", "device 1", "PYCOLL_DEVICE=0")
        elif case == "explicit":
            device, x = 1, FakeCudaArray(8, 0 if r == 2 else 1)
            words = ("rank 2", "device 0", "device=1")
        else:
            x = FakeCudaArray(8, 0)
            out = FakeCudaArray(8, 1) if r == 0 else None
            words = ("rank 0", "different CUDA devices", "x on device 0", "out on device 1")
        expect_everywhere(
            lambda: CudaComm(mpi, r, n, timeout=20, device=device, arrays=(x, out)), *words
        )
        # Every rank that had made its device memory gave it back.
        assert all(c.closed for c in FakeNativeComm.made), FakeNativeComm.made
    elif case == "communicator":
        with pc.Communicator(timeout=20) as comm:
            x = FakeCudaArray(8, other)
            comm.all_reduce(x)
            assert comm._cuda.device == other, (comm._cuda.device, other)
            h = np.full(3, r, np.int64)  # the host path still runs beside it
            comm.all_reduce(h)
            assert (h == n * (n - 1) // 2).all()
    elif case == "communicator_forced":
        comm = pc.Communicator(timeout=20)
        x = FakeCudaArray(8, 1 if r == 1 else 0)
        first = expect_everywhere(lambda: comm.all_reduce(x), "rank 1", "device 1")
        again = expect_everywhere(lambda: comm.all_reduce(FakeCudaArray(8, 0)))
        assert again == first, (first, again)
        h = np.full(3, r, np.int64)
        comm.all_reduce(h)
        assert (h == n * (n - 1) // 2).all()
        comm.close()
    elif case == "communicator_new":
        communicator_new(pc, mpi)
    elif case == "register":
        register(mpi, CudaComm)
    elif case == "communicator_register":
        with pc.Communicator(timeout=20) as comm:
            x = comm.register(FakeCudaArray(8, other))
            assert comm._cuda.device == other, (comm._cuda.device, other)
            ((got_ptr, got_bytes, handles),) = comm._cuda._c.registered.values()
            assert (got_ptr, got_bytes, len(handles)) == (ptr(x), 32, n), (got_ptr, got_bytes)
            expect(ValueError, lambda: comm.empty(4, device=1 - other), "device")
    elif case == "residency":
        residency(mpi, CudaComm)
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"{case} rank={r}", flush=True)


if __name__ == "__main__":
    run_main(main)
