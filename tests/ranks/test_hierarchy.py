"""Communicators over several nodes, PYCOLL_RANKS_PER_NODE ranks on each (see
workers/hierarchy.py and workers/collectives.py): on namespace nodes where they can be made
(harness/pool.py), else emulated on one machine."""

import pytest
from harness.launch import our_segments, run_mpi

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]


# (ranks, ranks per node, algorithms): 2 nodes x 2, 3 nodes x 2, 2 nodes x 3. The flat
# schedules over MPI depend on the ranks, not on the nodes: 2 x 3 runs the hierarchical alone.
TOPOLOGIES = [(4, 2, "all"), (6, 2, "all"), (6, 3, "auto")]


# Inter-node messages of 256 bytes: every vector above a few elements is pipelined in pieces.
SMALL = {"PYCOLL_NET_PIECE_BYTES": "256"}
# Each case (dtype, op, count, root) runs one of its variants (algorithm, in place) in turn
# (PYCOLL_TEST_COVER, workers/collectives.py) but on 2 nodes x 2, where it runs them all.
ROTATE = {"PYCOLL_TEST_COVER": "rotate"}


def algorithms(collective):
    flat = (
        ["ring", "tree", "direct"]
        if collective in ("all_reduce", "broadcast", "reduce")
        else [
            "ring",
            "direct",
        ]
    )
    return flat + ["auto"]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nranks,per_node,algos", TOPOLOGIES)
def test_hierarchical_matrix(nranks, per_node, algos, collective):
    # auto is the hierarchical algorithm; ring/tree/direct run flat over the MPI transport.
    before = our_segments()
    env = {"PYCOLL_RANKS_PER_NODE": str(per_node), **SMALL}
    if (nranks, per_node) != (4, 2):
        env.update(ROTATE)
    if algos == "all":  # the flat schedules' ranks talk over MPI whatever the nodes: the same
        # code on namespace nodes, only through TCP (this file: 118 s there, 72 s emulated)
        env["PYCOLL_TEST_EMULATED_NODES"] = "1"
    run_mpi(nranks, "collectives.py", collective, "small", *(() if algos == "all" else (algos,)),
            env=env)  # fmt: skip
    assert our_segments() <= before


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("per_node", ["3", "2:cyclic"])
def test_uneven_nodes(per_node, collective):
    # 5 ranks on nodes of 3 and 2, consecutive or interleaved (0, 2, 4 and 1, 3): the
    # representatives' form (hierarchical_uneven). Flat schedules are the same on any
    # placement: the matrix above runs them.
    env = {"PYCOLL_RANKS_PER_NODE": per_node, **SMALL, **ROTATE}
    run_mpi(5, "collectives.py", collective, "small", "auto", env=env)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_hierarchical_large(collective):
    # Default staging: vectors of 300,000 elements, several 1 MiB inter-node pieces.
    env = {"PYCOLL_RANKS_PER_NODE": "2", **ROTATE}
    run_mpi(4, "collectives.py", collective, "default", "auto", env=env)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_cyclic_placement(collective):
    # Nodes {0, 2, 4} and {1, 3, 5}: rank order differs from node order.
    env = {"PYCOLL_RANKS_PER_NODE": "3:cyclic", **SMALL, **ROTATE}
    run_mpi(6, "collectives.py", collective, "small", "auto", env=env)


@pytest.mark.parametrize("inter", ["tree", "direct"])
def test_inter_node_algorithm(inter):
    env = {"PYCOLL_RANKS_PER_NODE": "2", "PYCOLL_INTER_ALGO": inter, **SMALL, **ROTATE}
    run_mpi(6, "collectives.py", "all_reduce", "small", "auto", env=env)


def test_topology_emulated():
    run_mpi(6, "hierarchy.py", "topology", "2", env={"PYCOLL_RANKS_PER_NODE": "2"})


def test_timeouts_tell_the_truth():
    run_mpi(4, "hierarchy.py", "skip", env={"PYCOLL_RANKS_PER_NODE": "2"})


def test_async_over_nodes():
    run_mpi(6, "hierarchy.py", "async", env={"PYCOLL_RANKS_PER_NODE": "3"})


def test_bad_ranks_per_node():
    out, err = run_mpi(
        2,
        "run_module.py",
        "pycollectives.soak",
        "--iterations",
        "1",
        env={"PYCOLL_RANKS_PER_NODE": "zero"},
        with_stderr=True,
        returncodes=(1,),
    )
    assert "PYCOLL_RANKS_PER_NODE='zero'" in err


@pytest.mark.parametrize("nranks,per_node", [(3, None), (4, "2"), (6, "2"), (6, "3"), (5, "3")])
def test_split_within_and_across_nodes(nranks, per_node):
    # comm.split under mpiexec: each node's ranks (shared memory), one rank per node and the
    # odd/even ranks (across nodes: MPI between them), each with the nodes its ranks are on;
    # then random splits against MPI_Comm_split, members mostly placed unevenly on the nodes.
    env = {"PYCOLL_RANKS_PER_NODE": per_node, **SMALL} if per_node else {}
    cases = ("split", "random_splits", "messages")
    out = run_mpi(nranks, "nodes.py", ",".join(cases), env=env)
    for case in cases:
        for r in range(nranks):
            assert f"rank {r} ok {case}" in out, out[-3000:]
