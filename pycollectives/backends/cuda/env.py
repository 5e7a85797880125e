"""What this machine offers the CUDA transport: whether CUDA can be used, and if not why (the
driver and runtime versions, the GPUs nvidia-smi lists), whether an MPS daemon runs; and the
choices made from it: each rank's device and the ranks' synchronisation mode."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from pycollectives.runtime import arrays

DEFAULT_MPS_PIPE = "/tmp/nvidia-mps"


def _native():
    from pycollectives import _cuda

    return _cuda


def cuda_available() -> tuple[bool, str]:
    """(True, "") when a CUDA device can be used, else (False, why not)."""
    try:
        native = _native()
    except ImportError as e:
        return False, f"pycollectives was built without CUDA ({e})"
    count, why = native.device_count()
    if count == 0:
        return False, f"no usable CUDA device: {why}"
    return True, ""


def _cuda_version(v: int) -> str | None:
    """The version "13.0" from CUDA's 13000 (1000 * major + 10 * minor); None for 0."""
    return f"{v // 1000}.{v % 1000 // 10}" if v > 0 else None


def _nvidia_smi(*args: str, timeout: float = 15.0) -> tuple[str | None, str]:
    """(stdout, "") of ``nvidia-smi ARGS``, or (None, why not); never waits past `timeout`."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi is not on PATH"
    try:
        proc = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi {' '.join(args)}: {e}"
    if proc.returncode != 0:
        said = (proc.stdout + proc.stderr).strip().splitlines()
        return None, f"nvidia-smi {' '.join(args)} exited with {proc.returncode}" + (
            f": {said[0]}" if said else ""
        )
    return proc.stdout, ""


def _driver_cuda_version(native, smi_banner: str | None) -> str | None:
    """The newest CUDA version the installed driver supports, e.g. "12.4": from the driver
    itself when the CUDA module can ask it, else from nvidia-smi's banner."""
    v = _cuda_version(int(native.driver_version())) if native is not None else None
    if v is None:
        found = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", smi_banner or "")
        v = found.group(1) if found else None
    return v


def _runtime_cuda_version(native) -> str | None:
    """The CUDA runtime version ``pycollectives._cuda`` was built with (linked statically)."""
    return _cuda_version(int(native.runtime_version())) if native is not None else None


def cuda_diagnostics() -> dict:
    """What can be told about this machine's GPUs and CUDA, for error messages and reports.

    Keys: ``usable`` (bool) and ``why`` (why not, from the CUDA runtime), ``device_count``,
    ``gpus`` (the lines of ``nvidia-smi -L``; empty without nvidia-smi or a GPU),
    ``nvidia_smi`` (why it listed nothing, or ""), ``driver`` (the NVIDIA driver version, e.g.
    "535.104.05"), ``driver_cuda`` (the newest CUDA version that driver supports),
    ``runtime_cuda`` (the CUDA runtime ``pycollectives._cuda`` was built with); versions are
    None where they cannot be told. Runs ``nvidia-smi`` (bounded); never raises.
    """
    usable, why = cuda_available()
    try:
        native = _native()
        count = native.device_count()[0]
    except ImportError:
        native, count = None, 0
    listed, smi_why = _nvidia_smi("-L")
    gpus = [ln.strip() for ln in (listed or "").splitlines() if ln.strip().startswith("GPU")]
    if listed is not None and not gpus:
        smi_why = "nvidia-smi -L lists no GPU"
    driver, banner = None, None
    if gpus:
        out = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")[0] or ""
        driver = out.split("\n")[0].strip() or None
        banner = _nvidia_smi()[0]  # "... Driver Version: 535.104.05   CUDA Version: 12.2 ..."
    return {
        "usable": usable,
        "why": why,
        "device_count": count,
        "gpus": gpus,
        "nvidia_smi": smi_why,
        "driver": driver,
        "driver_cuda": _driver_cuda_version(native, banner),
        "runtime_cuda": None if native is None else _runtime_cuda_version(native),
    }


