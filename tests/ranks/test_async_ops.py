"""Asynchronous collectives and GIL release (see workers/async_ops.py)."""

import pytest
from harness.launch import TWO_NODES, run_mpi


@pytest.mark.parametrize("nranks", [2, 3])
def test_async_collectives(nranks):
    run_mpi(nranks, "async_ops.py", timeout=120)


def test_async_collectives_across_nodes():
    run_mpi(4, "async_ops.py", timeout=120, env=TWO_NODES)
