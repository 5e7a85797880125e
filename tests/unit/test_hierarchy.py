"""Which node each rank is on: Topology from node keys."""

from pycollectives.topology import Topology


def test_topology_from_keys():
    # Round-robin placement: ranks 0, 2, 4 on one machine and 1, 3, 5 on the other.
    t = Topology([("a", 0), ("b", 0), ("a", 0), ("b", 0), ("a", 0), ("b", 0)])
    assert t.nodes == [[0, 2, 4], [1, 3, 5]]
    assert t.node_of == [0, 1, 0, 1, 0, 1]
    assert t.local_of == [0, 0, 1, 1, 2, 2]
    assert t.ranks_per_node == 3
    assert t.group(1) == [2, 3]
    assert Topology([1, 1, 2]).ranks_per_node is None
