"""What this machine can do, checked before a job: ``python -m pycollectives.doctor [-n RANKS]``.

Each check prints ``ok``, ``info``, ``warn`` or ``FAIL``, what it found, and for a warning or a
failure what to do about it. The exit status is 0 when a job of RANKS ranks (4 by default) can
start on this machine, 1 when it cannot (a FAIL). ``--json`` prints the findings as JSON.

    python -m pycollectives.doctor -n 8
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
from typing import NamedTuple

# What MPICH takes of /dev/shm under mpiexec, per rank on the machine: 8 ranks took 42 MiB of a
# 64 MiB tmpfs here (MPICH 5.0.2; tests/ranks/test_small_shm.py). With less, MPI_Init itself
# may die with a bus error or a segmentation fault, before pycollectives starts.
MPI_SHM_PER_RANK = (42 << 20) // 8


class Finding(NamedTuple):
    check: str
    level: str  # ok, info, warn, FAIL
    found: str
    fix: str = ""


# The MPI probe, in a process of its own: MPI_Init may take long or fail, and the checks that
# fork come after it here.
_MPI_PROBE = """
from mpi4py import MPI
print(MPI.Get_library_version().strip().splitlines()[0])
try:
    from pycollectives.backends.hierarchical import load_net_transport
    load_net_transport()
    print("")
except Exception as e:
    print(f"{type(e).__name__}: {e}".replace(chr(10), " "))
"""


def check_mpi(timeout: float = 60) -> Finding:
    """MPI for mpiexec launches and between machines: mpi4py, the MPI it loads, and the
    between-nodes module built against the same family. torchrun and env:// need none."""
    if importlib.util.find_spec("mpi4py") is None:
        return Finding(
            "mpi",
            "warn",
            "mpi4py not installed: no mpiexec launches",
            "pip install mpich mpi4py (torchrun and env:// launches need no MPI)",
        )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _MPI_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Finding(
            "mpi",
            "FAIL",
            f"MPI_Init did not finish in {timeout:.0f} s",
            "check the MPI installation (mpiexec -n 1 python -c 'from mpi4py import "
            "MPI'), and /dev/shm's free space",
        )
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) < 2:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Finding(
            "mpi",
            "FAIL",
            f"MPI does not start here: {last}",
            "pip install --force-reinstall mpich mpi4py, or the cluster's MPI",
        )
    version, net = lines[0], lines[1]
    if net:
        return Finding(
            "mpi",
            "warn",
            f"{version}; between machines over MPI: no ({net})",
            "reinstall pycollectives against this MPI (pip install --force-reinstall "
            "--no-deps .) for jobs across machines under mpiexec",
        )
    return Finding("mpi", "ok", f"{version}; the between-nodes module matches it")


PTRACE_SCOPES = {
    "1": "1: a process may read only its own descendants, and ranks are siblings",
    "2": "2: only with CAP_SYS_PTRACE",
    "3": "3: never, until a reboot",
}


