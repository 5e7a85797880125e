"""Shared helpers for worker scripts: inputs every rank can regenerate, numpy references."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import traceback
import zlib

import numpy as np

# bfloat16 is ml_dtypes' numpy dtype. Importing ml_dtypes costs 0.7 s of CPU a process (it
# registers its ten types' loops with every ufunc), and most of the suite's processes never
# meet a bfloat16: BFLOAT16 and DTYPES are made on first use (module __getattr__), and the
# rest of this module tells bfloat16 by its name.
_BASE_DTYPES = [np.int8, np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64]
OPS = ["sum", "prod", "min", "max", "avg"]


def _bfloat16():
    """ml_dtypes' bfloat16, or None without ml_dtypes (its cases are then skipped)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def __getattr__(name):  # BFLOAT16 and DTYPES, made on first use
    if name == "BFLOAT16":
        value = _bfloat16()
    elif name == "DTYPES":
        bf16 = _bfloat16()
        value = [np.dtype(d) for d in _BASE_DTYPES] + ([bf16] if bf16 is not None else [])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def is_bfloat16(dt) -> bool:
    return dt.name == "bfloat16"


def is_float(dt) -> bool:
    return dt.kind == "f" or is_bfloat16(dt)


def valid(dt, op) -> bool:
    return op != "avg" or is_float(dt)


# Inputs are windows of fixed random pools, one per dtype and value range, built in chunks of
# _CHUNK elements, each from a seed of its own (so a pool is the same on every rank, whatever it
# was asked for before). A rank's window starts 7919 elements after the previous rank's, modulo
# the prime _SPAN: distinct ranks get distinct inputs. Slicing a pool costs a copy where drawing
# 300k random numbers cost more than the collective under test, on every rank for every rank.
_CHUNK = 1 << 16
_SPAN = 65521
_CACHED_CHUNKS = 32  # 2M elements of each pool kept; beyond that drawn again when asked
_chunks: dict = {}


def _draw(rng, count: int, dt, prod: bool) -> np.ndarray:
    # In float32 (float64 for float64) and in the integer type itself.
    if is_float(dt):
        lo, width = (0.5, 1.0) if prod else (-2.0, 4.0)
        v = rng.random(count, dtype=np.float64 if dt.itemsize == 8 else np.float32)
        v *= width
        v += lo
        return v if v.dtype == dt else v.astype(dt)
    if prod:
        lo, hi = (0, 4) if dt.kind == "u" else (-3, 4)
    else:
        info = np.iinfo(dt)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
    return rng.integers(lo, hi, count, dtype=dt, endpoint=False)


def _chunk(dt, prod: bool, i: int) -> np.ndarray:
    key = (dt, prod, i)
    c = _chunks.get(key)
    if c is None:
        c = _draw(np.random.default_rng([zlib.crc32(str(dt).encode()), prod, i]), _CHUNK, dt, prod)
        c.flags.writeable = False
        if i < _CACHED_CHUNKS:
            _chunks[key] = c
    return c


def make_input(rank: int, count: int, dt, op: str, salt: int = 0) -> np.ndarray:
    """Deterministic input of `rank` (a new array); values keep products and sums in a sane
    range."""
    dt = np.dtype(dt)
    start = (zlib.crc32(f"{count},{salt},{OPS.index(op)}".encode()) + 7919 * rank) % _SPAN
    out = np.empty(count, dt)
    done = 0
    while done < count:
        i, at = divmod(start + done, _CHUNK)
        n = min(count - done, _CHUNK - at)
        out[done : done + n] = _chunk(dt, op == "prod", i)[at : at + n]
        done += n
    return out


def reference(inputs: list[np.ndarray], op: str, dt) -> np.ndarray:
    """numpy reference: exact (wrapping) for integers, float64 for floats."""
    if is_float(dt):
        stack = np.stack([x.astype(np.float64) for x in inputs])
    else:
        stack = np.stack(inputs)
    if op in ("sum", "avg"):
        r = np.sum(stack, axis=0, dtype=stack.dtype)
        if op == "avg":
            r = r / len(inputs)
    elif op == "prod":
        r = np.prod(stack, axis=0, dtype=stack.dtype)
    elif op == "min":
        r = np.min(stack, axis=0)
    else:
        r = np.max(stack, axis=0)
    return r


def eps(dt) -> float:
    if is_bfloat16(dt):
        return 2.0**-8
    return float(np.finfo(dt).eps)


def wrong(what: str, bad: np.ndarray, total: int, got, want, note: str = "") -> AssertionError:
    """The error of a check: how many elements differ, the first, its value on each side."""
    i = int(bad[0])
    return AssertionError(
        f"{what}: {bad.size} of {total} elements wrong, first at [{i}]: got {got[i]!r}, "
        f"expected {want[i]!r}{note}"
    )


_UNITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def same_bytes(got: np.ndarray, want: np.ndarray, what: str):
    """`got` is `want` bit for bit (any dtype, bfloat16 and -0.0 included)."""
    g, w = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if g.shape != w.shape or g.dtype.itemsize != w.dtype.itemsize:
        raise AssertionError(f"{what}: {g.size} x {g.dtype} where {w.size} x {w.dtype} expected")
    unit = _UNITS[g.dtype.itemsize]
    differ = g.view(unit) != w.view(unit)
    if differ.any():
        raise wrong(what, np.flatnonzero(differ), g.size, g, w)


def check_close(got: np.ndarray, want: np.ndarray, dt, nranks: int, what: str, op: str):
    """Integers and min/max exactly; floats within the rounding of another summation order."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    if not is_float(dt) or op in ("min", "max"):
        g = got.astype(np.float64) if is_float(dt) else got
        w = want.astype(dt).astype(np.float64) if is_float(dt) else want
        if not np.array_equal(g, w):
            g, w = g.reshape(-1), w.reshape(-1)
            raise wrong(what, np.flatnonzero(g != w), g.size, g, w)
        return
    want = want.reshape(-1)
    tol = 4 * nranks * eps(dt)
    scale = 4.0 if op != "prod" else 2.0**nranks
    err = got.astype(np.float64).reshape(-1)
    err -= want
    np.abs(err, out=err)
    limit = np.abs(want)
    limit += scale
    limit *= tol
    outside = ~(err <= limit)  # NaN is outside too
    if outside.any():
        bad = np.flatnonzero(outside)
        g = got.astype(np.float64).reshape(-1)
        raise wrong(what, bad, g.size, g, want, f" (tolerance {limit[bad[0]]:.3g})")


def digest(a: np.ndarray) -> bytes:
    return hashlib.sha1(a.tobytes()).digest()


def expect(exc_type, fn, *words):
    """`fn()` raises `exc_type` with every one of `words` in its message; returns the message."""
    try:
        fn()
    except exc_type as e:
        for w in words:
            assert w in str(e), f"{w!r} not in {e}"
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__}")


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [0] the state ("Z": a zombie),
    [11] and [12] user and system CPU ticks."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def save_coverage():
    """Writes what ``make coverage`` measured in this process so far (Python and each native
    module's gcov counts): for a rank about to end by os._exit or MPI_Abort, which skip the
    exit handlers that would write it. Nothing outside a coverage run."""
    if "coverage" in sys.modules:
        cov = sys.modules["coverage"].Coverage.current()
        if cov is not None:
            cov.stop()
            cov.save()
    for name in ("_C", "_net", "_torch", "_emu"):
        dump = getattr(sys.modules.get(f"pycollectives.{name}"), "_coverage_dump", None)
        if dump is not None:
            dump()


def hard_exit(code: int = 0):
    """os._exit(code) (a rank that must not finalize MPI: its peers are gone or poisoned),
    after save_coverage()."""
    save_coverage()
    os._exit(code)


def run_main(main):
    """Runs a worker's main as a job of its own; any failure is reported for the test
    (TEST_RESULTS_DIR, see launch.run_mpi), printed, and aborts every rank."""
    from mpi4py import MPI

    gc.freeze()  # the imports (torch's among them) are long-lived: see rank.run_case
    try:
        main()
    except BaseException as e:
        folder = os.environ.get("TEST_RESULTS_DIR")
        if folder:
            rank = MPI.COMM_WORLD.Get_rank()
            result = {"type": type(e).__name__, "message": str(e)}
            with open(os.path.join(folder, f"result-{rank}.json"), "w") as f:
                json.dump(result, f)
        sys.stdout.flush()
        traceback.print_exc()
        sys.stderr.flush()
        save_coverage()
        MPI.COMM_WORLD.Abort(1)


def run_each(tests, done: str):
    """Runs each of `tests` (functions of a Communicator) on one communicator over every rank,
    a barrier after each; then rank 0 prints `done`, formatted with the rank count as
    ``{size}`` (the line the test looks for)."""
    import pycollectives as pc

    with pc.Communicator() as comm:
        for test in tests:
            test(comm)
            comm.barrier()
        if comm.rank == 0:
            print(done.format(size=comm.size))


def run_mode(modes: dict):
    """Runs the mode named by sys.argv[1], ``modes[name](mpi, comm)``, on MPI_COMM_WORLD and a
    Communicator over it; closes the communicator, and once every rank is through, rank 0
    prints the mode's name (the line the test looks for)."""
    from mpi4py import MPI

    import pycollectives as pc

    mode = sys.argv[1]
    mpi = MPI.COMM_WORLD
    c = pc.Communicator(mpi)
    modes[mode](mpi, c)
    c.close()
    mpi.Barrier()
    if mpi.rank == 0:
        print(f"{mode}")
