"""Argument checks of the CUDA collectives: GPU arrays described and checked here, then the
host path's checks of the collective (csrc/python/call_args.cpp) in the native call itself,
raised as ValueError/TypeError before anything is queued."""

from __future__ import annotations

from pycollectives.runtime import arrays


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


def described(collective, x, out, root, rank, device):
    """The arrays of one call as the native layer takes them: ``(pointer, count, dtype code)``
    each, or None for one the call does not take (`out` in the single-array forms, gather's
    `out` and scatter's `x` off the root); and the info of an array that is there (its library
    and stream). Each array is checked here (a CUDA array, dtype, layout, writability, device);
    the collective's own checks (sizes, dtypes, overlap, op, root, algorithm, per-rank counts
    and splits) are the host path's, run by the native layer (``_cuda.CudaComm.run``, or
    ``_cuda.check_args`` before a communicator exists)."""
    fn = collective
    off_root = rank != (root or 0)
    absent_x = x is None and collective == "scatter" and off_root
    absent_out = out is None and collective == "gather" and off_root
    # Otherwise a missing `out` is the single-array form (in place), checked as such.
    single = collective == "broadcast" or (out is None and not (absent_out or absent_x))
    written = collective == "broadcast" or (out is None and collective in ("all_reduce", "reduce"))
    xi = None if absent_x else gpu_array(x, fn, "x", written, device)
    oi = None if single or absent_out else gpu_array(out, fn, "out", True, device)
    xd = None if xi is None else (xi.ptr, xi.count, xi.dtype)
    od = None if oi is None else (oi.ptr, oi.count, oi.dtype)
    return xd, od, xi if xi is not None else oi


def check_args(call, rank, size, device=None):
    """Validates a ``backends.Call`` before a communicator exists, as ``CudaComm.run`` will;
    returns its count, or None when pycollectives was built without CUDA (the communicator's
    set-up then says so on every rank)."""
    xd, od, _ = described(call.collective, call.x, call.out, call.root, rank, device)
    try:
        from pycollectives import _cuda
    except ImportError:
        return None
    return _cuda.check_args(call, xd, od, rank, size)
