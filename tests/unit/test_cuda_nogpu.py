"""The CUDA transport's host-side parts in one process, without a GPU: import, array
descriptions (CUDA array interface, DLPack), refusals, streams, the call checks, the sync mode
and device choices, the GPU suite's MPS daemon."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import types

import numpy as np
import pytest
from harness.launch import fake_tool

import pycollectives
from pycollectives import ops
from pycollectives.backends import Call
from pycollectives.backends.cuda import args as cuda_args
from pycollectives.backends.cuda import (
    arrays_device,
    choose_device,
    choose_sync_mode,
    cuda_available,
    mps_active,
)
from pycollectives.backends.cuda.args import gpu_array
from pycollectives.options import Options
from pycollectives.runtime import arrays


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


class FakeCupy:
    """A module named cupy whose ndarray has cupy's own attributes (data.ptr, data.device_id,
    size, dtype, flags.c_contiguous) and the interface they stand for."""

    class ndarray:  # noqa: N801 (cupy's name)
        def __init__(self, ptr, shape, dtype, device=0, contiguous=True, old=False):
            count = int(np.prod(shape))
            self.data = types.SimpleNamespace(ptr=ptr, device=types.SimpleNamespace(id=device))
            if not old:  # cupy before MemoryPointer.device_id has .device.id alone
                self.data.device_id = device
            self.size, self.dtype = count, np.dtype(dtype)
            self.flags = types.SimpleNamespace(c_contiguous=contiguous)
            self.device = types.SimpleNamespace(id=device)
            strides = None if contiguous else tuple(2 * self.dtype.itemsize for _ in shape)
            self.__cuda_array_interface__ = {
                "shape": shape, "typestr": self.dtype.str, "data": (ptr, False),
                "strides": strides, "version": 3, "stream": 1,
            }  # fmt: skip


@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64", "float16", "float32",
                                   "float64", "complex64"])  # fmt: skip
def test_cupy_arrays_described_from_their_attributes(monkeypatch, dtype, old):
    """cupy arrays skip the interface's dict, and are described as through it."""
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    for contiguous in (True, False):
        a = FakeCupy.ndarray(0x7F0000001000 + 64, (3, 5), dtype, 1, contiguous, old)
        info = arrays.describe(a)
        ref = arrays._from_cai(a, a.__cuda_array_interface__)
        if dtype == "complex64":  # unsupported either way; named as numpy names it
            assert info.dtype == ref.dtype == -1 and info.dtype_name == "complex64"
            ref = ref._replace(dtype_name="complex64")
        assert info._replace(stream=None) == ref._replace(stream=None, library="cupy")
        assert (info.ptr, info.count, info.device, info.library) == (a.data.ptr, 15, 1, "cupy")
        assert info.contiguous == contiguous and arrays.is_cuda_array(a)
    # uint16 and bfloat16 as uint16 bits (a tag in the dtype's metadata) compare equal as
    # dtypes: each is still named as it is, whichever came first.
    for dt, name in [(np.uint16, "uint16"), (arrays.BFLOAT16_BITS, "bfloat16"),
                     (np.uint16, "uint16")]:  # fmt: skip
        assert arrays.describe(FakeCupy.ndarray(4096, (4,), dt)).dtype_name == name
    # A cupy whose arrays lack these attributes: the interface describes them.
    bare = FakeCupy.ndarray(4096, (4,), "float32")
    del bare.data
    assert arrays.describe(bare).ptr == 4096 and arrays.describe(bare).count == 4


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


def check_args(collective, x, out, op, root, algorithm, rank, size, device):
    call = Call(collective, x, out, op or 0, root or 0, algorithm)
    return cuda_args.check_args(call, rank, size, device)


