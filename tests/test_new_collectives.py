"""All-to-all, gather, scatter and uneven all-gather / reduce-scatter on 1-5 ranks against
mpi4py's own collectives, plus mismatch detection and argument checks
(see workers/new_collectives.py)."""

import pytest
from mpi_harness import run_mpi


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5])
def test_new_collectives_match_mpi(nranks):
    out = run_mpi(nranks, "new_collectives.py", "data")
    assert f"PASS data ranks={nranks}" in out


@pytest.mark.parametrize("nranks", [2, 3])
def test_disagreeing_splits_and_counts_raise_on_every_rank(nranks):
    out = run_mpi(nranks, "new_collectives.py", "mismatch")
    assert f"PASS mismatch ranks={nranks}" in out


@pytest.mark.parametrize("nranks", [1, 3])
def test_bad_arguments_raise_before_anything_moves(nranks):
    out = run_mpi(nranks, "new_collectives.py", "args")
    assert f"PASS args ranks={nranks}" in out


# Across emulated nodes (flat over MPI between all ranks, the splits checked first).
@pytest.mark.parametrize("nranks,per_node", [(4, "2"), (6, "3"), (3, "1")])
def test_new_collectives_across_nodes_match_mpi(nranks, per_node):
    env = {"PYCOLL_RANKS_PER_NODE": per_node}
    out = run_mpi(nranks, "new_collectives.py", "data", env=env, timeout=240)
    assert f"PASS data ranks={nranks}" in out


def test_disagreeing_splits_across_nodes_raise_on_every_rank():
    out = run_mpi(3, "new_collectives.py", "mismatch", env={"PYCOLL_RANKS_PER_NODE": "1"})
    assert "PASS mismatch ranks=3" in out
