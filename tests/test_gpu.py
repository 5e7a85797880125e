"""The CUDA transport on real GPUs (``make gpu-test``): several ranks on one GPU, every
collective x algorithm x dtype x op x root x size against numpy, bitwise equal across ranks;
torch tensors; stream ordering; async work. Skipped without a GPU or without cupy."""

import importlib.util

import pytest
from mpi_harness import run_mpi

from pycollectives.cuda import cuda_available, mps_active

pytestmark = pytest.mark.gpu

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
if importlib.util.find_spec("cupy") is None:
    pytest.skip("cupy is not installed", allow_module_level=True)

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
SMALL = {"PYCOLL_CUDA_STAGING_BYTES": "4096", "PYCOLL_CUDA_BLOCKS": "4"}


@pytest.mark.parametrize("staging", ["small", "default"])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_gpu_collective_matrix(nranks, collective, staging):
    env = SMALL if staging == "small" else {}
    out = run_mpi(nranks, "gpu_collectives.py", collective, staging, env=env, timeout=900)
    for algo in ("ring", "direct", "auto"):
        assert f"PASS {collective} {algo} ranks={nranks}" in out, out


@pytest.mark.parametrize("nranks", [2, 4])
def test_gpu_twoshot_all_reduce(nranks):
    env = dict(SMALL, PYCOLL_ONESHOT_BYTES="0")
    out = run_mpi(nranks, "gpu_collectives.py", "all_reduce", "small", "direct", env=env)
    assert f"PASS all_reduce direct ranks={nranks}" in out


@pytest.mark.skipif(not mps_active(), reason="kernel mode on a shared GPU needs MPS")
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_gpu_kernel_mode_under_mps(collective):
    env = dict(SMALL, PYCOLL_CUDA_SYNC="kernel")
    out = run_mpi(2, "gpu_collectives.py", collective, "small", "ring", env=env)
    assert "sync=kernel" in out


@pytest.mark.parametrize("what", ["stream", "async", "mismatch"])
def test_gpu_streams_and_async(what):
    assert run_mpi(2, "gpu_extras.py", what).count(f"PASS {what}") == 2


def test_gpu_torch_tensors():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    assert run_mpi(3, "gpu_extras.py", "torch").count("PASS torch") == 3


@pytest.mark.parametrize("nranks", [2, 3])
def test_gpu_through_communicator(nranks):
    assert run_mpi(nranks, "gpu_communicator.py").count("PASS communicator") == nranks


def test_gpu_training_job():
    out = run_mpi(
        2, "run_module.py", "pycollectives.examples.train", "--epochs", "4", "--device", "gpu"
    )
    assert "on the GPU" in out and "replicas bit-identical across 2 ranks: yes" in out, out