def test_check_args():
    base = 1 << 20
    x, out = arr(base, 8), arr(base + 4096, 8)
    count = check_args("all_reduce", x, out, 0, None, 0, 0, 2, 0)
    assert count == 8
    check_args("all_reduce", x, None, 4, None, 1, 0, 2, 0)  # in place, avg, ring
    with pytest.raises(ValueError, match="out has 7 elements, expected 8"):
        check_args("all_reduce", x, arr(base + 4096, 7), 0, None, 0, 0, 2, 0)
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        check_args("all_reduce", x, arr(base + 4096, 8, "<f8"), 0, None, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="op avg is not supported for integer dtype int32"):
        check_args("all_reduce", arr(base, 8, "<i4"), None, 4, None, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="overlap"):
        check_args("all_reduce", x, arr(base + 4, 8), 0, None, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="tree is not available for all_gather"):
        check_args("all_gather", x, arr(base + 4096, 16), None, None, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="root 2 is out of range for 2 ranks"):
        check_args("broadcast", x, None, None, 2, 0, 0, 2, 0)
    # reduce_scatter: x holds size * out.size; in place when out is x's block of this rank.
    count = check_args("reduce_scatter", arr(base, 8), arr(base + 16, 4), 0, None, 0, 1, 2, 0)
    assert count == 4
    with pytest.raises(ValueError, match="x has 8 elements, expected 6"):
        check_args("reduce_scatter", arr(base, 8), arr(base + 4096, 3), 0, None, 0, 0, 2, 0)
    # all_gather: out holds size * x.size; in place when x is out's block of this rank.
    count = check_args("all_gather", arr(base + 16, 4), arr(base, 8), None, None, 0, 1, 2, 0)
    assert count == 4
    with pytest.raises(ValueError, match="device 1"):
        check_args(
            "all_gather", arr(base, 4, device=1), arr(base + 4096, 8), None, None, 0, 0, 2, 0
        )


def test_sync_mode_decision():
    a, b = b"\x01" * 16, b"\x02" * 16
    assert choose_sync_mode([a, b], [False, False]) == "kernel"  # a GPU each
    assert choose_sync_mode([a, a], [False, False]) == "stepped"  # time-sliced GPU
    assert choose_sync_mode([a, a, b], [False, False, False]) == "stepped"
    assert choose_sync_mode([a, a], [True, True]) == "kernel"  # MPS runs them side by side
    assert choose_sync_mode([a, a], [True, False]) == "stepped"
    assert choose_sync_mode([a, a], [False, False], ["kernel", "kernel"]) == "kernel"
    assert choose_sync_mode([a, b], [False, False], ["stepped", "stepped"]) == "stepped"
    with pytest.raises(ValueError, match="disagree"):
        choose_sync_mode([a, b], [False, False], ["stepped", None])
    assert Options.resolve(environ={}).cuda_sync is None
    assert Options.resolve(environ={"PYCOLL_CUDA_SYNC": "Stepped"}).cuda_sync == "stepped"
    assert Options.resolve(environ={"PYCOLL_CUDA_SYNC": "auto"}).cuda_sync is None
    with pytest.raises(ValueError, match="PYCOLL_CUDA_SYNC"):
        Options.resolve(environ={"PYCOLL_CUDA_SYNC": "spin"})
    # "host" names host memory only: the GPU's stepped mode under its old names is refused
    # with the new one, not read as something else or ignored.
    renamed = [({"PYCOLL_CUDA_SYNC": "host"}, "PYCOLL_CUDA_SYNC=stepped"),
               ({"PYCOLL_CUDA_HOST_TWOSHOT": "0"}, "PYCOLL_CUDA_STEPPED_TWOSHOT"),
               ({"PYCOLL_CUDA_HOST_EVENTS": "0"}, "PYCOLL_CUDA_STEPPED_EVENTS")]  # fmt: skip
    for environ, new in renamed:
        with pytest.raises(ValueError, match=f"is now {new}"):
            Options.resolve(environ=environ)
    assert not Options.resolve(environ={"PYCOLL_CUDA_STEPPED_EVENTS": "0"}).cuda_stepped_events


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


