"""pycollectives as a torch.distributed backend (see workers/torch_backend.py): every operation
torch sends a backend against gloo in the same job; stock DistributedDataParallel,
ZeroRedundancyOptimizer, FSDP2, tensor parallel and pipelining against gloo; clear errors;
launched by mpiexec and by torchrun."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_harness import clean_env, free_port, run_mpi

pytest.importorskip("torch")
WORKER = Path(__file__).parent / "workers" / "torch_backend.py"


def test_the_cpp_backend_is_built_where_torch_is():
    # make test builds against the installed torch; without the C++ half the backend would
    # still work, through Python, and nothing else would notice.
    from pycollectives import _torch  # noqa: F401


@pytest.mark.parametrize("nranks,native", [(2, "1"), (3, "1"), (2, "0")])
def test_every_operation_matches_gloo(nranks, native):
    # native "0": the Python backend alone (what the C++ one hands CUDA tensors and
    # multi-node groups to).
    env = {"PYCOLL_TORCH_NATIVE": native}
    out = run_mpi(nranks, "torch_backend.py", "ops", timeout=240, env=env)
    assert out.count("PASS torch ops") == nranks, out


@pytest.mark.parametrize("nranks", [2, 4])
def test_stock_ddp_trains_as_on_gloo(nranks):
    out = run_mpi(nranks, "torch_backend.py", "ddp", timeout=300)
    assert out.count("PASS torch ddp") == nranks, out


@pytest.mark.parametrize("nranks", [2, 4])
def test_zero_fsdp_tensor_parallel_and_pipelining_train_as_on_gloo(nranks):
    out = run_mpi(nranks, "torch_backend.py", "parallel", timeout=300)
    assert out.count("PASS torch parallel") == nranks, out


@pytest.mark.parametrize("native", ["1", "0"])
def test_unsupported_ops_and_layouts_are_refused_and_errors_named(native):
    out = run_mpi(2, "torch_backend.py", "errors", env={"PYCOLL_TORCH_NATIVE": native})
    assert out.count("PASS torch errors") == 2, out


def test_torchrun_with_stock_init_process_group():
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(WORKER)]
    proc = subprocess.run(
        cmd + ["ops", "stock"], capture_output=True, text=True, timeout=240, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(re.findall(r"PASS torch ops rank=(\d)", proc.stdout)) == ["0", "1"], proc.stdout
