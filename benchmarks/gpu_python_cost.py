"""The layers above the GPU of a GPU collective, measured without a GPU: an 8 B all-reduce on
cupy-like arrays through ``Communicator.all_reduce`` and ``CudaComm.all_reduce``, with a
stand-in for the native CUDA module whose ``run`` does nothing but return a finished Work.

    python benchmarks/gpu_python_cost.py [--calls 20000]

What it times is what every GPU call pays before the device runs it (describing the arrays,
checking the call, choosing the stream, keeping the arrays until the device is done). A
blocking ``Communicator`` call takes the one-step path into C++ (``_C.HostComm.run_now_via``)
where the emulated device's module is built: the stand-in then offers its C interface over a
device that checks and records each call and moves nothing (``_emu.NullComm``).
``CudaComm``'s own methods take the Python path. On a GPU machine the same layers are timed
for real by benchmarks/gpu_call_cost.py. The stand-in arrays offer both cupy's own
attributes and ``__cuda_array_interface__``, so any version of the package runs it. One
process, no mpiexec needed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import types

import numpy as np

try:  # the emulated device's module (a checkout's build; not a plain pip install)
    from pycollectives import _emu
except ImportError:
    _emu = None


class _Work:
    seq = 0

    def is_completed(self):
        return True

    def wait_on(self, stream):
        pass


class _NativeComm:
    """Stands in for ``_cuda.CudaComm`` on one rank and one device."""

    def __init__(self, rank, size, device, opts):
        self.rank, self.size, self.device, self.timeout, self.seq = rank, size, device, 60.0, 0
        self.ipc_handle, self.shm_name, self.device_uuid = bytes(64), "stand-in", bytes(16)
        self.poisoned = False
        if _emu is not None:  # the C interface's device: checks and records, moves nothing
            self.device_comm = _emu.NullComm(rank, size)
            self.address = self.device_comm.address

    def attach(self, handles, shm_names, sync_mode):
        self.sync_mode = sync_mode

    def unlink(self):
        pass

    def set_flight_dump(self, path, rank, size, comm):
        pass

    def check(self):
        pass

    def run(self, *args, **lists):
        self.seq += 1
        return _Work()

    def barrier(self):
        pass

    def close(self):
        pass


class _Options:
    def __init__(self):
        self.slot_bytes, self.nslots, self.nblocks, self.timeout = 1 << 20, 4, 8, 60.0
        self.debug, self.check_mismatch = False, True
        self.oneshot_max_bytes, self.direct_max_bytes = 64 * 1024, 256 * 1024


def install_stand_ins():
    """A native CUDA module and a cupy that need no GPU (before pycollectives is imported)."""
    try:  # the real module's checks, which the Communicator runs before the first GPU call
        from pycollectives import _cuda

        check_args = getattr(_cuda, "check_args", None)
    except ImportError:
        check_args = None
    native = types.ModuleType("pycollectives._cuda")
    native.check_args = check_args or (lambda *args, **kw: 0)
    native.device_count = lambda: (1, "")
    native.pointer_device = lambda ptr: 0
    native.sm_count = lambda device: 132  # the residency check's report of the GPU
    native.device_uuid = lambda device: bytes(16)
    native.resident_blocks_per_sm = lambda device: 1
    native.has_stream_value_ops = lambda device: True
    native.CudaComm, native.CudaCommOptions, native.MAX_RANKS = _NativeComm, _Options, 32
    if _emu is not None:
        native.device_api = _emu.null_device_api
    sys.modules["pycollectives._cuda"] = native
    if check_args is not None:  # the package is imported: its attribute is the stand-in too
        sys.modules["pycollectives"]._cuda = native

    cupy = types.ModuleType("cupy")
    stream = types.SimpleNamespace(ptr=0)
    # A builtin, as cupy's (compiled) function is: no Python frame of its own.
    cupy.cuda = types.SimpleNamespace(get_current_stream=itertools.repeat(stream).__next__)

    class ndarray:  # noqa: N801 (cupy's name)
        def __init__(self, ptr, n):
            self.data = types.SimpleNamespace(ptr=ptr, device_id=0)
            self.size, self.dtype, self.shape = n, np.dtype(np.float32), (n,)
            self.flags = types.SimpleNamespace(c_contiguous=True)
            self.device = types.SimpleNamespace(id=0)

        @property
        def __cuda_array_interface__(self):  # built on each access, as cupy's is
            return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr,
                    "data": (self.data.ptr, False), "strides": None, "version": 3,
                    "stream": 1}  # fmt: skip

    cupy.ndarray = ndarray
    sys.modules["cupy"] = cupy
    return cupy


def per_call(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    cupy = install_stand_ins()
    from mpi4py import MPI

    import pycollectives as pc

    comm = pc.Communicator(MPI.COMM_SELF)
    x, out = cupy.ndarray(1 << 40, 2), cupy.ndarray((1 << 40) + 4096, 2)
    comm.all_reduce(x, out)  # starts the (stand-in) CUDA transport
    inner = comm._cuda
    print("# the Python layer of an 8 B GPU all-reduce, native call stood in for; best of 5")
    for name, fn in (("Communicator", lambda: comm.all_reduce(x, out)),
                     ("CudaComm", lambda: inner.all_reduce(x, out))):  # fmt: skip
        print(f"{name:14s} {per_call(fn, args.calls) * 1e6:6.2f} us/call")
    comm.close()


if __name__ == "__main__":
    main()