def test_device_from_the_arrays():
    # Without device= or PYCOLL_DEVICE, the arrays' device, whatever the local rank.
    assert choose_device(None, 0, 2, {}, arrays_device=1) == 1
    assert choose_device(None, 1, 2, {}, arrays_device=0) == 0
    assert choose_device(None, 1, 2, {}, arrays_device=None) == 1  # nothing to go by
    assert choose_device(None, 0, 2, {"PYCOLL_DEVICE": "1"}, arrays_device=1) == 1
    with pytest.raises(ValueError, match="arrays are on CUDA device 1, but PYCOLL_DEVICE=0 chose"):
        choose_device(None, 1, 2, {"PYCOLL_DEVICE": "0"}, arrays_device=1)
    with pytest.raises(ValueError, match="arrays are on CUDA device 0, but device=1 chose"):
        choose_device(1, 0, 2, {}, arrays_device=0)
    with pytest.raises(ValueError, match="device 3 .the arrays. does not exist"):
        choose_device(None, 0, 2, {}, arrays_device=3)


def test_arrays_device():
    assert arrays_device((arr(256, 4, device=1), None)) == 1
    assert arrays_device((arr(256, 4, device=1), arr(4096, 4, device=1))) == 1
    assert arrays_device((None, None)) is None
    with pytest.raises(ValueError, match="x on device 0, out on device 1"):
        arrays_device((arr(256, 4, device=0), arr(4096, 4, device=1)))


def _test_gpu():
    """tests/gpu/test_gpu.py, which must import without a GPU (its helpers are tested here)."""
    try:
        from gpu import test_gpu
    except pytest.skip.Exception as e:
        pytest.fail(f"tests/gpu/test_gpu.py skips at import: {e}")
    return test_gpu


FAKE_MPS = """pipe="$CUDA_MPS_PIPE_DIRECTORY"
case "$1" in
  -d)
    [ -n "$FAKE_MPS_FAIL" ] && { echo "cannot start" >&2; exit 1; }
    ( : > "$pipe/control"
      while [ ! -e "$pipe/quit" ] || [ -n "$FAKE_MPS_STUBBORN" ]; do sleep 0.05; done
      rm -f "$pipe/control" ) </dev/null >/dev/null 2>&1 &
    exit 0;;
esac
read cmd
[ "$cmd" = quit ] && : > "$pipe/quit"
"""


@pytest.mark.parametrize("kind", ["obedient", "stubborn"])
def test_gpu_suite_starts_and_stops_its_mps_daemon(kind, tmp_path, monkeypatch):
    test_gpu = _test_gpu()
    exe = str(fake_tool(tmp_path, "nvidia-cuda-mps-control", FAKE_MPS))
    if kind == "stubborn":  # ignores quit: stopped by signal, still within the bound
        monkeypatch.setenv("FAKE_MPS_STUBBORN", "1")
    t0 = time.monotonic()
    env = test_gpu.start_mps(exe, seconds=5)
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    try:
        assert os.path.exists(os.path.join(pipe, "control"))
        assert mps_active(env) and os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
        assert test_gpu.mps_processes(pipe), "the daemon is not found by its pipe directory"
    finally:
        test_gpu.stop_mps(exe, env, seconds=2)
    assert not test_gpu.mps_processes(pipe)
    assert not os.path.exists(os.path.dirname(pipe))
    assert time.monotonic() - t0 < 15


def test_gpu_suite_mps_daemon_that_does_not_start(tmp_path, monkeypatch):
    test_gpu = _test_gpu()
    exe = str(fake_tool(tmp_path, "nvidia-cuda-mps-control", FAKE_MPS))
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(RuntimeError, match="did not start an MPS daemon.*cannot start"):
        test_gpu.start_mps(exe, seconds=2)
    left = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("pycoll-mps-")}
    assert not left - before, left - before


