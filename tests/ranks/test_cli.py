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


def run(cmd, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())


@pytest.mark.parametrize("module", MODULES)
def test_module_help_without_mpiexec(module):
    done = run([sys.executable, "-m", module, "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "Warning" not in done.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_help_without_mpiexec(script):
    done = run([sys.executable, str(ROOT / "benchmarks" / script), "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_pycoll_bench_script_help():
    script = Path(sys.executable).parent / "pycoll-bench"
    if not script.exists():
        pytest.skip("pycoll-bench is not installed next to this Python")
    done = run([str(script), "--help"])
    assert done.returncode == 0 and "usage: pycoll-bench" in done.stdout


@pytest.mark.parametrize(
    "argv,says",
    [
        (
            ["all_gather", "--algo", "tree"],
            "all_gather has no tree algorithm (it has ring, direct)",
        ),
        (["all_to_all", "--algo", "ring"], "all_to_all has no ring algorithm"),
        (["sendrecv", "--algo", "direct"], "sendrecv has no direct algorithm (it takes no --algo)"),
        (["--algo", "spiral"], "invalid choice: 'spiral'"),
    ],
)
def test_bench_algorithm_the_collective_lacks(argv, says):
    done = run([sys.executable, "-m", "pycollectives.bench", *argv])
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
