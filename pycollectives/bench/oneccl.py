"""``--compare oneccl``: Intel oneCCL through its own C++ API, on the same ranks and buffers.

``oneccl_peer.cpp`` (a few C entry points over ``oneapi/ccl.hpp``) is compiled once per
installation against the oneCCL packages of this environment (``pip install oneccl-cpu
oneccl-cpu-devel intel-cmplr-lib-rt intel-openmp``; ``make bench`` does it), cached, and
loaded with ctypes; Sweep times it in the same loop as every other peer. Nothing of
pycollectives is linked into it.

Two things about the packages on the index shape how it is loaded:

* ``libccl.so.1`` from ``oneccl-cpu`` names a dependency ``libccl.so.2`` that no package
  ships. The only symbols it leaves undefined beyond the C and C++ runtimes are Intel compiler
  runtime helpers (``_intel_fast_memcpy``, ``_intel_fast_memset``, ``__intel_cpu_features_*``),
  which ``libintlc.so.5`` from ``intel-cmplr-lib-rt`` defines. The build makes a library whose
  soname is ``libccl.so.2`` and that depends on ``libintlc.so.5``; the peer links it first, so
  the loader has it in place when ``libccl.so.1`` asks.
* oneCCL's default transport (OFI) wants libfabric 2.6 or newer, which the index does not
  have; the MPI transport runs over the MPICH this benchmark already runs on
  (``CCL_ATL_TRANSPORT=mpi``).

Settings (``SETTINGS``) are oneCCL's environment variables, applied unless the caller set them:
the configuration that was fastest on 2 ranks here (see docs/performance.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("oneccl_peer.cpp")
# ccl::datatype and ccl::reduction (oneapi/ccl/types.hpp).
TYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 4,
    "int64": 6,
    "float16": 8,
    "float32": 9,
    "float64": 10,
    "bfloat16": 11,
}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
SETTINGS = {
    "CCL_ATL_TRANSPORT": "mpi",  # OFI needs libfabric >= 2.6, not on the package index
    # Collectives on the calling thread: with a worker thread per rank spinning beside it,
    # 2 ranks on 2 cores took 5-15 ms per call.
    "CCL_WORKER_OFFLOAD": "0",
    # The fastest all-reduce algorithms here: MPI's own up to 64 KiB, ring above.
    "CCL_ALLREDUCE": "direct:0-65536;ring:65537-max",
    "CCL_LOG_LEVEL": "error",
}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


class Unusable(Exception):
    """oneCCL cannot run here; the message is one line saying why."""


def locate(prefix: str | None = None) -> dict:
    """Paths of what the build needs in environment `prefix` (default: $PYCOLL_ONECCL_PREFIX,
    else this Python's), or Unusable naming the packages that are missing."""
    prefix = prefix or os.environ.get("PYCOLL_ONECCL_PREFIX") or sys.prefix
    lib, inc = Path(prefix, "lib"), Path(prefix, "include")
    need = {
        "header": (inc / "oneapi" / "ccl.hpp", "oneccl-cpu-devel"),
        "libccl": (lib / "libccl.so.1", "oneccl-cpu"),
        "libintlc": (lib / "libintlc.so.5", "intel-cmplr-lib-rt"),
    }
    missing = [pkg for path, pkg in need.values() if not path.exists()]
    if missing:
        raise Unusable(f"not installed: {' '.join(missing)} (pip install {' '.join(missing)})")
    return {"lib": lib, "include": inc, **{k: p for k, (p, _) in need.items()}}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "pycollectives")