def test_oneshot_limit_reaches_the_cuda_transport():
    # PYCOLL_ONESHOT_BYTES moves the direct all-reduce's one-shot/two-shot switch on both paths.
    cu = pytest.importorskip("pycollectives._cuda")

    def cuda_opts(env):
        return Options.resolve(timeout=30.0, environ=env).cuda_options(cu)

    def host_opts(env):
        return Options.resolve(timeout=30.0, environ=env).host_options()

    default = cuda_opts({}).oneshot_max_bytes
    assert cuda_opts({"PYCOLL_ONESHOT_BYTES": "0"}).oneshot_max_bytes == 0
    assert cuda_opts({"PYCOLL_ONESHOT_BYTES": "4096"}).oneshot_max_bytes == 4096
    assert host_opts({"PYCOLL_ONESHOT_BYTES": "4096"}).oneshot_max_bytes == 4096
    opts = cuda_opts({"PYCOLL_CUDA_BLOCKS": "3"})
    assert opts.nblocks == 3 and opts.oneshot_max_bytes == default and opts.timeout == 30.0


def test_ll_limit_reaches_the_cuda_transport():
    # PYCOLL_CUDA_LL_BYTES sets the LL format's limit (0: off); the default is the native one.
    cu = pytest.importorskip("pycollectives._cuda")

    def cuda_opts(env):
        return Options.resolve(timeout=30.0, environ=env).cuda_options(cu)

    assert cuda_opts({}).ll_max_bytes == cu.CudaCommOptions().ll_max_bytes == cu.LL_MAX_BYTES
    assert cuda_opts({"PYCOLL_CUDA_LL_BYTES": "0"}).ll_max_bytes == 0
    assert cuda_opts({"PYCOLL_CUDA_LL_BYTES": "4096"}).ll_max_bytes == 4096
    with pytest.raises(ValueError, match="PYCOLL_CUDA_LL_BYTES"):
        cuda_opts({"PYCOLL_CUDA_LL_BYTES": "-1"})
    with pytest.raises(ValueError, match="PYCOLL_CUDA_LL_BYTES"):
        cuda_opts({"PYCOLL_CUDA_LL_BYTES": "lots"})


def test_register_size_reaches_the_cuda_transport():
    # PYCOLL_CUDA_REGISTER_BYTES: registration on first use from this size (0, the default and
    # the native one: off until measured on a GPU).
    cu = pytest.importorskip("pycollectives._cuda")

    def size(env):
        return Options.resolve(timeout=30.0, environ=env).cuda_options(cu).register_on_use_bytes

    assert size({}) == cu.CudaCommOptions().register_on_use_bytes == 0
    assert size({"PYCOLL_CUDA_REGISTER_BYTES": str(1 << 20)}) == 1 << 20
    with pytest.raises(ValueError, match="PYCOLL_CUDA_REGISTER_BYTES"):
        size({"PYCOLL_CUDA_REGISTER_BYTES": "-1"})


def test_auto_block_count_splits_the_gpu_among_its_ranks():
    # PYCOLL_CUDA_BLOCKS=auto: a block per SM of the ranks' share of the GPU, 1 to 64. Worked by
    # hand: an H100 SXM has 132 SMs; 2 ranks on it get 66 each, capped at 64; 4 get 33; 8
    # get 16 (132 // 8 = 16.5); an A100 (108 SMs) shared by 4 gets 27; 200 ranks still get 1.
    from pycollectives.options import auto_cuda_blocks

    cases = {(132, 1): 64, (132, 2): 64, (132, 4): 33, (132, 8): 16, (108, 4): 27, (108, 200): 1}
    assert {k: auto_cuda_blocks(*k) for k in cases} == cases


