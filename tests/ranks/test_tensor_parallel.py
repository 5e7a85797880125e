"""Tensor parallelism (parallel.tensor) on several ranks, and its example."""

import pytest
from harness.launch import TWO_NODES, run_mpi


@pytest.mark.parametrize("nranks", [2, 4])
def test_tensor_parallel_layers_match_one_process(nranks):
    run_mpi(nranks, "tensor_parallel.py", timeout=120)


def test_tensor_parallel_across_nodes():
    run_mpi(4, "tensor_parallel.py", timeout=120, env=TWO_NODES)


def test_tensor_parallel_example_matches_one_process():
    out = run_mpi(
        2, "run_module.py", "pycollectives.examples.tensor_parallel", "--steps", "10", timeout=120
    )
    assert "matches single-process training: yes" in out, out
    assert "1 all-reduce per forward" in out, out
