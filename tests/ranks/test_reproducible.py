"""Reproducible mode (workers/reproducible.py): every reduction is, bit for bit, its inputs
folded in rank order, whatever the algorithm asked for, the path, the slot size, the block
count and the node placement; a call's own setting; ranks that disagree raise. Over gloo
between nodes: test_env_nodes.py's reproducible case."""

import pytest
from harness.launch import run_mpi


def test_reductions_in_rank_order_on_one_node():
    # Every dtype, op, algorithm and collective; shared buffers, slots of 4 KiB, async calls.
    out = run_mpi(3, "reproducible.py", "host")
    assert out.count("ok host") == 3, out


def test_reductions_in_rank_order_on_interleaved_nodes():
    # Nodes {0, 2} and {1, 3}: a node's partial sums would add the ranks out of order, so the
    # reductions run flat over all ranks (namespace nodes where they can be made).
    out = run_mpi(4, "reproducible.py", "host", "rotate",
                  env={"PYCOLL_RANKS_PER_NODE": "2:cyclic"})  # fmt: skip
    assert out.count("ok host") == 4, out


@pytest.mark.emulated
def test_device_reductions_in_rank_order():
    # Kernel and stepped mode, 1 and 3 blocks; staged, registered and first-use arrays.
    out = run_mpi(3, "reproducible.py", "device", "rotate")
    assert out.count("ok device") == 3, out
