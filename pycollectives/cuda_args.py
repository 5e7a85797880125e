"""Argument checks of the CUDA collectives: the host path's checks (csrc/bindings.cpp) for GPU
arrays, raised as ValueError/TypeError before anything is queued."""

from __future__ import annotations

from pycollectives import arrays
from pycollectives.ops import ALGORITHMS

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
TREE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")
OP_NAMES = ("sum", "prod", "min", "max", "avg")


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


def _overlap(a: arrays.ArrayInfo, b: arrays.ArrayInfo) -> bool:
    return a.nbytes and b.nbytes and a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def check_call(collective, x, out, op, root, algorithm, rank, size, device):
    """Validates one call; returns (x info, out info, count) for the native layer."""
    fn = collective
    if root is not None and not 0 <= root < size:
        raise ValueError(f"{fn}: root {root} is out of range for {size} ranks")
    if algorithm not in (0, None):
        name = ALGORITHMS[algorithm - 1] if 1 <= algorithm <= len(ALGORITHMS) else None
        if name is None:
            raise ValueError(f"{fn}: unknown algorithm code {algorithm}")
        if name == "tree" and collective not in TREE_COLLECTIVES:
            raise ValueError(
                f"{fn}: algorithm tree is not available for {fn} (available: ring, direct)"
            )
    in_place = out is None
    if collective == "broadcast":
        xi = gpu_array(x, fn, "x", True, device)
        return xi, xi, xi.count
    xi = gpu_array(x, fn, "x", in_place and collective in ("all_reduce", "reduce"), device)
    oi = xi if in_place else gpu_array(out, fn, "out", True, device)
    if oi.dtype != xi.dtype:
        raise TypeError(
            f"{fn}: out has dtype {oi.dtype_name}, expected {xi.dtype_name} (the dtype of x)"
        )
    if collective in ("all_reduce", "reduce"):
        want, why, count, layout = xi.count, "the size of x", xi.count, oi.ptr == xi.ptr
        got, what = oi.count, "out"
    elif collective == "reduce_scatter":
        want, why, count = oi.count * size, "size * out.size", oi.count
        got, what, layout = xi.count, "x", oi.ptr == xi.ptr + rank * oi.nbytes
    else:  # all_gather
        want, why, count = xi.count * size, "size * x.size", xi.count
        got, what, layout = oi.count, "out", xi.ptr == oi.ptr + rank * xi.nbytes
    if got != want:
        raise ValueError(f"{fn}: {what} has {got} elements, expected {want} ({why})")
    if not layout and _overlap(xi, oi):
        raise ValueError(f"{fn}: x and out overlap without being the in-place layout")
    if op is not None:
        if not 0 <= op < len(OP_NAMES):
            raise ValueError(f"{fn}: unknown op {op}")
        if OP_NAMES[op] == "avg" and not xi.dtype_name.startswith(("float", "bfloat")):
            raise ValueError(
                f"{fn}: op avg is not supported for integer dtype {xi.dtype_name} "
                "(use sum and divide)"
            )
    return xi, oi, count
