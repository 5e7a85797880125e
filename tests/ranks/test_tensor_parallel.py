"""Tensor parallelism (parallel.tensor) on several ranks, and its example."""

from harness.launch import ONE_NODE_AND_TWO, run_mpi


@ONE_NODE_AND_TWO
def test_tensor_parallel_layers_match_one_process(nranks, nodes):
    """On one node and on two (the all-reduces and all-gathers cross MPI)."""
    run_mpi(nranks, "tensor_parallel.py", timeout=120, env=nodes)


def test_tensor_parallel_example_matches_one_process():
    out = run_mpi(
        2, "run_module.py", "pycollectives.examples.tensor_parallel", "--steps", "10", timeout=120
    )
    assert "matches single-process training: yes" in out, out
    assert "1 all-reduce per forward" in out, out