def cuda_status() -> tuple[str, str]:
    """("ok", ""), ("absent", why) or ("broken", what is wrong).

    "absent": CUDA cannot be used and nvidia-smi lists no GPU (or is not installed): nothing
    to use. "broken": nvidia-smi lists a GPU but CUDA cannot use it (a driver older than the
    CUDA runtime pycollectives was built with, a build without the CUDA module, ...); the
    message names the GPUs, the driver and both CUDA versions.
    """
    ok, why = cuda_available()
    if ok:
        return "ok", ""
    d = cuda_diagnostics()
    if not d["gpus"]:
        return "absent", f"{why} ({d['nvidia_smi']})"
    unknown = "unknown"
    driver_cuda = d["driver_cuda"]
    runtime = d["runtime_cuda"]
    msg = (
        f"nvidia-smi lists {len(d['gpus'])} GPU(s) ({'; '.join(d['gpus'])}) but CUDA cannot use "
        f"them: {why}. NVIDIA driver {d['driver'] or unknown} (supports CUDA "
        f"{driver_cuda or unknown}); pycollectives._cuda was built with the CUDA runtime "
        f"{runtime or unknown}."
    )
    if driver_cuda and runtime and _version_key(driver_cuda) < _version_key(runtime):
        msg += f" The driver is older than the runtime: CUDA {runtime} needs a newer driver."
    return "broken", msg


def _version_key(v: str) -> tuple:
    return tuple(int(p) for p in v.split("."))


def mps_active(environ=None, default_pipe: str = DEFAULT_MPS_PIPE) -> bool:
    """Whether an MPS control daemon is reachable from this process."""
    environ = os.environ if environ is None else environ
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY") or default_pipe
    return os.path.exists(os.path.join(pipe, "control"))


def choose_sync_mode(uuids: list, mps: list, forced: list | None = None) -> str:
    """The synchronisation every rank uses, from every rank's device UUID, MPS state and
    override (lists indexed by rank, the same on every rank).

    "kernel" (device-side waits in one launch) when every rank has a GPU of its own, or when
    MPS runs everywhere so that kernels of different processes run side by side; "stepped"
    (host-side waits between launches) when ranks time-slice a shared GPU.
    """
    wanted = {f for f in (forced or []) if f is not None}
    if len(wanted) > 1 or (wanted and None in (forced or [])):
        raise ValueError(f"ranks disagree on PYCOLL_CUDA_SYNC: {list(forced)}")
    if wanted:
        return wanted.pop()
    shared = len(set(uuids)) < len(uuids)
    if not shared:
        return "kernel"
    return "kernel" if all(mps) else "stepped"


def choose_device(
    device, local_rank: int, device_count: int, environ=None, arrays_device: int | None = None
) -> int:
    """The device of this rank: `device` if given, else ``PYCOLL_DEVICE``; without either,
    `arrays_device` (the device of the arrays the communicator is made for), else
    ``local_rank % device_count``.

    Raises ValueError when the chosen device does not exist, or when the arrays are on another
    device than the one chosen explicitly.
    """
    environ = os.environ if environ is None else environ
    source = f"device={device}"
    if device is None and environ.get("PYCOLL_DEVICE", "") != "":
        raw = environ["PYCOLL_DEVICE"]
        try:
            device = int(raw)
        except ValueError:
            raise ValueError(f"PYCOLL_DEVICE={raw!r} is not a device number") from None
        source = f"PYCOLL_DEVICE={raw}"
    if device is None and arrays_device is not None:
        device, source = arrays_device, "the arrays"
    if device is None:
        if device_count < 1:
            raise ValueError("no CUDA device to choose from")
        return local_rank % device_count
    device = int(device)
    if not 0 <= device < device_count:
        raise ValueError(
            f"device {device} ({source}) does not exist (this machine has {device_count})"
        )
    if arrays_device is not None and arrays_device != device:
        raise ValueError(
            f"the arrays are on CUDA device {arrays_device}, but {source} chose device {device} "
            f"for the communicator: put them on device {device}, or choose device {arrays_device}"
        )
    return device


def arrays_device(objs) -> int | None:
    """The CUDA device of the arrays in `objs` (None entries skipped), or None when none can
    be told. Raises ValueError when they are on different devices."""
    objs = list(objs)
    names = ["x", "out"] if len(objs) == 2 else [f"array {i}" for i in range(len(objs))]
    seen = []
    for name, obj in zip(names, objs):
        if obj is None:
            continue
        try:
            dev = arrays.describe(obj).device
        except TypeError as e:
            raise ValueError(f"{name}: {e}") from None
        if dev is not None and dev != arrays.HOST:
            seen.append((name, dev))
    if len({dev for _, dev in seen}) > 1:
        raise ValueError(
            "the arrays are on different CUDA devices: "
            + ", ".join(f"{name} on device {dev}" for name, dev in seen)
        )
    return seen[0][1] if seen else None
