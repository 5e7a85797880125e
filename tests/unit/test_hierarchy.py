"""Which node each rank is on: Topology from node keys."""

import pytest

from pycollectives.runtime import bootstrap
from pycollectives.runtime.topology import Topology, part


def test_topology_from_keys():
    # Round-robin placement: ranks 0, 2, 4 on one machine and 1, 3, 5 on the other.
    t = Topology([("a", 0), ("b", 0), ("a", 0), ("b", 0), ("a", 0), ("b", 0)])
    assert t.nodes == [[0, 2, 4], [1, 3, 5]]
    assert t.node_of == [0, 1, 0, 1, 0, 1]
    assert t.local_of == [0, 0, 1, 1, 2, 2]
    assert t.ranks_per_node == 3
    assert t.group(1) == [2, 3]
    assert Topology([1, 1, 2]).ranks_per_node is None


class FakeStoreGroup:
    """What Topology.of_group needs of a store rendezvous: every rank's entry, given."""

    mpi = None

    def __init__(self, entries):
        self.entries, self.size = entries, len(entries)

    def allgather(self, obj):
        return self.entries


def test_nodes_of_a_store_rendezvous_come_from_machines_not_rank_numbers():
    # Machines a, b, a, b (no launcher's local ranks): two nodes, ranks interleaved.
    t = Topology.of_group(FakeStoreGroup([("a", None), ("b", None), ("a", None), ("b", None)]))
    assert t.nodes == [[0, 2], [1, 3]]
    # Split into emulated nodes of 2 by the launch's local ranks, not the group's: a subgroup
    # of ranks 1 and 2 of the launch (local ranks 1 and 2 of machine a) spans two nodes.
    t = Topology.of_group(FakeStoreGroup([("a", (1, 4)), ("a", (2, 4))]), ranks_per_node=2)
    assert t.nodes == [[0], [1]]
    t = Topology.of_group(FakeStoreGroup([("a", (2, 4)), ("a", (3, 4))]), ranks_per_node=2)
    assert t.nodes == [[0, 1]]


def test_emulated_parts_of_a_machine():
    assert [part((i, 6), 2, False) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [part((i, 6), 3, True) for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert part((5, 6), None, False) == 0


def test_machine_and_local_rank_from_the_launch():
    assert bootstrap.machine_id({"PYCOLL_HOST_ID": "n1"}) == "given:n1"
    assert bootstrap.machine_id({}) != bootstrap.machine_id({"PYCOLL_HOST_ID": "n1"})
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MPI_LOCALRANKID": "3",
           "MPI_LOCALNRANKS": "4"}  # fmt: skip
    assert bootstrap.launch_local_rank(env) == (1, 2)  # torchrun's first
    assert bootstrap.launch_local_rank(env, mpi=True) == (3, 4)
    assert bootstrap.launch_local_rank({}) is None


def test_split_members_by_color_then_key_then_rank():
    pairs = [(0, 0), (1, 5), (0, -1), (-1, 0), (1, 5)]
    assert bootstrap.split_members(pairs, 0) == [2, 0]
    assert bootstrap.split_members(pairs, 4) == [1, 4]
    assert bootstrap.split_members(pairs, 3) is None
    assert bootstrap.check_color(None, 3) == (-1, 3)
    with pytest.raises(TypeError, match="color"):
        bootstrap.check_color("x", 0)