def build(paths: dict, cxx: str | None = None) -> Path:
    """Compiles the peer (once per source and installation) and returns the library's path."""
    key = hashlib.sha256(SOURCE.read_bytes())
    for k in ("header", "libccl", "libintlc"):
        st = paths[k].stat()
        key.update(f"{paths[k]}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = cache_dir() / f"oneccl-{key.hexdigest()[:16]}"
    peer = out / "oneccl_peer.so"
    if peer.exists():
        return peer
    out.mkdir(parents=True, exist_ok=True)
    cxx = cxx or os.environ.get("CXX", "g++")
    lib = str(paths["lib"])
    stub_src = out / "libccl2.c"
    stub_src.write_text("/* stands in for libccl.so.2: brings in libintlc.so.5 */\n")
    stub = out / "libccl.so.2"
    steps = [
        # cc for the empty stub: it only carries a soname and a dependency.
        [os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(stub), str(stub_src),
         "-Wl,-soname,libccl.so.2", "-Wl,--no-as-needed", f"-L{lib}", "-l:libintlc.so.5",
         f"-Wl,-rpath,{lib}"],
        [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{paths['include']}", str(SOURCE),
         "-o", str(peer) + ".tmp", "-Wl,--no-as-needed", str(stub), f"-L{lib}",
         "-l:libccl.so.1", f"-Wl,-rpath,{out}:{lib}"],
    ]  # fmt: skip
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            err = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise Unusable(f"building the oneCCL peer failed: {err}")
    os.replace(str(peer) + ".tmp", peer)
    return peer


def _bind(path: Path):
    lib = ctypes.CDLL(str(path))
    p, n, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.occl_error.restype = ctypes.c_char_p
    sig = {
        "occl_version": [ctypes.POINTER(i)] * 3,
        "occl_main_kvs": [ctypes.c_char_p, ctypes.POINTER(n)],
        "occl_kvs": [ctypes.c_char_p, n],
        "occl_comm": [i, i],
        "occl_allreduce": [p, p, n, i, i],
        "occl_allgather": [p, p, n, i],
        "occl_reduce_scatter": [p, p, n, i, i],
        "occl_broadcast": [p, n, i, i],
        "occl_reduce": [p, p, n, i, i, i],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    lib.occl_close.restype = None
    return lib


class OneCCL:
    """oneCCL on the same ranks (collective). ``reason``: None, or why it cannot run;
    ``what``: which oneCCL and with which settings; ``runner`` as peers.mpi_runner."""

    def __init__(self, mpi):
        self.mpi, self.lib, self.what = mpi, None, ""
        for k, v in SETTINGS.items():
            os.environ.setdefault(k, v)
        path, why = None, None
        if mpi.rank == 0:
            try:
                path = build(locate())
            except (Unusable, OSError) as e:
                why = str(e)
        path, why = mpi.bcast((path, why))
        self.reason = why or self._open(path)
        if self.reason is None:
            v = [ctypes.c_int() for _ in range(3)]
            self.lib.occl_version(*(ctypes.byref(x) for x in v))
            env = " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k in SETTINGS)
            self.what = f"oneCCL {'.'.join(str(x.value) for x in v)} (C++ API), {env}"

    def _open(self, path) -> str | None:
        """Loads the peer and makes the communicator; None, or why not (agreed by all)."""
        mpi, error = self.mpi, None
        try:
            self.lib = _bind(path)
        except OSError as e:
            error = f"loading the oneCCL peer failed: {e}"
        addr = None
        if mpi.rank == 0 and error is None:
            buf, n = ctypes.create_string_buffer(4096), ctypes.c_size_t(4096)
            if self.lib.occl_main_kvs(buf, ctypes.byref(n)):
                error = self.lib.occl_error().decode()
            addr = buf.raw[: n.value]
        addr, error0 = mpi.bcast((addr, error))
        if error is None and error0 is None:
            if mpi.rank and self.lib.occl_kvs(addr, len(addr)):
                error = self.lib.occl_error().decode()
            elif self.lib.occl_comm(mpi.size, mpi.rank):
                error = self.lib.occl_error().decode()
        errors = [e for e in mpi.allgather(error or error0) if e]
        if errors:
            self.lib = None
            return f"oneCCL: {errors[0].splitlines()[0]}"
        return None

    def runner(self, coll, op, root, dt):
        if self.reason:
            return self.reason
        if coll not in COLLECTIVES:
            return f"oneCCL has no {coll}"
        if dt.name not in TYPES:
            return f"oneCCL has no {dt.name}"
        lib, t, o = self.lib, TYPES[dt.name], OPS[op]
        call = {
            "all_reduce": lambda x, y: lib.occl_allreduce(
                x.ctypes.data, y.ctypes.data, x.size, t, o
            ),
            "all_gather": lambda x, y: lib.occl_allgather(x.ctypes.data, y.ctypes.data, x.size, t),
            "reduce_scatter": lambda x, y: lib.occl_reduce_scatter(
                x.ctypes.data, y.ctypes.data, y.size, t, o
            ),
            "broadcast": lambda x, y: lib.occl_broadcast(x.ctypes.data, x.size, t, root),
            "reduce": lambda x, y: lib.occl_reduce(
                x.ctypes.data, y.ctypes.data, x.size, t, o, root
            ),
        }[coll]

        def run(x, out, in_place):
            if call(x, x if in_place and coll == "all_reduce" else out):
                raise RuntimeError(f"oneCCL {coll}: {lib.occl_error().decode()}")

        return run

    def close(self):
        if self.lib is not None:
            self.lib.occl_close()
            self.lib = None
