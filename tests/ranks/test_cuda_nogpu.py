"""The CUDA transport's host-side parts, which run without a GPU: import, availability, array
detection, argument checks, the device choice, the device-sharing decision and planning; and
the GPU suite's own decisions (fail, not skip, where a listed GPU cannot be used; its MPS
daemon)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import fake_tool, run_mpi

from pycollectives.backends.cuda import (
    cuda_available,
    cuda_diagnostics,
    cuda_status,
)
from pycollectives.backends.cuda import env as cuda_mod

TESTS = Path(__file__).parent


def _cuda_built() -> bool:
    try:
        from pycollectives import _cuda  # noqa: F401
    except ImportError:
        return False
    return True


# A call's checks are _cuda's (the fake native module borrows them).
needs_cuda_module = pytest.mark.skipif(not _cuda_built(), reason="built without CUDA")


def test_communicator_setup_fails_cleanly_without_gpu():
    ok, _ = cuda_available()
    if ok:
        pytest.skip("a GPU is present")
    run_mpi(2, "cuda_nogpu.py", timeout=120)


@pytest.mark.parametrize("case", ["nogpu", "mixed", "badinput", "registered"])
def test_communicator_with_cuda_arrays_without_gpu(case):
    if cuda_available()[0]:
        pytest.skip("a GPU is present: the GPU suite covers this")
    run_mpi(3, "cuda_nogpu_dispatch.py", case, timeout=120)


def test_communicator_over_nodes_refuses_cuda_arrays():
    run_mpi(4, "cuda_nogpu_dispatch.py", "nodes", env={"PYCOLL_RANKS_PER_NODE": "2"}, timeout=120)


@needs_cuda_module
@pytest.mark.parametrize("case", ["arrays", "forced", "explicit", "split"])
def test_cuda_comm_device_is_decided_collectively(case):
    # A fake native module with two fake GPUs: arrays away from local_rank % 2 are taken where
    # no device is chosen, and refused on every rank where one is.
    env = {"PYCOLL_DEVICE": "0"} if case == "forced" else {"PYCOLL_DEVICE": ""}
    run_mpi(3, "cuda_nogpu_fake_native.py", case, env=env, timeout=120)


@needs_cuda_module
def test_cuda_comm_blocks_fit_every_launch_on_a_gpu():
    # Every rank's GPU (its UUID and SMs) decides the blocks per launch and the mode, the same
    # on every rank: fewer blocks where the request would not be resident beside the other
    # ranks' launches on the GPU, stepped mode where not even one block of each would.
    env = {"PYCOLL_DEVICE": "", "PYCOLL_CUDA_SYNC": "kernel"}
    run_mpi(3, "cuda_nogpu_fake_native.py", "residency", env=env, timeout=120)


@needs_cuda_module
def test_cuda_comm_register_trades_handles_collectively():
    # CudaComm.register over the fake native module: handles in rank order on every rank, a
    # failure on one rank raised on all, the registration released with its array.
    run_mpi(3, "cuda_nogpu_fake_native.py", "register", env={"PYCOLL_DEVICE": ""}, timeout=120)


@needs_cuda_module
@pytest.mark.parametrize(
    "case", ["communicator", "communicator_forced", "communicator_new", "communicator_register"]
)
def test_communicator_device_is_that_of_the_first_gpu_call(case):
    env = {"PYCOLL_DEVICE": "0"} if case == "communicator_forced" else {"PYCOLL_DEVICE": ""}
    run_mpi(3, "cuda_nogpu_fake_native.py", case, env=env, timeout=120)


SMI_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-1111-2222-3333-444444444444)\n"


SMI_BANNER = "| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |\n"


class FakeNative:
    """A ``pycollectives._cuda`` whose runtime finds no usable device."""

    def __init__(self, why="cudaErrorInsufficientDriver: CUDA driver version is insufficient"):
        self.why = why
        self.runtime_version = lambda: 13000
        self.driver_version = lambda: 0  # no driver the runtime can load

    def device_count(self):
        return (0, self.why) if self.why else (1, "")


def fake_smi(listing: str | None):
    """subprocess.run for a fake nvidia-smi: `listing` for -L (None: it fails)."""

    def run(cmd, **kw):
        assert kw.get("timeout"), "nvidia-smi must run under a timeout"
        args = cmd[1:]
        if args == ["-L"]:
            out, rc = (listing or "", 0) if listing is not None else ("NVML: error", 9)
        elif args and args[0].startswith("--query-gpu=driver_version"):
            out, rc = "535.104.05\n", 0
        else:
            out, rc = SMI_BANNER, 0
        return subprocess.CompletedProcess(cmd, rc, out, "")

    return run


@pytest.fixture
def fake_machine(monkeypatch):
    """Sets up what cuda_status sees: fake_machine(smi=True, listing=..., native=...)."""

    def setup(smi=True, listing=SMI_LIST, native=None):
        native = FakeNative() if native is None else native
        monkeypatch.setattr(cuda_mod, "_native", lambda: native)
        which = "/fake/bin/nvidia-smi" if smi else None
        monkeypatch.setattr(cuda_mod.shutil, "which", lambda name: which)
        monkeypatch.setattr(cuda_mod.subprocess, "run", fake_smi(listing))

    return setup


def test_cuda_status_without_a_gpu_is_absent(fake_machine):
    fake_machine(smi=False)
    status, why = cuda_status()
    assert status == "absent" and "nvidia-smi is not on PATH" in why, why
    fake_machine(listing="")  # nvidia-smi, no GPU
    status, why = cuda_status()
    assert status == "absent" and "lists no GPU" in why, why
    fake_machine(listing=None)  # nvidia-smi fails (no driver loaded)
    status, why = cuda_status()
    assert status == "absent" and "exited with 9" in why, why


def test_cuda_status_with_a_gpu_cuda_cannot_use_is_broken(fake_machine):
    fake_machine()
    status, msg = cuda_status()
    assert status == "broken", msg
    for words in ("NVIDIA H100", "cudaErrorInsufficientDriver", "driver 535.104.05"):
        assert words in msg, msg
    assert "supports CUDA 12.2" in msg and "CUDA runtime 13.0" in msg, msg
    assert "older than the runtime" in msg, msg
    # The native module's own report of the driver wins over nvidia-smi's banner.
    native = FakeNative()
    native.driver_version = lambda: 12080
    fake_machine(native=native)
    assert "supports CUDA 12.8" in cuda_status()[1]
    fake_machine(native=FakeNative(why=""))  # usable after all
    assert cuda_status() == ("ok", "")


def test_cuda_diagnostics_versions(fake_machine):
    # The driver's CUDA version from the driver when the runtime can load it, else from
    # nvidia-smi's banner; the runtime's from the module.
    native = FakeNative()
    fake_machine(native=native)
    d = cuda_diagnostics()
    assert d["runtime_cuda"] == "13.0" and d["driver"] == "535.104.05", d
    assert d["driver_cuda"] == "12.2" and not d["usable"] and d["gpus"] == [SMI_LIST.strip()], d
    native.driver_version = lambda: 12040
    assert cuda_diagnostics()["driver_cuda"] == "12.4"


def _pytest_gpu_suite(path_dirs: list, tmp_path: Path):
    env = dict(os.environ, PATH=os.pathsep.join(str(d) for d in path_dirs))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    cmd += ["-o", f"cache_dir={tmp_path}", str(TESTS.parent / "gpu" / "test_gpu.py")]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=env, cwd=TESTS.parents[1], check=False
    )


def test_gpu_suite_fails_where_a_listed_gpu_cannot_be_used(tmp_path):
    if cuda_available()[0]:
        pytest.skip("CUDA is usable here: the GPU suite runs for real")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_tool(
        bin_dir,
        "nvidia-smi",
        f'case "$1" in\n  -L) printf "%s" "{SMI_LIST.strip()}\\n";;\n'
        "  --query-gpu=driver_version) echo 535.104.05;;\n"
        f'  *) echo "{SMI_BANNER.strip()}";;\nesac\n',
    )
    proc = _pytest_gpu_suite([bin_dir, *os.environ["PATH"].split(os.pathsep)], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "error" in out.splitlines()[-1] or "failed" in out.splitlines()[-1], out
    assert "a GPU is present but CUDA cannot use it" in out, out
    assert "NVIDIA driver 535.104.05" in out and "supports CUDA 12.2" in out, out
    runtime = cuda_diagnostics()["runtime_cuda"]
    if runtime is not None:  # a build with the CUDA module: its runtime version is named
        assert f"CUDA runtime {runtime}" in out, out


@pytest.mark.parametrize("smi", ["none", "no-gpu"])
def test_gpu_suite_skips_without_a_gpu(smi, tmp_path):
    if cuda_available()[0]:
        pytest.skip("CUDA is usable here: the GPU suite runs for real")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi == "no-gpu":
        fake_tool(bin_dir, "nvidia-smi", 'echo "No devices were found"\n')
    # Only bin_dir on PATH: no real nvidia-smi can be found.
    proc = _pytest_gpu_suite([bin_dir], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 5), out  # 5: pytest's "no tests ran", a module-level skip
    last = out.strip().splitlines()[-1]
    assert "skipped" in last and "failed" not in last and "error" not in last, out
