"""Argument checks of the CUDA collectives: the host path's checks (csrc/bindings.cpp) for GPU
arrays, raised as ValueError/TypeError before anything is queued."""

from __future__ import annotations

from pycollectives import _C, arrays


def gpu_array(obj, fn: str, name: str, writable: bool, device) -> arrays.ArrayInfo:
    """Describes a CUDA array argument, or raises TypeError/ValueError saying what is wrong
    (`device`: the communicator's GPU, or None before it has one)."""
    try:
        info = arrays.describe(obj)
    except TypeError as e:
        raise TypeError(f"{fn}: {name}: {e}") from None
    if not info.is_cuda:
        raise TypeError(f"{fn}: {name} must be a CUDA array, got host memory ({info.library})")
    if info.dtype < 0:
        raise TypeError(
            f"{fn}: {name} has unsupported dtype {info.dtype_name} (supported: {arrays.SUPPORTED})"
        )
    if not info.contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous")
    if writable and info.readonly:
        raise ValueError(f"{fn}: {name} is read-only")
    if device is not None and info.device is not None and info.device != device:
        raise ValueError(
            f"{fn}: {name} is on CUDA device {info.device}, the communicator on device {device}"
        )
    return info


def check_call(collective, x, out, op, root, algorithm, rank, size, device):
    """Validates one call; returns (x info, out info, count) for the native layer. The arrays
    are described here; the collective's own checks (sizes, dtypes, overlap, op, root,
    algorithm) are the host path's (``_C.check_described_args``)."""
    fn = collective
    single = collective == "broadcast" or out is None
    written = collective == "broadcast" or (out is None and collective in ("all_reduce", "reduce"))
    xi = gpu_array(x, fn, "x", written, device)
    oi = xi if single else gpu_array(out, fn, "out", True, device)
    count = _C.check_described_args(
        collective,
        (xi.ptr, xi.count, xi.dtype),
        None if oi is xi else (oi.ptr, oi.count, oi.dtype),
        root or 0,
        op or 0,
        algorithm or 0,
        rank,
        size,
    )
    return xi, oi, count
