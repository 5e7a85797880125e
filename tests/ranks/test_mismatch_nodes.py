"""Calls that differ across nodes fail on every rank, at once, with the same message, before
any data moves (see workers/mismatch_nodes.py): under mpiexec (MPI between nodes) and an env://
launch (gloo between them), 2 nodes x 2 ranks and 3 x 2, through the communicator and through
torch.distributed."""

import pytest
from harness.launch import our_segments, run_env_launch, run_mpi

# (ranks, ranks per node): every rank's position is the odd one in turn.
TOPOLOGIES = [(4, 2), (6, 2)]


# Nodes of 3 and 2 ranks: each case puts the odd rank in one position, the next in the next.
UNEVEN = {"PYCOLL_RANKS_PER_NODE": "3", "PYCOLL_TEST_ROTATE": "1"}


# Every rank the odd one in every case on 2 x 2; on 3 x 2 and 3 + 2 in turn.
@pytest.mark.parametrize("nranks,env", [(4, {"PYCOLL_RANKS_PER_NODE": "2"}),
                                        (6, {"PYCOLL_RANKS_PER_NODE": "2",
                                             "PYCOLL_TEST_ROTATE": "1"}),
                                        (5, UNEVEN)])  # fmt: skip
def test_mismatch_matrix_over_mpi(nranks, env):
    before = our_segments()
    out = run_mpi(nranks, "mismatch_nodes.py", env=env)
    assert "mismatch_nodes cases=" in out, out
    assert our_segments() <= before


# Over gloo a communicator takes 50-100 ms to make and close: each case puts the odd rank in
# one position, the next case in the next (the exchange differs, the verdict is the same code).
@pytest.mark.parametrize("nranks,per_node", TOPOLOGIES)
def test_mismatch_matrix_over_gloo(nranks, per_node):
    pytest.importorskip("torch")
    before = our_segments()
    outs = run_env_launch(nranks, "mismatch_nodes.py", timeout=240, PYCOLL_TEST_ROTATE="1",
                          rank_env=lambda r: {"PYCOLL_HOST_ID": str(r // per_node)})  # fmt: skip
    assert "mismatch_nodes cases=" in outs[0], outs
    assert our_segments() <= before


def test_mismatch_through_torch_distributed():
    # torchrun's way (gloo between nodes); under mpiexec a torch group is a communicator over
    # its ranks' MPI group, which the matrix above covers.
    pytest.importorskip("torch")
    out = run_env_launch(4, "mismatch_nodes.py", "torch", PYCOLL_TEST_ROTATE="1",
                         rank_env=lambda r: {"PYCOLL_HOST_ID": str(r // 2)})[0]  # fmt: skip
    assert "mismatch_nodes cases=" in out, out
