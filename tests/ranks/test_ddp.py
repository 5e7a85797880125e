"""Data-parallel training on several ranks: numpy model and the torch adapter."""

import pytest
from harness.launch import TWO_NODES, run_mpi


@pytest.mark.parametrize("nranks", [2, 3])
def test_data_parallel_numpy(nranks):
    run_mpi(nranks, "ddp_numpy.py", timeout=120)


def test_data_parallel_numpy_across_nodes():
    run_mpi(4, "ddp_numpy.py", timeout=120, env=TWO_NODES)


@pytest.mark.parametrize("nranks", [2, 3])
def test_torch_adapter_matches_one_rank_and_torch_ddp(nranks):
    pytest.importorskip("torch")
    run_mpi(nranks, "ddp_torch.py", timeout=300)
