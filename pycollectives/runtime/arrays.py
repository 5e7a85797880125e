"""What an array is, wherever it lives: numpy, cupy, torch, ``__cuda_array_interface__``, DLPack.

``describe(obj)`` returns an :class:`ArrayInfo` (pointer, element count, dtype code, device,
contiguity, read-only) without importing cupy or torch unless `obj` is one of theirs (then the
library is loaded already). numpy arrays stay on the host path; everything else that lives on a
CUDA device goes to the CUDA transport.

Example::

    info = describe(cupy.arange(4, dtype=cupy.float32))
    info.is_cuda, info.count, info.dtype_name    # (True, 4, "float32")
"""

from __future__ import annotations

import ctypes
import math
import sys
from typing import NamedTuple

import numpy as np

from pycollectives import _C
from pycollectives.ops import DTYPES

# Native dtype codes, from the core.
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
DTYPE_SIZES = dict(zip(DTYPES, _C.DTYPE_SIZES))
SUPPORTED = ", ".join(DTYPES) + " in native byte order"

HOST = -1  # `device` of host memory

# bfloat16 with numpy alone: the bit patterns as uint16, tagged so that every layer reads them
# as bfloat16 (the native one too). torch's bfloat16 tensors are seen this way, so they need
# no ml_dtypes; numpy arithmetic on such an array would be integer arithmetic, and none is done.
BFLOAT16_BITS = np.dtype(np.uint16, metadata={"pycollectives": "bfloat16"})


def is_bfloat16(dt: np.dtype) -> bool:
    """Whether a numpy dtype holds bfloat16: ml_dtypes' or BFLOAT16_BITS."""
    return dt.name == "bfloat16" or (dt.metadata or {}).get("pycollectives") == "bfloat16"


class ArrayInfo(NamedTuple):
    """One array, as the collectives see it. A tuple: made on every GPU call, and a tuple is
    made in a fraction of a frozen dataclass's time (0.2 against 2 us)."""

    ptr: int
    count: int
    dtype_name: str  # numpy-style name, or the producer's own name when unsupported
    device: int | None  # CUDA ordinal, HOST, or None when it cannot be told
    is_cuda: bool
    contiguous: bool
    readonly: bool
    library: str  # "numpy", "cupy", "torch", "cai" or "dlpack"
    stream: int | None = None  # the producer's stream (``__cuda_array_interface__`` v3)

    @property
    def dtype(self) -> int:
        """Native dtype code, or -1 when the dtype is not supported."""
        return DTYPE_CODES.get(self.dtype_name, -1)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES.get(self.dtype_name, 0)

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


