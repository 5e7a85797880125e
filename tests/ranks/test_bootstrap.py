"""Launches other than mpiexec: torchrun and env:// find each other through a TCPStore; a
launch whose MPI world and RANK/WORLD_SIZE disagree is an error, never a world of one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import clean_env as _clean_env
from harness.launch import free_port as _free_port
from harness.launch import run_env_launch, run_mpi

WORKER = Path(__file__).parent / "workers" / "bootstrap.py"


def test_torchrun_bootstrap():
    pytest.importorskip("torch")
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    cmd = [str(torchrun), "--nproc_per_node", "3", "--master_port", str(_free_port()), str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Three processes share the pipe: their lines may interleave, their words do not.
    assert sorted(re.findall(r"rank (\d)/3 ok", proc.stdout)) == ["0", "1", "2"], proc.stdout


def test_env_launch_without_torchrun():
    # Plain env:// variables, as a hand-written launcher sets them: rank 0 hosts the store.
    pytest.importorskip("torch")
    outs = run_env_launch(2, "bootstrap.py")
    assert [o.strip() for o in outs] == ["rank 0/2 ok", "rank 1/2 ok"]


def test_mpiexec_and_env_variables_that_disagree_are_an_error():
    out = run_mpi(
        2,
        "run_module.py",
        "pycollectives.examples.train",
        env={"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
        with_stderr=True,
        returncodes=(1,),
    )
    assert "inconsistent" in out[1] and "mpiexec" in out[1], out[1][-2000:]


def test_env_launch_without_torch_names_mpiexec():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pycollectives as pc\n"
        "try:\n    pc.Communicator()\nexcept pc.CollectiveError as e:\n    print(e)\n"
    )
    env = _clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "install torch" in proc.stdout and "mpiexec" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("nranks", [2, 3])
def test_exchanges_under_mpiexec_are_bounded(nranks):
    # A split that a rank never comes to names it on the others within the timeout; ranks at
    # different exchanges all raise (bootstrap.MpiGroup.meet).
    out = run_mpi(nranks, "bounded_meet.py")
    for r in range(nranks):
        assert f"rank {r} ok" in out, out
