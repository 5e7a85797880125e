"""The CUDA transport's host-side parts, which run without a GPU: import, availability, array
detection, argument checks, the device-sharing decision and planning."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import run_mpi

import pycollectives
from pycollectives import arrays
from pycollectives.cuda import (
    choose_device,
    choose_sync_mode,
    cuda_available,
    mps_active,
    sync_mode_override,
)
from pycollectives.cuda_args import check_call, gpu_array


class FakeCudaArray:
    """Just enough of ``__cuda_array_interface__`` to look like a device array."""

    def __init__(self, ptr, shape, typestr="<f4", strides=None, readonly=False, device=0, name=""):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, readonly),
            "strides": strides,
            "version": 3,
            "stream": 1,
        }
        self.device = device
        if name:
            self.dtype = type("D", (), {"name": name})()


def test_import_without_gpu():
    assert pycollectives.Communicator is not None
    ok, why = cuda_available()
    assert isinstance(ok, bool) and isinstance(why, str)
    if not ok:
        assert why and ("CUDA" in why or "cuda" in why), why


def test_native_module_imports_without_gpu():
    cu = pytest.importorskip("pycollectives._cuda")
    count, why = cu.device_count()
    assert count >= 0
    assert count > 0 or why  # no device: a reason, never an exception
    assert cu.pointer_device(0) == -1


def test_numpy_stays_on_host():
    a = np.arange(10, dtype=np.int32)
    info = arrays.describe(a)
    assert (info.ptr, info.count, info.dtype, info.is_cuda) == (a.ctypes.data, 10, 2, False)
    assert info.device == arrays.HOST and info.contiguous and not info.readonly
    assert not arrays.is_cuda_array(a)
    a.flags.writeable = False
    assert arrays.describe(a).readonly
    assert not arrays.describe(np.arange(10.0)[::2]).contiguous
    with pytest.raises(TypeError, match="must be a CUDA array"):
        gpu_array(np.zeros(3, np.float32), "all_reduce", "x", True, 0)


@pytest.mark.parametrize(
    "typestr,name,code",
    [("|i1", "int8", 0), ("|u1", "uint8", 1), ("<i4", "int32", 2), ("<i8", "int64", 3)]
    + [("<f2", "float16", 4), ("<f4", "float32", 6), ("<f8", "float64", 7)],
)
def test_cuda_array_interface(typestr, name, code):
    x = FakeCudaArray(0x7F0000001000, (3, 5), typestr, device=1, readonly=True)
    info = arrays.describe(x)
    assert (info.ptr, info.count, info.dtype_name, info.dtype) == (0x7F0000001000, 15, name, code)
    assert info.is_cuda and info.device == 1 and info.readonly and info.contiguous
    assert info.library == "cai" and info.stream == 1
    assert arrays.is_cuda_array(x)


def test_cuda_array_interface_layouts():
    # bfloat16 has no typestr of its own; the producer's dtype names it.
    assert arrays.describe(FakeCudaArray(256, (4,), "<V2", name="bfloat16")).dtype == 5
    assert arrays.describe(FakeCudaArray(256, (4,), "<V2")).dtype == -1
    # C-contiguous strides given explicitly, size-1 dims with any stride, empty arrays.
    assert arrays.describe(FakeCudaArray(256, (2, 3), strides=(12, 4))).contiguous
    assert arrays.describe(FakeCudaArray(256, (2, 1), strides=(4, 99))).contiguous
    assert arrays.describe(FakeCudaArray(0, (0, 3), strides=(4, 8))).contiguous
    strided = FakeCudaArray(256, (4,), strides=(8,))
    assert not arrays.describe(strided).contiguous
    with pytest.raises(ValueError, match="C-contiguous"):
        gpu_array(strided, "all_reduce", "x", True, 0)
    with pytest.raises(ValueError, match="Fortran|C-contiguous"):
        gpu_array(FakeCudaArray(256, (2, 3), strides=(4, 8)), "broadcast", "x", True, 0)


def test_gpu_array_refusals():
    with pytest.raises(ValueError, match="read-only"):
        gpu_array(FakeCudaArray(256, (4,), readonly=True), "broadcast", "x", True, 0)
    gpu_array(FakeCudaArray(256, (4,), readonly=True), "all_gather", "x", False, 0)
    with pytest.raises(ValueError, match="device 1, the communicator on device 0"):
        gpu_array(FakeCudaArray(256, (4,), device=1), "all_reduce", "x", True, 0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        gpu_array(FakeCudaArray(256, (4,), "<c8"), "all_reduce", "x", True, 0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        gpu_array(FakeCudaArray(256, (4,), ">f4"), "all_reduce", "x", True, 0)
    with pytest.raises(TypeError, match="expected a numpy, cupy or torch array"):
        gpu_array([1, 2, 3], "all_reduce", "x", True, 0)


class DLPackOnly:
    """An object that offers only DLPack (here over a numpy array: a CPU tensor)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_parsing():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    info = arrays.describe(DLPackOnly(a))
    assert (info.ptr, info.count, info.dtype_name, info.is_cuda) == (
        a.ctypes.data,
        12,
        "float64",
        False,
    )
    assert info.contiguous and info.library == "dlpack"
    info = arrays.describe(DLPackOnly(a[:, 1]))
    assert (info.ptr, info.count, info.contiguous) == (a.ctypes.data + 8, 3, False)
    assert arrays.describe(DLPackOnly(np.zeros(2, np.uint8))).dtype == 1
    assert not arrays.is_cuda_array(DLPackOnly(a))