def _count(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _c_contiguous(shape, strides, itemsize) -> bool:
    """Whether byte `strides` describe a C-contiguous layout (dims of size 1 never matter)."""
    if strides is None or _count(shape) == 0:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _numpy_dtype_name(dt: np.dtype) -> str:
    if dt.byteorder == ">":
        return f"{dt.name} (big-endian)"
    return "bfloat16" if is_bfloat16(dt) else dt.name


_TYPESTR = {"i1": "int8", "u1": "uint8", "i4": "int32", "i8": "int64", "f2": "float16"}
_TYPESTR.update({"f4": "float32", "f8": "float64"})


def _typestr_name(typestr: str, obj) -> str:
    order, code = typestr[0], typestr[1:]
    if order == ">" and code not in ("i1", "u1"):
        return f"{typestr} (big-endian)"
    if code in _TYPESTR:
        return _TYPESTR[code]
    # bfloat16 has no typestr of its own ("<V2"); its producer names it.
    name = str(getattr(getattr(obj, "dtype", None), "name", ""))
    return "bfloat16" if code == "V2" and name == "bfloat16" else typestr


def _device_attr(obj) -> int | None:
    dev = getattr(obj, "device", None)
    if isinstance(dev, int):
        return dev
    for attr in ("id", "index"):  # cupy.cuda.Device.id, torch.device.index
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    return None


def _pointer_device(ptr: int) -> int | None:
    try:
        from pycollectives import _cuda
    except ImportError:
        return None
    dev = _cuda.pointer_device(ptr)
    return None if dev < 0 else dev


def _from_numpy(a: np.ndarray) -> ArrayInfo:
    return ArrayInfo(
        ptr=a.__array_interface__["data"][0],
        count=int(a.size),
        dtype_name=_numpy_dtype_name(a.dtype),
        device=HOST,
        is_cuda=False,
        contiguous=bool(a.flags.c_contiguous),
        readonly=not a.flags.writeable,
        library="numpy",
    )


def _from_torch(t) -> ArrayInfo:
    return ArrayInfo(
        ptr=int(t.data_ptr()),
        count=int(t.numel()),
        dtype_name=str(t.dtype).replace("torch.", ""),
        device=t.device.index if t.is_cuda else HOST,
        is_cuda=bool(t.is_cuda),
        contiguous=bool(t.is_contiguous()),
        readonly=False,
        library="torch",
    )


# typestr -> dtype name for the common cases: a dictionary lookup instead of parsing.
_CAI_NAMES = {f"<{code}": name for code, name in _TYPESTR.items()}
_CAI_NAMES.update({"|i1": "int8", "|u1": "uint8"})


def _from_cai(obj, cai: dict) -> ArrayInfo:
    shape = cai["shape"]
    ptr, readonly = cai["data"]
    typestr = cai["typestr"]
    name = _CAI_NAMES.get(typestr) or _typestr_name(typestr, obj)
    strides = cai.get("strides")
    if strides is None:  # C-contiguous by the interface's definition
        contiguous = True
    else:
        itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 0
        contiguous = _c_contiguous(shape, strides, itemsize)
    library = "cupy" if type(obj).__module__.partition(".")[0] == "cupy" else "cai"
    device = _device_attr(obj)
    if device is None and ptr:
        device = _pointer_device(ptr)
    return ArrayInfo(
        int(ptr or 0), int(math.prod(shape)), name, device, True, contiguous, bool(readonly),
        library, cai.get("stream"),
    )  # fmt: skip


# DLPack (v0.x ABI, the "dltensor" capsule every producer still offers).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
_DL_CODES = {0: "int", 1: "uint", 2: "float", 4: "bfloat"}


def _from_dlpack(obj) -> ArrayInfo:
    dev_type, dev_id = obj.__dlpack_device__()
    is_cuda = dev_type in (KDL_CUDA, KDL_CUDA_MANAGED)
    try:
        # -1: the consumer does its own ordering (the stream= argument), no synchronisation.
        capsule = obj.__dlpack__(stream=-1) if is_cuda else obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    addr = get(capsule, b"dltensor")  # the capsule (and the tensor) stay owned by the producer
    t = _DLTensor.from_address(addr)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    bits = t.dtype.bits
    kind = _DL_CODES.get(t.dtype.code, "?")
    name = f"{kind}{bits}" if t.dtype.lanes == 1 else f"{kind}{bits}x{t.dtype.lanes}"
    name = "bfloat16" if name == "bfloat16" else name
    itemsize = bits // 8
    strides = None if not t.strides else tuple(t.strides[i] * itemsize for i in range(t.ndim))
    info = ArrayInfo(
        ptr=(t.data or 0) + t.byte_offset,
        count=_count(shape),
        dtype_name=name,
        device=dev_id if is_cuda else HOST,
        is_cuda=is_cuda,
        contiguous=_c_contiguous(shape, strides, itemsize),
        readonly=False,
        library="dlpack",
    )
    del capsule
    return info


def _is_torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_cupy_array(obj) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(obj, cupy.ndarray)


_DTYPE_NAMES: dict = {}  # numpy dtype -> its name here (few dtypes, looked up on every call)


def _from_cupy(a) -> ArrayInfo:
    """A cupy array from its own attributes: its ``__cuda_array_interface__`` builds a dict
    (numpy's descr, the current stream) on every access, several microseconds a call. A cupy
    without these attributes is described through the interface."""
    try:
        data = a.data  # a MemoryPointer: the view's own address and device
        device = getattr(data, "device_id", None)
        if device is None:  # cupy before the attribute
            device = data.device.id
        dt = a.dtype
        # dtypes that differ only in metadata compare (and hash) equal: those are not cached
        # (BFLOAT16_BITS is uint16 with a tag).
        name = _DTYPE_NAMES.get(dt) if dt.metadata is None else None
        if name is None:
            name = _numpy_dtype_name(dt)
            if dt.metadata is None:
                _DTYPE_NAMES[dt] = name
        return ArrayInfo(
            int(data.ptr), int(a.size), name, int(device), True, bool(a.flags.c_contiguous),
            False, "cupy", None,
        )  # fmt: skip
    except AttributeError:
        return _from_cai(a, a.__cuda_array_interface__)


def describe(obj) -> ArrayInfo:
    """Describes `obj`; TypeError when it is not an array this library understands."""
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj)
    if _is_cupy_array(obj):
        return _from_cupy(obj)
    if _is_torch_tensor(obj):
        return _from_torch(obj)  # torch's own fields also cover bfloat16
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj)
    raise TypeError(
        f"expected a numpy, cupy or torch array (or an object with __cuda_array_interface__ or "
        f"__dlpack__), got {type(obj).__name__}"
    )


