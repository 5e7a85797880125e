"""The CUDA transport on real GPUs (``make gpu-test``): several ranks on one GPU, every
collective x algorithm x dtype x op x root x size against numpy, bitwise equal across ranks;
torch tensors; stream ordering; async work; kernel mode under MPS; faults.

Skipped where there is no GPU (no nvidia-smi, or it lists none). Where nvidia-smi lists a GPU
that CUDA cannot use (a driver older than the CUDA runtime pycollectives was built with, say),
every test here fails, saying why: a GPU suite that runs nothing must not pass."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from harness.launch import run_mpi
from harness.pool import POOLS

from pycollectives.backends.cuda import cuda_status, mps_active

pytestmark = pytest.mark.gpu

# Decided once, at import: ("ok" | "absent" | "broken", why).
STATUS, WHY = cuda_status()
HAVE_CUPY = importlib.util.find_spec("cupy") is not None

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
SMALL = {"PYCOLL_CUDA_STAGING_BYTES": "4096", "PYCOLL_CUDA_BLOCKS": "4"}
MPS_CONTROL = "nvidia-cuda-mps-control"


@pytest.fixture(autouse=True)
def _usable_gpu():
    """Skips without a GPU; fails where a GPU is listed but CUDA cannot use it."""
    if STATUS == "broken":
        pytest.fail(f"a GPU is present but CUDA cannot use it: {WHY}", pytrace=False)
    if STATUS != "ok":
        pytest.skip(WHY)
    if not HAVE_CUPY:
        pytest.skip("cupy is not installed")


# -- MPS: kernel mode for ranks that share one GPU ---------------------------------------------


def mps_processes(pipe: str) -> list[int]:
    """The pids of this user's MPS daemons and servers that use the pipe directory `pipe`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in env:
            found.append(int(entry.name))
    return found