def test_auto_block_count_reaches_the_cuda_transport():
    # "auto" asks the device for its SM count (here a stand-in module that has one) unless the
    # residency check chose the blocks; a bad value names the variable before anything is made.
    cu = pytest.importorskip("pycollectives._cuda")

    class FakeNative:
        CudaCommOptions = cu.CudaCommOptions

        @staticmethod
        def sm_count(device):
            return {0: 132, 1: 40}[device]

    def nblocks(env, device=0, blocks=None):
        return (
            Options.resolve(timeout=30.0, environ=env)
            .cuda_options(FakeNative, device, blocks)
            .nblocks
        )

    assert nblocks({"PYCOLL_CUDA_BLOCKS": "auto"}, 0) == 64
    assert nblocks({"PYCOLL_CUDA_BLOCKS": "AUTO"}, 1) == 40
    assert nblocks({"PYCOLL_CUDA_BLOCKS": "auto"}, 0, blocks=33) == 33
    assert nblocks({"PYCOLL_CUDA_BLOCKS": "5"}, 1) == 5
    assert nblocks({}, 0) == cu.CudaCommOptions().nblocks == 16
    for bad in ("0", "129", "many"):
        with pytest.raises(ValueError, match="PYCOLL_CUDA_BLOCKS"):
            nblocks({"PYCOLL_CUDA_BLOCKS": bad})


def test_residency_fits_every_ranks_launch_on_its_gpu():
    # Worked by hand. An H100 SXM: 132 SMs, one block of the step kernel per SM.
    from pycollectives.backends.cuda.residency import GpuShare, mps_sm_limit, plan_residency

    def gpus(*ranks_per_gpu, sms=132, per_sm=1, limit=None):
        return [
            GpuShare(bytes([g]) * 16, sms, per_sm, limit or sms)
            for g, n in enumerate(ranks_per_gpu)
            for _ in range(n)
        ]

    # One rank per GPU: 16 fit (132 >= 16); auto takes 64 (the cap), not 132.
    r = plan_residency(gpus(1, 1), 16, "kernel")
    assert (r.mode, r.blocks, r.why) == ("kernel", 16, "")
    assert plan_residency(gpus(1, 1), 0, "kernel").blocks == 64
    # 8 ranks under MPS on one GPU: 132 // 8 = 16 each, so the default 16 fit and 17 do not.
    assert plan_residency(gpus(8), 16, "kernel").blocks == 16
    r = plan_residency(gpus(8), 17, "kernel")
    assert (r.mode, r.blocks) == ("kernel", 16)
    assert "16 blocks per launch instead of PYCOLL_CUDA_BLOCKS=17" in r.why
    assert "8 ranks share GPU-" in r.why and "132 SMs" in r.why, r.why
    # auto counts the ranks on each GPU from their UUIDs, not node size / GPUs: 4 ranks on GPU
    # 0 and 1 on GPU 1 get 132 // 4 = 33, where 5 ranks over 2 GPUs would have said 66 -> 64.
    assert plan_residency(gpus(4, 1), 0, "kernel").blocks == 33
    # 128 requested on a 108-SM GPU with a rank of its own: 108.
    assert plan_residency(gpus(1, sms=108), 128, "kernel").blocks == 108
    # Two blocks per SM double the room: 8 ranks on 132 SMs, 264 // 8 = 33.
    assert plan_residency(gpus(8, per_sm=2), 0, "kernel").blocks == 33
    # MPS at 25%: each process may use 33 of the 132 SMs, whatever the others do.
    assert mps_sm_limit(132, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}) == 33
    assert mps_sm_limit(132, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "x"}) == 132
    r = plan_residency(gpus(2, limit=33), 64, "kernel")
    assert (r.blocks, "33 SMs per process under MPS" in r.why) == (33, True), r
    # More ranks than SMs: not one block of each fits: stepped mode, and it says so.
    r = plan_residency(gpus(140), 4, "kernel")
    assert (r.mode, r.blocks) == ("stepped", 4) and "stepped mode instead of kernel mode" in r.why
    # A kernel that no SM can hold.
    assert plan_residency(gpus(1, per_sm=0), 0, "kernel").mode == "stepped"
    # Stepped mode keeps any request: its launches never wait for another process.
    r = plan_residency(gpus(8), 128, "stepped")
    assert (r.mode, r.blocks, r.why) == ("stepped", 128, "")
    assert plan_residency(gpus(8), 0, "stepped").blocks == 16


