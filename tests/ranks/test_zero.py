"""ZeRO stages 1-3 against single-process training, on 2 and 4 ranks (numpy)."""

import pytest
from harness.launch import TWO_NODES, run_mpi


@pytest.mark.parametrize("nranks", [2, 4])
def test_zero(nranks):
    run_mpi(nranks, "zero.py", timeout=180)


def test_zero_across_nodes():
    run_mpi(4, "zero.py", timeout=180, env=TWO_NODES)


def test_zero_example():
    out = run_mpi(2, "run_module.py", "pycollectives.examples.zero", "--steps", "3")
    assert "matches single-process training: yes" in out, out
    assert "per-rank model state:" in out and "= 0.50 of" in out, out