def _wait_until(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_mps(exe: str, seconds: float = 20.0) -> dict:
    """Starts an MPS control daemon with private pipe and log directories; returns the
    environment its clients need. Raises RuntimeError (after stopping what it started) if the
    daemon does not come up within `seconds`."""
    root = tempfile.mkdtemp(prefix="pycoll-mps-")  # short: the pipe is a unix socket path
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log"),
    }
    for d in env.values():
        os.mkdir(d)
    try:
        proc = subprocess.run(
            [exe, "-d"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=seconds,
            check=False,
        )
        control = os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control")
        if proc.returncode != 0 or not _wait_until(lambda: os.path.exists(control), seconds):
            raise RuntimeError(
                f"{exe} -d (exit status {proc.returncode}) did not start an MPS daemon: "
                f"{proc.stdout}{proc.stderr}{_mps_log(env)}"
            )
    except BaseException:
        stop_mps(exe, env, seconds)
        raise
    return env


def _mps_log(env: dict) -> str:
    try:
        log = Path(env["CUDA_MPS_LOG_DIRECTORY"], "control.log").read_text()
    except OSError:
        return ""
    return "\ncontrol.log:\n" + log[-2000:]


def stop_mps(exe: str, env: dict, seconds: float = 20.0) -> None:
    """Asks the daemon started by start_mps to quit, waits (bounded) for it and its servers
    to exit, stops any that do not, and removes its directories."""
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    try:
        subprocess.run(
            [exe],
            input="quit\n",
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=seconds,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        pass
    if not _wait_until(lambda: not mps_processes(pipe), seconds):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in mps_processes(pipe):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            if _wait_until(lambda: not mps_processes(pipe), 5):
                break
    shutil.rmtree(os.path.dirname(pipe), ignore_errors=True)


def _device_count() -> int:
    from pycollectives import _cuda

    return _cuda.device_count()[0]


@pytest.fixture(scope="class")
def kernel_mode_env():
    """The environment for kernel-mode workers (2 ranks): PYCOLL_CUDA_SYNC=kernel, and an MPS
    daemon of our own when the ranks share a GPU and none runs, stopped after the class."""
    env = {"PYCOLL_CUDA_SYNC": "kernel"}
    if STATUS != "ok" or not HAVE_CUPY or mps_active() or _device_count() >= 2:
        # Nothing to run (the tests skip or fail), an MPS daemon already, or a GPU per rank.
        yield env
        return
    exe = shutil.which(MPS_CONTROL)
    if exe is None:
        pytest.skip(f"kernel mode on a shared GPU needs MPS, and {MPS_CONTROL} is not on PATH")
    try:
        mps = start_mps(exe)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield {**env, **mps}
    finally:
        # The pooled ranks of the class's tests are the daemon's clients while they live: it
        # does not quit before they end (40 s of waiting and killing on an H200).
        POOLS.close_with(mps)
        stop_mps(exe, mps)


# -- collectives -------------------------------------------------------------------------------


# The host path's test bodies (workers/collectives.py, workers/new_collectives.py) over cupy
# arrays (harness/arrayimpl.py), through pc.Communicator. The longest counts span several
# staging slots: 5000 elements of 4 KiB slots, 700000 of the default 1 MiB ones.
BIG = {"small": "5000", "default": "700000"}


def run_matrix(nranks, collective, staging, *algos, env=None):
    env = dict(SMALL if staging == "small" else {}, **(env or {}))
    args = (collective, staging, *algos, "--arrays", "cupy", "--big", BIG[staging])
    out = run_mpi(nranks, "collectives.py", *args, env=env, timeout=900)
    assert "arrays=cupy sync=" in out, out
    return out


@pytest.mark.parametrize("staging", ["small", "default"])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_gpu_collective_matrix(nranks, collective, staging):
    run_matrix(nranks, collective, staging)


@pytest.mark.parametrize("nranks", [2, 3])
def test_gpu_collective_matrix_over_torch_tensors(nranks):
    # The same bodies over torch's CUDA tensors: every collective in one run, each case one
    # variant in turn.
    env = dict(SMALL, PYCOLL_TEST_COVER="rotate")
    args = (",".join(COLLECTIVES), "small", "--arrays", "torch-cuda", "--big", BIG["small"])
    out = run_mpi(nranks, "collectives.py", *args, env=env, timeout=900)
    assert out.count("arrays=torch-cuda sync=") == len(COLLECTIVES), out


NEW_COLLECTIVES = ["all_to_all", "gather_scatter", "all_gather_v", "reduce_scatter_v"]


@pytest.mark.parametrize("staging", ["small", "default"])
@pytest.mark.parametrize("collective", NEW_COLLECTIVES)
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_gpu_new_collectives(nranks, collective, staging):
    # Per-rank counts and splits (zeros, one long block), every root, absent arrays off it.
    env = SMALL if staging == "small" else {}
    args = ("--parts", collective, "--arrays", "cupy", "--big", BIG[staging])
    out = run_mpi(nranks, "new_collectives.py", "data", *args, env=env, timeout=900)
    assert f"data ranks={nranks}" in out, out


@pytest.mark.parametrize("nranks", [2, 4])
def test_gpu_twoshot_all_reduce(nranks):
    run_matrix(nranks, "all_reduce", "small", "direct", env={"PYCOLL_ONESHOT_BYTES": "0"})


@pytest.mark.parametrize("what", ["stream", "streams", "async", "mismatch"])
def test_gpu_streams_and_async(what):
    run_mpi(2, "gpu_extras.py", what)


@pytest.mark.parametrize("events", ["1", "0"])
def test_gpu_registered_buffers_in_stepped_mode(events):
    # Stepped mode: the launch between two fences (no kernel waits for a peer), on interprocess
    # events or with the host waiting for the GPU (PYCOLL_CUDA_STEPPED_EVENTS=0).
    env = {"PYCOLL_CUDA_SYNC": "stepped", "PYCOLL_CUDA_STEPPED_EVENTS": events}
    out = run_mpi(2, "gpu_extras.py", "registered", env=env)
    assert out.count("sync=stepped cases=") == 2, out


def test_gpu_registration_on_first_use_in_stepped_mode():
    # cupy's pool and torch's caching allocator, nothing registered: zero-copy from 4 KiB.
    env = {"PYCOLL_CUDA_REGISTER_BYTES": "4096", "PYCOLL_CUDA_SYNC": "stepped"}
    out = run_mpi(2, "gpu_extras.py", "first_use", env=env)
    assert out.count("first_use rank=") == 2, out


def test_gpu_reproducible_mode():
    # PYCOLL_REPRODUCIBLE=1: every algorithm's all-reduce and reduce-scatter, on cupy's pool's
    # arrays and registered ones, bit for bit the rank-order fold.
    out = run_mpi(3, "gpu_extras.py", "reproducible", env={"PYCOLL_REPRODUCIBLE": "1"})
    assert out.count("reproducible rank=") == 3, out


def test_gpu_one_rank_closes_at_once():
    # One rank, kernel mode: calls with nothing to launch never hold up close() (< 1 s).
    out = run_mpi(1, "gpu_extras.py", "one_rank", timeout=60)
    assert "one_rank sync=kernel closed in" in out, out


def test_gpu_event_probe():
    # How the GPU binds a wait on a peer's re-recorded interprocess event (reported: host
    # mode's event fences assume "queued"; the fence counters need neither).
    out = run_mpi(2, "gpu_extras.py", "event_probe", timeout=90)
    found = re.search(r"event_probe rank=1 binds=(queued|reached).*", out)
    assert found, out
    print(found.group(0))  # the kit's paths stage shows it (-rP)


def test_gpu_graph_capture_refused_in_stepped_mode():
    out = run_mpi(2, "gpu_extras.py", "graph", env={"PYCOLL_CUDA_SYNC": "stepped"})
    assert out.count("sync=stepped refused") == 2, out


def test_gpu_torch_tensors():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    run_mpi(3, "gpu_extras.py", "torch")


def test_gpu_torch_backend_device_path():
    # The C++ torch backend's device path on CUDA tensors (device/device_capi.h): its native
    # operations queued on torch's current stream against gloo on host copies, every dtype,
    # async ones and futures; a mismatch and bad input refused; stock DDP with its model on the
    # GPU trains to the parameters of gloo's on the CPU.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    if importlib.util.find_spec("pycollectives._torch") is None:
        pytest.skip("pycollectives was built without its torch backend in C++")
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} cannot use the GPU")
    out = run_mpi(2, "torch_backend.py", "device,device_ddp", timeout=300)
    assert out.count("torch device_ddp rank=") == 2, out


@pytest.mark.parametrize("nranks", [2, 3])
def test_gpu_through_communicator(nranks):
    run_mpi(nranks, "gpu_communicator.py")


def test_gpu_training_job():
    out = run_mpi(
        2, "run_module.py", "pycollectives.examples.train", "--epochs", "4", "--device", "gpu"
    )
    assert "on the GPU" in out and "replicas bit-identical across 2 ranks: yes" in out, out


def run_gpu_bench(tmp_path, env: dict | None = None) -> dict:
    """benchmarks/gpu_bench.py on 2 ranks over a few small sizes; its --json, checked."""
    out_json = tmp_path / "bench.json"
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"
    out = run_mpi(2, str(bench), "--max-bytes", "2K", "--iters", "3", "--calls", "3",
                  "--json", str(out_json), env=env, own_job=True, timeout=300)  # fmt: skip
    assert "# floors: launch+sync" in out, out
    got = json.loads(out_json.read_text())
    floors = got["floors"]
    assert 0 < floors["launch_b2b"] < 0.01 and 0 < floors["launch_sync"] < 0.01, floors
    for coll in ("all_reduce", "all_gather"):
        rows = got["rows"][coll]
        assert [r["size"] for r in rows] == [8, 32, 128, 512, 2048], rows
        for r in rows:
            assert 0 < r["bound"] < r["b2b"] and 0 < r["sync"] and 0 < r["staged"], r
    return got


def test_gpu_bench_stepped_mode(tmp_path):
    got = run_gpu_bench(tmp_path, {"PYCOLL_CUDA_SYNC": "stepped"})
    assert got["sync_mode"] == "stepped" and got["floors"]["ping_pong"] is None, got["floors"]
    assert got["graph_per_call"] is None, got


# -- faults ------------------------------------------------------------------------------------
# As tests/ranks/test_faults.py on the host path. "fingerprints": the host rendezvous before each
# launch meets the fault; "device": without it (PYCOLL_CHECK_MISMATCH=0), the device waits
# (kernel mode) or the host-driven steps (stepped mode) must.

FAULT_TIMEOUT = {"die": "10", "skip": "3"}


def run_fault(fault: str, check: str, env: dict, mode: str):
    env = dict(env, PYCOLL_TIMEOUT=FAULT_TIMEOUT[fault])
    if check == "device":
        env["PYCOLL_CHECK_MISMATCH"] = "0"
    # Keep mpiexec from killing the survivor when the other rank leaves early.
    out = run_mpi(
        2, "gpu_faults.py", fault, env=env, timeout=120, mpiexec_args=("-disable-auto-cleanup",)
    )
    assert out.count(f"{fault} sync={mode}") == 1, out  # the survivor's verdict, in that mode


@pytest.mark.parametrize("check", ["fingerprints", "device"])
@pytest.mark.parametrize("fault", ["die", "skip"])
def test_gpu_faults_stepped_mode(fault, check):
    run_fault(fault, check, {"PYCOLL_CUDA_SYNC": "stepped"}, "stepped")


# gpu_extras.py's cases that TestKernelMode runs on 2 ranks as they are, and the line each rank
# prints once the case's checks pass.
KERNEL_MODE_EXTRAS = {
    # A mismatch found on the device.
    "mismatch": "sync=kernel",
    # The LL format (data and flag in one store) on the path every small all-reduce takes.
    "ll": "sync=kernel calls=",
    # Blocking calls launched on their callers' streams, in turn: ordered on the device.
    "streams": "sync=kernel",
    # comm.empty / register and the two-shot all-reduce over them (device/twoshot_kernel.h).
    "registered": "sync=kernel cases=",
    # Graph capture and replay.
    "graph": "sync=kernel replays=5",
}


class TestKernelMode:
    """Kernel mode (one launch per collective, device-side waits). Ranks sharing one GPU need
    MPS for it: the class starts a daemon of its own when none runs (kernel_mode_env)."""

    @pytest.mark.parametrize("collective", COLLECTIVES)
    def test_gpu_kernel_mode_collectives(self, kernel_mode_env, collective):
        out = run_matrix(2, collective, "small", "ring", env=kernel_mode_env)
        assert "sync=kernel" in out, out

    @pytest.mark.parametrize("check", ["fingerprints", "device"])
    @pytest.mark.parametrize("fault", ["die", "skip"])
    def test_gpu_faults_kernel_mode(self, kernel_mode_env, fault, check):
        run_fault(fault, check, kernel_mode_env, "kernel")

    def test_gpu_bench_kernel_mode(self, kernel_mode_env, tmp_path):
        got = run_gpu_bench(tmp_path, kernel_mode_env)
        assert got["sync_mode"] == "kernel", got
        assert 0 < got["floors"]["ping_pong"] < 1e-3, got["floors"]  # one flag's round trip
        assert 0 < got["graph_per_call"] < 1e-3, got["graph_per_call"]  # replayed all-reduces

    @pytest.mark.parametrize("case", list(KERNEL_MODE_EXTRAS))
    def test_gpu_extras_on_two_ranks(self, kernel_mode_env, case):
        out = run_mpi(2, "gpu_extras.py", case, env=kernel_mode_env)
        assert out.count(KERNEL_MODE_EXTRAS[case]) == 2, out

    def test_gpu_four_ranks_auto_blocks_late_rank_two_streams(self, kernel_mode_env):
        # 4 ranks on one GPU under MPS with a block per SM of each one's share (auto, the
        # residency check's), one rank late in turn, calls alternating between streams: 200
        # calls, no hang, every result right.
        env = {**kernel_mode_env, "PYCOLL_CUDA_BLOCKS": "auto", "PYCOLL_TEST_CALLS": "200",
               "PYCOLL_TEST_LATE_MS": "1"}  # fmt: skip
        out = run_mpi(4, "gpu_extras.py", "streams", env=env, timeout=120)
        assert out.count("sync=kernel calls=200") == 4, out

    def test_gpu_free_while_a_collective_waits(self, kernel_mode_env):
        # cudaFree of a registered array behind a launch that waits for a peer who waits for
        # this host: put off, not a hang until the timeout.
        out = run_mpi(2, "gpu_extras.py", "free_while_waiting", env=kernel_mode_env, timeout=120)
        assert out.count("free_while_waiting rank=") == 2, out

    def test_gpu_registration_on_first_use(self, kernel_mode_env):
        # As in stepped mode (test_gpu_registration_on_first_use_in_stepped_mode), one launch
        # a call.
        env = dict(kernel_mode_env, PYCOLL_CUDA_REGISTER_BYTES="4096")
        out = run_mpi(2, "gpu_extras.py", "first_use", env=env)
        assert out.count("first_use rank=") == 2, out

    def test_gpu_shapes_past_the_cache_and_replays_between_streams(self, kernel_mode_env):
        # Bounded tighter than the rest (a wrong order waits out the device timeout, 20 s).
        env = {**kernel_mode_env, "PYCOLL_TEST_TIMEOUT": "20"}
        out = run_mpi(2, "gpu_extras.py", "shapes", env=env, timeout=60)
        assert out.count("sync=kernel shapes=300 replays=6") == 2, out

    def test_gpu_call_cost(self, kernel_mode_env):
        script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_call_cost.py"
        out = run_mpi(2, str(script), "--calls", "20", env=kernel_mode_env, own_job=True)
        for layer in ("Communicator", "CudaComm", "native.run"):
            assert re.search(rf"^{re.escape(layer)} +wall +[0-9.]+ us/call", out, re.M), out
