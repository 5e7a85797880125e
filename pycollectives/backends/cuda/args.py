"""Argument checks of the CUDA collectives: the host path's checks
(csrc/python/call_args.cpp) for GPU arrays, raised as ValueError/TypeError before anything is
queued."""

from __future__ import annotations

from pycollectives import _C
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


def given_lists(counts=None, in_splits=None, out_splits=None) -> dict:
    """The per-rank lists of a call as keywords, those given only: the even form passes none
    (each keyword costs a native call 2 us, even as None)."""
    if counts is None and in_splits is None and out_splits is None:
        return {}
    lists = {"counts": counts, "in_splits": in_splits, "out_splits": out_splits}
    return {k: v for k, v in lists.items() if v is not None}


def check_call(
    collective, x, out, op, root, algorithm, rank, size, device, *, counts=None, in_splits=None,
    out_splits=None,
):  # fmt: skip
    """Validates one call; returns (x info, out info, count) for the native layer. The arrays
    are described here; the collective's own checks (sizes, dtypes, overlap, op, root,
    algorithm, per-rank counts and splits) are the host path's (``_C.check_described_args``).

    An array the rank does not use may be None: gather's `out` and scatter's `x` off the root.
    Its info is then that of the other array, with pointer 0 and no elements."""
    fn = collective
    off_root = rank != (root or 0)
    absent_x = x is None and collective == "scatter" and off_root
    absent_out = out is None and collective == "gather" and off_root
    # Otherwise a missing `out` is the single-array form (in place), checked as such.
    single = collective == "broadcast" or (out is None and not (absent_out or absent_x))
    written = collective == "broadcast" or (out is None and collective in ("all_reduce", "reduce"))
    xi = None if absent_x else gpu_array(x, fn, "x", written, device)
    oi = xi if single else (None if absent_out else gpu_array(out, fn, "out", True, device))
    count = _C.check_described_args(
        collective,
        None if xi is None else (xi.ptr, xi.count, xi.dtype),
        None if oi is None or oi is xi else (oi.ptr, oi.count, oi.dtype),
        root or 0,
        op or 0,
        algorithm or 0,
        rank,
        size,
        **given_lists(counts, in_splits, out_splits),
    )
    # Past the checks, at least one array is there (the native layer sees pointer 0 for the
    # one that is not, and never touches it: call_extents gives it no elements).
    if xi is None:
        xi = oi._replace(ptr=0, count=0)
    if oi is None:
        oi = xi._replace(ptr=0, count=0)
    return xi, oi, count
