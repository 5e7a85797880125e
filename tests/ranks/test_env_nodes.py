"""Several nodes without mpiexec: an env:// launch (as torchrun's) whose processes name their
machine (PYCOLL_HOST_ID), so that one machine emulates several. Inside a node, shared memory;
between nodes, gloo over the launch's store (pycollectives.backends.gloo_net). See workers/nodes.py.

The cases of a launch run one after the other in it (a launch of processes that import torch
costs seconds); each is its own test of the line every rank prints for it."""

import pytest
from harness.launch import our_segments, run_env_launch

pytest.importorskip("torch")

# 4 ranks, machines a, a, b, b. mismatch leaves the communicator unusable: it comes last.
TWO_NODES = ["collectives", "blocks", "mismatch"]
# 6 ranks, machines a, b, c, a, b, c: each node's ranks are apart in rank order; random splits
# place their members unevenly on the nodes; reductions in rank order (reproducible=True).
THREE_NODES = ["split", "random_splits", "messages", "reproducible", "p2p_mismatch"]


def launch(nprocs, cases, machines):
    before = our_segments()
    outs = run_env_launch(nprocs, "nodes.py", ",".join(cases),
                          rank_env=lambda r: {"PYCOLL_HOST_ID": machines[r]})  # fmt: skip
    return outs, our_segments() <= before


@pytest.fixture(scope="module")
def two_nodes():
    return launch(4, TWO_NODES, "aabb")


@pytest.fixture(scope="module")
def three_nodes():
    return launch(6, THREE_NODES, "abcabc")


def check(launched, case):
    outs, no_segments_left = launched
    lines = [next((ln for ln in o.splitlines() if ln.endswith(f" {case}") or f" {case}:" in ln),
                  f"rank {r}: no report") for r, o in enumerate(outs)]  # fmt: skip
    assert lines == [f"rank {r} ok {case}" for r in range(len(outs))]
    assert no_segments_left


@pytest.mark.parametrize("case", TWO_NODES)
def test_two_nodes_over_an_env_launch(two_nodes, case):
    check(two_nodes, case)


@pytest.mark.parametrize("case", THREE_NODES)
def test_three_interleaved_nodes_over_an_env_launch(three_nodes, case):
    check(three_nodes, case)


# workers/p2p.py's own cases on machines a, b, a, b: every ring link crosses nodes. Sends and
# receives in flight waited for in every order, several on one tag overtaking none (progress),
# tags, any-order matching and zero-length messages (semantics), all over gloo.
CROSSING = ["progress", "semantics"]


@pytest.fixture(scope="module")
def crossing():
    return run_env_launch(4, "p2p.py", ",".join(CROSSING), timeout=300,
                          rank_env=lambda r: {"PYCOLL_HOST_ID": "abab"[r]})  # fmt: skip


@pytest.mark.parametrize("case", CROSSING)
def test_messages_over_gloo_progress_in_every_order(crossing, case):
    assert f"p2p {case}" in crossing[0], crossing