def test_stream_handles():
    assert arrays.stream_handle(None) == 0
    assert arrays.stream_handle(7) == 7
    assert arrays.stream_handle(type("S", (), {"ptr": 42})()) == 42
    assert arrays.stream_handle(type("T", (), {"cuda_stream": 43})()) == 43
    with pytest.raises(TypeError):
        arrays.stream_handle("default")
    info = arrays.describe(FakeCudaArray(256, (4,)))
    assert arrays.current_stream(info) == 1  # the producer's stream from the interface


def arr(ptr, n, typestr="<f4", device=0):
    return FakeCudaArray(ptr, (n,), typestr, device=device)


def test_check_call():
    base = 1 << 20
    x, out = arr(base, 8), arr(base + 4096, 8)
    _, _, count = check_call("all_reduce", x, out, 0, None, 0, 0, 2, 0)
    assert count == 8
    check_call("all_reduce", x, None, 4, None, 1, 0, 2, 0)  # in place, avg, ring
    with pytest.raises(ValueError, match="out has 7 elements, expected 8"):
        check_call("all_reduce", x, arr(base + 4096, 7), 0, None, 0, 0, 2, 0)
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        check_call("all_reduce", x, arr(base + 4096, 8, "<f8"), 0, None, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="op avg is not supported for integer dtype int32"):
        check_call("all_reduce", arr(base, 8, "<i4"), None, 4, None, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="overlap"):
        check_call("all_reduce", x, arr(base + 4, 8), 0, None, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="tree is not available for all_gather"):
        check_call("all_gather", x, arr(base + 4096, 16), None, None, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="root 2 is out of range for 2 ranks"):
        check_call("broadcast", x, None, None, 2, 0, 0, 2, 0)
    # reduce_scatter: x holds size * out.size; in place when out is x's block of this rank.
    _, _, count = check_call("reduce_scatter", arr(base, 8), arr(base + 16, 4), 0, None, 0, 1, 2, 0)
    assert count == 4
    with pytest.raises(ValueError, match="x has 8 elements, expected 6"):
        check_call("reduce_scatter", arr(base, 8), arr(base + 4096, 3), 0, None, 0, 0, 2, 0)
    # all_gather: out holds size * x.size; in place when x is out's block of this rank.
    _, _, count = check_call("all_gather", arr(base + 16, 4), arr(base, 8), None, None, 0, 1, 2, 0)
    assert count == 4
    with pytest.raises(ValueError, match="device 1"):
        check_call(
            "all_gather", arr(base, 4, device=1), arr(base + 4096, 8), None, None, 0, 0, 2, 0
        )


def test_sync_mode_decision():
    a, b = b"\x01" * 16, b"\x02" * 16
    assert choose_sync_mode([a, b], [False, False]) == "kernel"  # a GPU each
    assert choose_sync_mode([a, a], [False, False]) == "host"  # time-sliced GPU
    assert choose_sync_mode([a, a, b], [False, False, False]) == "host"
    assert choose_sync_mode([a, a], [True, True]) == "kernel"  # MPS runs them side by side
    assert choose_sync_mode([a, a], [True, False]) == "host"
    assert choose_sync_mode([a, a], [False, False], ["kernel", "kernel"]) == "kernel"
    assert choose_sync_mode([a, b], [False, False], ["host", "host"]) == "host"
    with pytest.raises(ValueError, match="disagree"):
        choose_sync_mode([a, b], [False, False], ["host", None])
    assert sync_mode_override({}) is None
    assert sync_mode_override({"PYCOLL_CUDA_SYNC": "Host"}) == "host"
    assert sync_mode_override({"PYCOLL_CUDA_SYNC": "auto"}) is None
    with pytest.raises(ValueError, match="PYCOLL_CUDA_SYNC"):
        sync_mode_override({"PYCOLL_CUDA_SYNC": "spin"})


def test_mps_detection(tmp_path):
    assert not mps_active({}, default_pipe=str(tmp_path / "none"))
    (tmp_path / "control").touch()
    assert mps_active({}, default_pipe=str(tmp_path))
    assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, default_pipe="/nonexistent")
    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "x")}, default_pipe="/")


def test_device_choice():
    assert choose_device(None, 5, 2, {}) == 1  # local_rank % device_count
    assert choose_device(None, 3, 1, {}) == 0  # several ranks, one GPU
    assert choose_device(None, 0, 4, {"PYCOLL_DEVICE": "3"}) == 3
    assert choose_device(2, 0, 4, {"PYCOLL_DEVICE": "3"}) == 2
    with pytest.raises(ValueError, match="does not exist"):
        choose_device(4, 0, 4, {})
    with pytest.raises(ValueError, match="PYCOLL_DEVICE"):
        choose_device(None, 0, 4, {"PYCOLL_DEVICE": "gpu0"})


def test_communicator_setup_fails_cleanly_without_gpu():
    ok, _ = cuda_available()
    if ok:
        pytest.skip("a GPU is present")
    out = run_mpi(2, "cuda_nogpu.py", timeout=120)
    assert out.count("PASS cuda_nogpu") == 2


@pytest.mark.parametrize("case", ["nogpu", "mixed", "badinput"])
def test_communicator_with_cuda_arrays_without_gpu(case):
    if cuda_available()[0]:
        pytest.skip("a GPU is present: the GPU suite covers this")
    out = run_mpi(3, "gpu_dispatch.py", case, timeout=120)
    assert out.count(f"PASS {case}") == 3, out


def test_communicator_over_nodes_refuses_cuda_arrays():
    out = run_mpi(4, "gpu_dispatch.py", "nodes", env={"PYCOLL_RANKS_PER_NODE": "2"}, timeout=120)
    assert out.count("PASS nodes") == 4, out
