"""A collective that only some ranks call waits forever for the others. The library and the
benchmarks must never call one inside a branch taken by rank 0 alone (``if rank == 0:``),
as benchmarks/gpu_bench.py once did with the device list it printed: rank 0 sat in an MPI
all-gather while rank 1 waited in the first timed all-reduce. (The fault tests' workers do
this on purpose and are not checked.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# MPI's collectives as mpi4py spells them, and ours.
COLLECTIVES = {
    "allgather", "allreduce", "alltoall", "bcast", "gather", "scatter", "reduce", "Barrier",
    "Allgather", "Allreduce", "Alltoall", "Bcast", "Gather", "Scatter", "Reduce",
    "barrier", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
}  # fmt: skip


def only_one_rank(test: ast.expr) -> bool:
    """Whether an if-test compares a rank with a constant (``mpi.rank == 0``, ``rank != 0``)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            sides = (node.left, node.comparators[0])
            named = [s.attr if isinstance(s, ast.Attribute) else s.id
                     for s in sides if isinstance(s, (ast.Attribute, ast.Name))]  # fmt: skip
            if "rank" in named and any(isinstance(s, ast.Constant) for s in sides):
                return True
    return False


def one_rank_collectives(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.If) and only_one_rank(node.test):
            for call in (c for stmt in node.body for c in ast.walk(stmt)):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr in COLLECTIVES):  # fmt: skip
                    found.append(f"{name}:{call.lineno}: {ast.unparse(call)}")
    return found


def test_the_check_sees_a_one_rank_collective():
    bad = "if mpi.rank == 0:\n    print(mpi.allgather(device))\n"
    assert one_rank_collectives(bad, "bad.py") == ["bad.py:2: mpi.allgather(device)"]
    good = "devices = mpi.allgather(device)\nif mpi.rank == 0:\n    print(devices)\n"
    assert one_rank_collectives(good, "good.py") == []


def test_no_collective_is_called_by_rank_0_alone():
    files = sorted([*ROOT.glob("pycollectives/**/*.py"), *ROOT.glob("benchmarks/*.py")])
    assert len(files) > 20
    found = [f for p in files for f in one_rank_collectives(p.read_text(), p.name)]
    assert not found, "collectives called by one rank only:\n" + "\n".join(found)
