"""The package as a user installs it: a fresh virtualenv, MPI from the package index, then a
plain ``pip install`` (build isolation, no flags). The inter-node transport must be in it
(the 2 x 2 emulated-node collectives run on it), and without any MPI the build must fail
loudly with the fix instead of leaving it out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def source_copy(dest: Path) -> Path:
    """The project's files (tracked and new, not ignored) copied to `dest`: a build there
    does not touch this tree's build/ directory."""
    src = dest / "src"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:  # not a git checkout
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", ".venv*", ".git"))
        return src
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return src


def user_env() -> dict:
    """A user's shell: none of this test run's virtualenv, MPI launch or pycollectives
    settings."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "MPI_HOME", "PYCOLL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYCOLL_TIMEOUT="60")
    return env


def sh(cmd, env, cwd, timeout=600, check=True):
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited with {done.returncode}\n"
                    f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")  # fmt: skip
    return done


def fresh_venv(tmp: Path, env) -> Path:
    sh([BASE_PYTHON, "-m", "venv", tmp / "venv"], env, tmp)
    return tmp / "venv" / "bin"


@pytest.mark.slow
def test_plain_pip_install_has_the_inter_node_transport(tmp_path):
    env = user_env()
    # The CUDA transport is built (nvcc, two thirds of the build's time) by every other test's
    # install; this one is about MPI and the inter-node transport.
    env["PYCOLL_CUDA"] = "OFF"
    src = source_copy(tmp_path)
    bin_ = fresh_venv(tmp_path, env)
    sh([bin_ / "pip", "install", "-q", "mpich", "mpi4py"], env, tmp_path)
    sh([bin_ / "pip", "install", "-q", src], env, tmp_path)
    probe = "import pycollectives, pycollectives._net as n; print(pycollectives.__file__); " \
            "print(n.built_with_mpi)"  # fmt: skip
    where, mpi = sh([bin_ / "python", "-c", probe], env, tmp_path).stdout.split()
    assert where.startswith(str(tmp_path / "venv")) and mpi == "MPICH"
    # 2 nodes x 2 ranks, emulated: hierarchical collectives over the built _net
    env.update(PYCOLL_RANKS_PER_NODE="2", PYCOLL_NET_PIECE_BYTES="256")
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        cmd = [bin_ / "mpiexec", "-n", "4", bin_ / "python", WORKERS / "collectives.py", coll,
               "small"]  # fmt: skip
        out = sh(cmd, env, tmp_path).stdout
        assert f"PASS {coll} auto ranks=4" in out and f"PASS {coll} ring ranks=4" in out


@pytest.mark.slow
def test_build_without_mpi_fails_loudly(tmp_path):
    env = user_env()
    env["PYCOLL_CUDA"] = "OFF"  # only the MPI check matters here
    if shutil.which("mpicc", path=env.get("PATH")):
        pytest.skip("this machine has an MPI on PATH")
    src = source_copy(tmp_path)
    bin_ = fresh_venv(tmp_path, env)
    done = sh([bin_ / "pip", "install", src], env, tmp_path, check=False)
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert "no MPI found" in text and "pip install mpich mpi4py" in text
    assert "PYCOLL_NET=OFF" in text
