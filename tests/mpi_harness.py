"""Runs a worker script under mpiexec and turns a failure into a readable pytest failure."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
# 4 ranks as 2 nodes x 2 (emulated): shared memory inside each node, MPI between them.
TWO_NODES = {"PYCOLL_RANKS_PER_NODE": "2"}


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("mpiexec not found (make test installs mpich into .venv)")
    return found


def run_mpi(
    nprocs: int,
    worker: str,
    *args: str,
    timeout: float = 300,
    env: dict | None = None,
    mpiexec_args: tuple = (),
    with_stderr: bool = False,
    returncodes: tuple = (0,),
):
    """Runs tests/workers/<worker> on `nprocs` ranks; returns its stdout (and stderr if asked).
    Fails on non-zero exit."""
    full_env = dict(os.environ)
    full_env.setdefault("PYCOLL_TIMEOUT", "60")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    cmd = [mpiexec(), *mpiexec_args, "-n", str(nprocs), sys.executable, str(WORKERS / worker)]
    cmd += args
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\n{e.stdout}\n{e.stderr}")
    if proc.returncode not in returncodes:
        pytest.fail(
            f"{' '.join(cmd)} exited with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return (proc.stdout, proc.stderr) if with_stderr else proc.stdout


def our_segments() -> set:
    """This user's pycollectives segments currently in /dev/shm."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"pycoll-{os.getuid()}-")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """This process's environment without MPI's launch variables (for other launchers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env.update(PYTHONUNBUFFERED="1", PYCOLL_TIMEOUT="30", **extra)
    return env