def check_cma(timeout: float = 10) -> Finding:
    """Cross-memory attach (process_vm_readv / writev), which large messages and shared
    buffers use: tried for real on a child process."""
    libc = ctypes.CDLL(None, use_errno=True)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    data = ctypes.create_string_buffer(b"pycollectives", 64)  # the same address in the child
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: fill the buffer, say so, wait to be read
        try:
            os.close(ready_r)
            os.close(done_w)
            data.value = b"read across processes"
            os.write(ready_w, b"1")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)  # a child that dies early then reads as end of file, not a hang
    os.close(done_r)
    got, err = -1, 0
    try:
        if select.select([ready_r], [], [], timeout)[0] and os.read(ready_r, 1) == b"1":
            out = ctypes.create_string_buffer(64)
            local = IoVec(ctypes.cast(out, ctypes.c_void_p), 64)
            remote = IoVec(ctypes.cast(data, ctypes.c_void_p), 64)
            fn = libc.process_vm_readv
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            err = ctypes.get_errno()
            if got == 64 and out.value == b"read across processes":
                return Finding("cma", "ok", "cross-memory attach permitted (process_vm_readv)")
    finally:
        try:
            os.write(done_w, b"1")
        except OSError:  # the child is gone
            pass
        os.close(done_w)
        os.close(ready_r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    why = os.strerror(err) if got < 0 and err else "the test child did not answer"
    return Finding(
        "cma",
        "warn",
        f"cross-memory attach refused ({why}; yama ptrace_scope "
        f"{PTRACE_SCOPES.get(scope, scope or 'absent')}): messages from 4 MiB go "
        "through shared memory, slower",
        "sysctl kernel.yama.ptrace_scope=0, or in a container --cap-add SYS_PTRACE",
    )


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def check_shm(nranks: int, free: int | None = None, mpi: bool = True) -> Finding:
    """/dev/shm against what `nranks` ranks on this machine need: their segments (with the
    default staging slots, else the smaller slots pycollectives takes to fit) and, under
    mpiexec (`mpi`), MPICH's own."""
    from pycollectives import _C
    from pycollectives.backends.host import MIN_FITTED_SLOT, shm_free, staging_that_fits
    from pycollectives.options import Options

    try:
        opts = Options.resolve()
    except ValueError as e:
        return Finding(
            "shm",
            "FAIL",
            f"the configuration does not parse: {e}",
            "fix or unset the PYCOLL_* variable it names",
        )
    free = shm_free() if free is None else free
    theirs = nranks * MPI_SHM_PER_RANK if mpi else 0
    ours = nranks * _C.segment_bytes(nranks, opts.staging_bytes, opts.staging_slots)
    mb = lambda b: f"{b / 1e6:.1f} MB"  # noqa: E731
    what = f"/dev/shm has {mb(free)} free; {nranks} ranks need {mb(ours)}"
    what += f" + about {mb(theirs)} for MPICH under mpiexec" if mpi else ""
    fix = "docker run --shm-size=1g (Kubernetes: an emptyDir of medium Memory on /dev/shm)"
    if free < theirs:
        return Finding(
            "shm",
            "FAIL",
            f"{what}: MPICH itself will not fit (it dies in MPI_Init)",
            f"{fix}, or fewer ranks on this machine",
        )
    left = free - theirs
    slot = staging_that_fits(nranks, opts.staging_bytes, opts.staging_slots, left)
    if slot == opts.staging_bytes:
        return Finding("shm", "ok", what)
    if slot is not None and not opts.staging_asked:
        return Finding(
            "shm",
            "warn",
            f"{what}: pycollectives takes {slot >> 10} KiB staging slots instead of "
            f"{opts.staging_bytes >> 10} KiB to fit (large messages slower)",
            f"{fix} keeps the default",
        )
    least = nranks * _C.segment_bytes(nranks, MIN_FITTED_SLOT, opts.staging_slots)
    return Finding(
        "shm",
        "FAIL",
        f"{what}: not even {MIN_FITTED_SLOT >> 10} KiB slots fit ({mb(least)})"
        if slot is None
        else f"{what} with the staging asked for (PYCOLL_STAGING_BYTES)",
        f"{fix}, fewer ranks on this machine, or smaller PYCOLL_STAGING_BYTES",
    )


def check_affinity(nranks: int) -> Finding:
    """Cores this process may run on against the ranks of a job on this machine."""
    cores = len(os.sched_getaffinity(0))
    if nranks > cores:
        return Finding(
            "cpus",
            "warn",
            f"{nranks} ranks on {cores} cores: ranks share cores, waits back off and "
            "collectives run slower",
            "fewer ranks per machine, or more cores",
        )
    return Finding("cpus", "ok", f"{cores} cores for {nranks} ranks")


def check_gpus() -> list[Finding]:
    """CUDA devices, whether each pair can map the other's memory, and MPS."""
    from pycollectives.backends.cuda.env import cuda_status, mps_active

    status, why = cuda_status()
    if status == "absent":
        return [Finding("gpu", "info", f"no GPU ({why}): host arrays only")]
    if status == "broken":
        return [
            Finding(
                "gpu",
                "warn",
                why,
                "a driver that supports this CUDA runtime, or "
                "pycollectives built for the driver's CUDA",
            )
        ]
    try:
        import cupy

        rt = cupy.cuda.runtime
        n = rt.getDeviceCount()
        names = [rt.getDeviceProperties(i)["name"].decode() for i in range(n)]
        blocked = [
            (i, j)
            for i in range(n)
            for j in range(n)
            if i != j and not rt.deviceCanAccessPeer(i, j)
        ]
    except Exception as e:  # noqa: BLE001 - cupy missing or the driver refusing
        return [
            Finding(
                "gpu",
                "warn",
                f"a GPU, but cupy cannot query it ({e})",
                "pip install cupy-cuda13x (or the build for this CUDA)",
            )
        ]
    found = f"{n} GPU(s): {', '.join(names)}"
    out = [Finding("gpu", "ok", found + "; every pair maps the other's memory")]
    if blocked:
        out = [
            Finding(
                "gpu",
                "warn",
                f"{found}; no peer access between {blocked}",
                "ranks on those GPUs exchange through host memory (slower)",
            )
        ]
    mps = mps_active()
    out.append(
        Finding(
            "mps",
            "info",
            "MPS control daemon running: ranks may share a GPU at once"
            if mps
            else "no MPS: ranks sharing a GPU take turns",
        )
    )
    return out


def check_torch() -> Finding:
    """The torch backend and its C++ half."""
    if importlib.util.find_spec("torch") is None:
        return Finding("torch", "info", "torch not installed (the torch backend is unused)")
    import torch

    try:
        importlib.import_module("pycollectives._torch")
    except ImportError as e:
        return Finding(
            "torch",
            "warn",
            f"torch {torch.__version__}; the backend's C++ half is "
            f"missing ({e}): it runs in Python, slower per call",
            "reinstall pycollectives with torch installed first",
        )
    return Finding("torch", "ok", f"torch {torch.__version__}; the backend's C++ half is built")


def check_emulated() -> Finding:
    """The emulated device (the CUDA device code compiled for the host), for the tests."""
    if importlib.util.find_spec("pycollectives._emu") is None:
        return Finding("emulated", "info", "no emulated device (a checkout's make builds it)")
    return Finding("emulated", "ok", "the emulated device is built (pytest -m emulated)")


def findings(nranks: int) -> list[Finding]:
    out = [check_mpi(), check_cma(), check_shm(nranks), check_affinity(nranks)]
    return out + check_gpus() + [check_torch(), check_emulated()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pycollectives.doctor", description=__doc__.split("\n")[0]
    )
    ap.add_argument("-n", "--ranks", type=int, default=4, help="ranks of the job on this machine")
    ap.add_argument("--json", action="store_true", help="the findings as JSON")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error("-n must be at least 1")
    found = findings(args.ranks)
    if args.json:
        print(json.dumps([f._asdict() for f in found], indent=1))
    else:
        for f in found:
            print(f"{f.level:>4}  {f.check:<8} {f.found}")
            if f.fix:
                print(f"{'':14}fix: {f.fix}")
        can = "cannot" if any(f.level == "FAIL" for f in found) else "can"
        print(f"a job of {args.ranks} ranks {can} start on this machine")
    return 1 if any(f.level == "FAIL" for f in found) else 0


if __name__ == "__main__":
    sys.exit(main())
