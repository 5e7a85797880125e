"""The array libraries one test body runs over (as mpi4py's tests' ``arrayimpl``).

A body makes its inputs and references in numpy, hands the library's arrays to the collective
and reads them back in numpy::

    lib = array_lib("torch")
    x = lib.asarray(make_input(r, count, dt, op))    # a new array of the library
    out = lib.zeros(count, dt)
    comm.all_reduce(x, out)
    check_close(lib.numpy(out), want, ...)

Libraries: ``numpy``; ``torch`` (CPU tensors); on a GPU ``cupy`` and ``torch-cuda``. The
emulated device takes numpy arrays (workers/emulated.py runs the same bodies through an
adapter with the Communicator's API).
"""

from __future__ import annotations

import checks
import numpy as np
from checks import is_bfloat16

NAMES = ("numpy", "torch", "cupy", "torch-cuda")


class Numpy:
    name, on_gpu = "numpy", False

    def supports(self, dt) -> bool:
        return True

    def asarray(self, a: np.ndarray):
        return a.copy()

    def zeros(self, count: int, dt):
        return np.zeros(count, dt)

    def numpy(self, a) -> np.ndarray:
        return a


class Cupy:
    name, on_gpu = "cupy", True

    def __init__(self):
        import cupy

        self.cp = cupy
        cupy.cuda.Device(local_rank() % cupy.cuda.runtime.getDeviceCount()).use()

    def supports(self, dt) -> bool:
        return not is_bfloat16(dt)  # cupy has no bfloat16

    def asarray(self, a: np.ndarray):
        return self.cp.asarray(a)

    def zeros(self, count: int, dt):
        return self.cp.zeros(count, dt)

    def numpy(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)  # on the current stream: after the collective


class Torch:
    """torch tensors on `device`; bfloat16 crosses from numpy (ml_dtypes) as its bits."""

    def __init__(self, device="cpu"):
        import torch

        if device == "cuda":
            torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        self.torch, self.device = torch, device
        self.name, self.on_gpu = ("torch" if device == "cpu" else "torch-cuda"), device != "cpu"

    def supports(self, dt) -> bool:
        return is_bfloat16(dt) or dt.kind in "iuf" and (dt.kind != "u" or dt.itemsize == 1)

    def asarray(self, a: np.ndarray):
        if is_bfloat16(a.dtype):
            t = self.torch.from_numpy(a.view(np.int16).copy()).view(self.torch.bfloat16)
        else:
            t = self.torch.from_numpy(a.copy())
        return t if self.device == "cpu" else t.to(self.device)

    def zeros(self, count: int, dt):
        like = self.asarray(np.zeros(0, dt))
        return self.torch.zeros(count, dtype=like.dtype, device=self.device)

    def numpy(self, t) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(checks.BFLOAT16)
        return t.numpy()


def pop_option(args: list, flag: str, default=None):
    """The value after `flag` in the argument list `args` (both removed from it), else
    `default`."""
    if flag not in args:
        return default
    i = args.index(flag)
    value = args[i + 1]
    del args[i : i + 2]
    return value


def local_rank() -> int:
    """This rank's index among the ranks of its machine (collective): on a machine with
    several GPUs each rank uses its own, as a user's job would."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return node.Get_rank()
    finally:
        node.Free()


def array_lib(name: str):
    """The library called `name` (one of NAMES); on a GPU, collective (each rank takes the
    device of its local rank)."""
    if name not in NAMES:
        raise ValueError(f"unknown array library {name!r}: expected one of {NAMES}")
    if name == "numpy":
        return Numpy()
    if name == "cupy":
        return Cupy()
    return Torch("cpu" if name == "torch" else "cuda")
