"""Every command-line entry point answers --help without mpiexec, and usage errors exit 2
with a usage line, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import clean_env, run_mpi

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "pycollectives.bench",
    "pycollectives.launch",
    "pycollectives.trace",
    "pycollectives.soak",
] + [
    f"pycollectives.examples.{p.stem}"
    for p in sorted((ROOT / "pycollectives" / "examples").glob("*.py"))
    if p.stem not in ("__init__", "common")
]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


PYCOLL_BENCH = Path(sys.executable).parent / "pycoll-bench"
BAD_ALGORITHMS = [
    (["all_gather", "--algo", "tree"], "all_gather has no tree algorithm (it has ring, direct)"),
    (["all_to_all", "--algo", "ring"], "all_to_all has no ring algorithm"),
    (["sendrecv", "--algo", "direct"], "sendrecv has no direct algorithm (it takes no --algo)"),
    (["--algo", "spiral"], "invalid choice: 'spiral'"),
]


def commands() -> dict:
    """Every one-process command this file runs, by the test parameter that names it."""
    cmds = {m: [sys.executable, "-m", m, "--help"] for m in MODULES}
    cmds |= {s: [sys.executable, str(ROOT / "benchmarks" / s), "--help"] for s in SCRIPTS}
    if PYCOLL_BENCH.exists():
        cmds["pycoll-bench"] = [str(PYCOLL_BENCH), "--help"]
    for argv, _ in BAD_ALGORITHMS:
        cmds[" ".join(argv)] = [sys.executable, "-m", "pycollectives.bench", *argv]
    return cmds


class Started:
    """Commands started together, each test waiting for its own: most of a --help run is
    importing, on one core, so one after the other they left half the machine idle."""

    def __init__(self, cmds: dict):
        self.procs = {
            key: subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
            )  # fmt: skip
            for key, cmd in cmds.items()
        }

    def result(self, key: str, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = self.procs[key]
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self):
        for proc in self.procs.values():
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def started():
    procs = Started(commands())
    yield procs
    procs.close()


@pytest.mark.parametrize("module", MODULES)
def test_module_help_without_mpiexec(started, module):
    done = started.result(module)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "Warning" not in done.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_help_without_mpiexec(started, script):
    done = started.result(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_pycoll_bench_script_help(started):
    if not PYCOLL_BENCH.exists():
        pytest.skip("pycoll-bench is not installed next to this Python")
    done = started.result("pycoll-bench")
    assert done.returncode == 0 and "usage: pycoll-bench" in done.stdout


@pytest.mark.parametrize("argv,says", BAD_ALGORITHMS)
def test_bench_algorithm_the_collective_lacks(started, argv, says):
    done = started.result(" ".join(argv))
    assert done.returncode == 2
    assert "usage: pycoll-bench" in done.stderr and says in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_bad_algo_under_mpiexec_exits_2():
    out, err = run_mpi(2, "run_module.py", "pycollectives.bench", "all_gather", "--algo", "tree",
                       with_stderr=True, returncodes=(2,))  # fmt: skip
    assert "all_gather has no tree algorithm" in err and "Traceback" not in err


def test_bench_all_with_an_algorithm_runs_the_collectives_that_have_it():
    out = run_mpi(2, "run_module.py", "pycollectives.bench", "all", "--algo", "tree",
                  "-e", "64", "-n", "2", "-w", "1")  # fmt: skip
    ran = {line[2:].split(":")[0] for line in out.splitlines() if ", algorithm tree" in line}
    assert ran == {"all_reduce", "broadcast", "reduce"}, out[-2000:]