def is_cuda_array(obj) -> bool:
    """True for arrays in CUDA device memory; never imports an array library."""
    if isinstance(obj, np.ndarray):
        return False
    if _is_cupy_array(obj):
        return True
    if _is_torch_tensor(obj):
        return bool(obj.is_cuda)
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    if hasattr(obj, "__dlpack_device__"):
        try:
            return obj.__dlpack_device__()[0] in (KDL_CUDA, KDL_CUDA_MANAGED)
        except Exception:
            return False
    return False


def stream_handle(stream) -> int:
    """A CUDA stream as an integer handle: an int, a cupy Stream (.ptr), a torch Stream
    (.cuda_stream), or None for the legacy default stream (0)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"stream must be an int handle, a cupy or a torch stream, got {stream!r}")


def current_stream(info: ArrayInfo) -> int:
    """The stream a collective on this array runs behind when none is given: the array
    library's current stream, else the producer's stream, else the legacy default stream."""
    if info.library == "cupy":
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return int(cupy.cuda.get_current_stream().ptr)
    if info.library == "torch":
        torch = sys.modules.get("torch")
        if torch is not None:
            return int(torch.cuda.current_stream(info.device).cuda_stream)
    if isinstance(info.stream, int):
        return info.stream
    return 0


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name; bfloat16 is ml_dtypes' (TypeError without it)."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError as e:
        raise TypeError("bfloat16 as a numpy array needs ml_dtypes installed") from e
    return np.dtype(ml_dtypes.bfloat16)


def storage_dtype(name: str) -> np.dtype:
    """A numpy dtype whose arrays hold `name`'s values to be moved (and reduced by the native
    layer) without ml_dtypes: bfloat16 is BFLOAT16_BITS."""
    return BFLOAT16_BITS if name == "bfloat16" else np.dtype(name)


def torch_loaded() -> bool:
    """Whether torch has been imported (only then can an argument be a torch tensor)."""
    return "torch" in sys.modules


_torch_in_core = False


def torch_to_core():
    """Lets the core's one-step path take blocking calls on torch CPU tensors as it takes numpy
    arrays (``_C.set_torch_tensors``: their type, the dtypes the host moves, as
    ``host_view`` moves them), once torch is loaded; anything else stays on the general path."""
    global _torch_in_core
    torch = sys.modules.get("torch")
    if _torch_in_core or torch is None:
        return
    codes = {getattr(torch, n): c for n, c in DTYPE_CODES.items() if hasattr(torch, n)}
    _C.set_torch_tensors(torch.Tensor, codes, torch.strided)
    _torch_in_core = True


def torch_view(a: np.ndarray):
    """A CPU tensor over a numpy array's memory, no copy (bfloat16 through int16 bits): the
    reverse of `host_view`."""
    import torch

    if is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def host_view(obj):
    """`obj` as a numpy array without a copy when it is a torch CPU tensor (bfloat16 as
    BFLOAT16_BITS); anything else unchanged (the native layer says what is wrong with it)."""
    if not _is_torch_tensor(obj) or obj.is_cuda or obj.device.type != "cpu":
        return obj
    t = obj.detach()
    if str(t.dtype) == "torch.bfloat16":
        import torch

        return t.view(torch.int16).numpy().view(BFLOAT16_BITS)
    try:
        return t.numpy()
    except TypeError:  # a dtype numpy lacks: the caller's error names it
        return obj
