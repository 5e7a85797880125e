"""The GPU workers (tests/gpu/workers), checked where there is no GPU: CI never runs them, so
what breaks them without touching a GPU must fail here. Each imports as the rank pool imports
it (harness and its own folder on sys.path, cupy stubbed), and none holds on to the world
communicator from import time: the pool gives every case a world of its own and frees it after,
so a worker that kept the first case's world fails every later case."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
HARNESS = TESTS / "harness"
GPU_WORKERS = sorted((TESTS / "gpu" / "workers").glob("*.py"))
ALL_WORKERS = GPU_WORKERS + sorted((TESTS / "ranks" / "workers").glob("*.py"))

IMPORT = """
import importlib.util, sys, traceback, types
sys.modules["cupy"] = types.ModuleType("cupy")  # a GPU worker's module level needs no GPU
sys.path[:0] = [{harness!r}, {folder!r}]
for path in {paths!r}:
    try:
        spec = importlib.util.spec_from_file_location("worker_" + path.split("/")[-1][:-3], path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException:
        print("FAILED", path, traceback.format_exc(), sep="\\n")
"""


def test_gpu_workers_import():
    """Every GPU worker, in one process (each import is a second of mpi4py and the package)."""
    paths = [str(p) for p in GPU_WORKERS]
    assert len(paths) >= 4, paths
    paths.append(str(HARNESS / "arrayimpl.py"))  # the GPU suite's array libraries
    code = IMPORT.format(harness=str(HARNESS), folder=str(GPU_WORKERS[0].parent), paths=paths)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr[-2000:]


def _world_bound_at_import(tree: ast.Module) -> list[int]:
    """Lines where MPI.COMM_WORLD is read when the module is imported: a module-level
    statement (outside functions and classes' methods) or a default argument's value."""

    def is_world(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "COMM_WORLD"

    lines = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(stmt, ast.If) and "__main__" in ast.unparse(stmt.test):
            continue  # runs only as a script of its own, not in the pool
        lines += [n.lineno for n in ast.walk(stmt) if is_world(n)]
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for default in fn.args.defaults + [d for d in fn.args.kw_defaults if d]:
                lines += [n.lineno for n in ast.walk(default) if is_world(n)]
    return lines


@pytest.mark.parametrize("path", ALL_WORKERS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_worker_reads_the_world_when_called(path):
    lines = _world_bound_at_import(ast.parse(path.read_text()))
    assert not lines, f"{path.name} reads MPI.COMM_WORLD at import, line(s) {lines}"


def test_the_check_sees_a_world_bound_at_import():
    bound = "from mpi4py import MPI\nW = MPI.COMM_WORLD\ndef f(comm=MPI.COMM_WORLD): pass\n"
    assert _world_bound_at_import(ast.parse(bound)) == [2, 3]
    called = "from mpi4py import MPI\ndef f(comm=None):\n    return MPI.COMM_WORLD\n"
    assert _world_bound_at_import(ast.parse(called)) == []