@pytest.mark.parametrize(
    "variable, field, default",
    [
        ("PYCOLL_CUDA_STEPPED_TWOSHOT", "stepped_twoshot", True),  # stepped mode through scratch
        ("PYCOLL_CUDA_STEPPED_EVENTS", "stepped_events", True),  # stepped mode's fences on events
        ("PYCOLL_CUDA_LOOKAHEAD", "lookahead", False),  # two ring messages in flight
        ("PYCOLL_CUDA_PUSH", "push", False),  # messages by writes into the receiver's memory
        ("PYCOLL_CUDA_COPY_ENGINES", "copy_engines", False),  # registered moves by copies
    ],
)
def test_switches_reach_the_cuda_transport(variable, field, default):
    # Each switch's default is the transport's own; 0/1 and off/on set it; a bad value names
    # the variable and its choices.
    cu = pytest.importorskip("pycollectives._cuda")

    def switch(env):
        return getattr(Options.resolve(timeout=30.0, environ=env).cuda_options(cu), field)

    assert switch({}) is default and getattr(cu.CudaCommOptions(), field) is default
    assert switch({variable: "0"}) is False and switch({variable: "off"}) is False
    assert switch({variable: "1"}) is True and switch({variable: "on"}) is True
    with pytest.raises(ValueError, match=variable):
        switch({variable: "maybe"})


def test_lookahead_plans():
    # With PYCOLL_CUDA_LOOKAHEAD the ring all-reduce's plan sends the next piece's first
    # message before this piece's last receive (two messages in flight per channel), and holds
    # the same messages in another order.
    cu = pytest.importorskip("pycollectives._cuda")
    # 2 ranks, float32 (dtype code 6), 4 KiB slots: a shard of 3072 elements in 3 pieces.
    kw = dict(collective=0, algorithm=ops.algo_code("ring"), rank=0, size=2, count=6144,
              root=0, dtype=6, slot_bytes=4096)  # fmt: skip
    plain = cu.plan(**kw)["steps"]
    ahead = cu.plan(**kw, lookahead=True)["steps"]
    assert sorted(plain) == sorted(ahead) and plain != ahead
    # Rank 0's shard goes in three pieces; a piece is a send, a receive that reduces and
    # forwards, and a receive. Plain: each piece whole in turn. Lookahead: the first piece's
    # send, then for each piece its reduce-and-forward, the next piece's send, its receive.
    rrcs = "recv_reduce_copy_send"
    assert [s[0] for s in plain] == ["send", rrcs, "recv"] * 3, plain
    want = ["send", rrcs, "send", "recv", rrcs, "send", "recv", rrcs, "recv"]
    assert [s[0] for s in ahead] == want, ahead


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
               "all_to_all", "gather", "scatter")  # fmt: skip


@pytest.mark.parametrize("name", COLLECTIVES)
def test_cuda_collectives_take_the_communicators_arguments(name):
    # One order on every public collective: the same names, kinds and defaults, with async_op
    # and stream by keyword only, so that a call written for one can never hand the other a
    # stream as async_op (they were (stream, async_op) on CudaComm, the reverse here).
    import inspect

    from pycollectives.backends.cuda.comm import CudaComm

    def params(cls, drop=()):
        sig = inspect.signature(getattr(cls, name))
        return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name not in drop]

    ours = params(pycollectives.Communicator, drop=("reproducible",))
    assert params(CudaComm) == ours
    keyword_only = [n for n, kind, _ in ours if kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["async_op", "stream"]
