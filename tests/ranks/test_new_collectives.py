"""All-to-all, gather, scatter and uneven all-gather / reduce-scatter on 1-5 ranks against
mpi4py's own collectives, plus mismatch detection and argument checks
(see workers/new_collectives.py)."""

import pytest
from harness.launch import run_mpi


@pytest.mark.parametrize("nranks", [1, pytest.param(2, marks=pytest.mark.quick), 3, 4, 5])
def test_new_collectives_match_mpi(nranks):
    run_mpi(nranks, "new_collectives.py", "data")


def test_new_collectives_over_torch_tensors():
    # The same test bodies over torch CPU tensors (harness/arrayimpl.py).
    out = run_mpi(3, "new_collectives.py", "data", "--arrays", "torch")
    assert "data ranks=3" in out, out


@pytest.mark.parametrize("cma", ["on", "fail"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_large_blocks_in_one_copy_match_mpi(nranks, cma):
    # From 1 KiB up: the 1500-element blocks (even and uneven splits) go point-to-point and are
    # written directly, the small ones of the same call through the schedule; "fail": direct
    # writes refused, p2p slots.
    env = {"PYCOLL_P2P_DIRECT_BYTES": "1024", "PYCOLL_P2P_CMA": cma, "PYCOLL_DEBUG": "INFO"}
    out, err = run_mpi(nranks, "new_collectives.py", "blocks", env=env, with_stderr=True)
    assert "all_to_all #" in err and "blocks point-to-point" in err
    assert ("using the staging slots" in err) == (cma == "fail")


@pytest.mark.parametrize("direct_bytes", [None, "1"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_disagreeing_splits_and_counts_raise_on_every_rank(nranks, direct_bytes):
    # "1": every block would go directly; the disagreement is still caught before it moves.
    env = {"PYCOLL_P2P_DIRECT_BYTES": direct_bytes} if direct_bytes else None
    run_mpi(nranks, "new_collectives.py", "mismatch", env=env)


@pytest.mark.parametrize("nranks", [1, 3])
def test_bad_arguments_raise_before_anything_moves(nranks):
    run_mpi(nranks, "new_collectives.py", "args")


# Across emulated nodes (flat over MPI between all ranks, the splits checked first).
@pytest.mark.parametrize("nranks,per_node", [(4, "2"), (6, "3"), (3, "1")])
def test_new_collectives_across_nodes_match_mpi(nranks, per_node):
    env = {"PYCOLL_RANKS_PER_NODE": per_node}
    run_mpi(nranks, "new_collectives.py", "data", env=env, timeout=240)


def test_disagreeing_splits_across_nodes_raise_on_every_rank():
    run_mpi(3, "new_collectives.py", "mismatch", env={"PYCOLL_RANKS_PER_NODE": "1"})
