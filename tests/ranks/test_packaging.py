"""The package as a user installs it: a fresh virtualenv, MPI from the package index, then a
plain ``pip install`` (build isolation, no flags). The inter-node transport must be in it
(the 2 x 2 emulated-node collectives run on it), and without any MPI the build must fail
loudly with the fix instead of leaving it out. Every extension module exports its init
function alone, also where the compiler links the C++ runtime into it statically."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "ranks" / "workers"
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
    cmd = [str(c) for c in cmd]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {done.returncode}\n"
                    f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")  # fmt: skip
    return done


def exported_symbols(module: Path) -> list[str]:
    """The symbols an extension module defines for the dynamic linker (`nm -D`)."""
    done = subprocess.run(
        ["nm", "-D", "--defined-only", str(module)], capture_output=True, text=True, check=True
    )
    return [line.split()[-1] for line in done.stdout.splitlines() if line.strip()]


def assert_exports_only_init(module: Path):
    """A module that exports more than PyInit_<name> lends its copies of the C++ runtime and
    of our core to whatever else the process loads: with the runtime linked in statically and
    libstdc++.so.6 already loaded by mpi4py's MPI, the first formatted error message crashed."""
    name = module.name.split(".")[0]
    extra = [s for s in exported_symbols(module) if s != f"PyInit_{name}"]
    assert not extra, f"{module.name} exports {len(extra)} more than PyInit_{name}: {extra[:5]}"


def test_extensions_export_only_their_init():
    names = ("_C", "_net", "_cuda", "_torch", "_emu")
    specs = [importlib.util.find_spec(f"pycollectives.{name}") for name in names]
    modules = [Path(spec.origin) for spec in specs if spec is not None]
    assert modules and modules[0].name.startswith("_C."), modules
    for module in modules:
        assert_exports_only_init(module)


def fresh_venv(tmp: Path, env) -> Path:
    sh([BASE_PYTHON, "-m", "venv", tmp / "venv"], env, tmp)
    return tmp / "venv" / "bin"


def user_install_env() -> dict:
    env = user_env()
    # The CUDA transport is built (nvcc, two thirds of the build's time) by every other test's
    # install; this one is about MPI and the inter-node transport.
    env["PYCOLL_CUDA"] = "OFF"
    # As some compilers do by default: the C++ runtime linked into each module statically.
    env["LDFLAGS"] = "-static-libstdc++"
    # At -O0 with assertions on (CMakeLists.txt): this test checks what the build makes and
    # that it runs, not its speed. The Release build was most of its time (its pip install
    # 58 s alone; the test 82 s alone, 62 s at -O0).
    env["SKBUILD_CMAKE_BUILD_TYPE"] = "Debug"
    return env


def install_as_a_user(tmp: Path) -> Path:
    """A fresh virtualenv with MPI from the index and the package from a copy of this tree:
    the virtualenv's bin/."""
    env = user_install_env()
    src = source_copy(tmp)
    bin_ = fresh_venv(tmp, env)
    sh([bin_ / "pip", "install", "-q", "mpich", "mpi4py"], env, tmp)
    sh([bin_ / "pip", "install", "-q", src], env, tmp)
    return bin_


def install_without_mpi(tmp: Path):
    """The same install with no MPI anywhere: the finished pip (None if this machine has an
    MPI on PATH)."""
    env = user_env()
    env["PYCOLL_CUDA"] = "OFF"  # only the MPI check matters here
    if shutil.which("mpicc", path=env.get("PATH")):
        return None
    src = source_copy(tmp)
    bin_ = fresh_venv(tmp, env)
    return sh([bin_ / "pip", "install", src], env, tmp, check=False)


class Install(threading.Thread):
    """`how(folder)` in a thread of its own: the two installs below build the package (a minute
    and a half of both cores each) with long one-core phases (virtualenv, pip, CMake's
    configure) that the other's compiler fills when they run side by side."""

    def __init__(self, how, folder: Path):
        super().__init__(name=how.__name__, daemon=True)
        self.how, self.folder, self.value, self.error = how, folder, None, None
        self.start()

    def run(self):
        try:
            self.value = self.how(self.folder)
        except BaseException as e:  # noqa: BLE001 - raised again in the test that waits
            self.error = e

    def result(self, timeout: float = 900):
        self.join(timeout)
        if self.is_alive():
            pytest.fail(f"{self.name} not done after {timeout:.0f} s", pytrace=False)
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """Both installs, started together by whichever of their tests runs first."""
    return {
        how.__name__: Install(how, tmp_path_factory.mktemp(how.__name__))
        for how in (install_as_a_user, install_without_mpi)
    }


@pytest.mark.slow
def test_plain_pip_install_has_the_inter_node_transport(installs):
    bin_ = installs["install_as_a_user"].result()
    tmp, env = bin_.parent.parent, user_install_env()
    probe = "import pycollectives, pycollectives._net as n; print(pycollectives.__file__); " \
            "print(n.built_with_mpi)"  # fmt: skip
    where, mpi = sh([bin_ / "python", "-c", probe], env, tmp).stdout.split()
    assert where.startswith(str(tmp / "venv")) and mpi == "MPICH"
    built = sorted(Path(where).parent.glob("_*.so"))
    assert {m.name.split(".")[0] for m in built} == {"_C", "_net"}
    for module in built:
        assert_exports_only_init(module)
    # 2 nodes x 2 ranks, emulated: hierarchical collectives over the built _net
    env.update(PYCOLL_RANKS_PER_NODE="2", PYCOLL_NET_PIECE_BYTES="256", PYCOLL_TEST_COVER="rotate")
    env["PYTHONPATH"] = str(ROOT / "tests" / "harness")  # the worker's checks, not the package
    for coll in ("all_reduce", "all_gather"):  # a reducing one and a moving one; the rest
        # run over the same _net in test_hierarchy.py
        cmd = [bin_ / "mpiexec", "-n", "4", bin_ / "python", WORKERS / "collectives.py", coll,
               "small"]  # fmt: skip
        out = sh(cmd, env, tmp).stdout  # a failed check aborts the job (exit status)
        assert f"{coll} ring,tree,direct,auto ranks=4" in out or f"{coll} ring,direct" in out


@pytest.mark.slow
def test_build_without_mpi_fails_loudly(installs):
    done = installs["install_without_mpi"].result()
    if done is None:
        pytest.skip("this machine has an MPI on PATH")
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert "no MPI found" in text and "pip install mpich mpi4py" in text
    assert "PYCOLL_NET=OFF" in text
