"""Which node each rank of a communicator is on.

``PYCOLL_RANKS_PER_NODE=k`` splits each machine into nodes of k consecutive ranks, so that the
hierarchical code runs, and is tested, on one machine; ``k:cyclic`` deals the ranks out
round-robin instead (rank r on node r mod (ranks / k)), as a launcher that places ranks
cyclically would.
"""

from __future__ import annotations

import os


class Topology:
    """Which node each rank is on.

    ``nodes[i]`` lists the ranks of node i in ascending order; nodes are ordered by their
    lowest rank. A rank's local rank is its position in its node's list.
    """

    def __init__(self, node_keys):
        order: dict = {}
        for key in node_keys:
            order.setdefault(key, len(order))
        self.node_of = [order[k] for k in node_keys]
        self.nodes = [[] for _ in order]
        for rank, node in enumerate(self.node_of):
            self.nodes[node].append(rank)
        self.local_of = [self.nodes[node].index(r) for r, node in enumerate(self.node_of)]

    @classmethod
    def discover(cls, comm, ranks_per_node=None, cyclic=False):
        """Nodes of an mpi4py communicator: the machines (``COMM_TYPE_SHARED``), each split
        into nodes of `ranks_per_node` ranks if given (see `part`). Collective over `comm`."""
        from mpi4py import MPI

        from pycollectives.runtime import bootstrap

        rank = comm.Get_rank()
        host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            leader = host.bcast(rank, root=0)
            local = bootstrap.launch_local_rank(mpi=True) or (host.Get_rank(), host.Get_size())
        finally:
            host.Free()
        return cls(comm.allgather((leader, part(local, ranks_per_node, cyclic))))

    @classmethod
    def of_group(cls, group, ranks_per_node=None, cyclic=False):
        """Nodes of a rendezvous group (``pycollectives.runtime.bootstrap``): through MPI where the
        group has it; otherwise the machines named by ``bootstrap.machine_id`` (host identity,
        never rank numbers), each split as `discover` does. Collective over `group`."""
        from pycollectives.runtime import bootstrap

        if group.mpi is not None:
            group.meet("finding the nodes")  # bounded: discover's MPI calls are not
            return cls.discover(group.mpi, ranks_per_node, cyclic)
        if isinstance(group, bootstrap.ThreadGroup):
            if ranks_per_node:
                raise ValueError(
                    "PYCOLL_RANKS_PER_NODE: the ranks of a local communicator are threads of "
                    "one process, which cannot be split into nodes"
                )
            return cls([0] * group.size)
        launch = bootstrap.launch_local_rank()
        entries = group.allgather((bootstrap.machine_id(), launch))
        keys = []
        for r, (machine, local) in enumerate(entries):
            if local is None:  # no launcher said: its place among the group's ranks there
                here = [q for q, e in enumerate(entries) if e[0] == machine]
                local = here.index(r), len(here)
            keys.append((machine, part(local, ranks_per_node, cyclic)))
        return cls(keys)

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self):
        """Ranks on every node, or None when nodes differ."""
        sizes = {len(n) for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def group(self, local_rank: int) -> list:
        """The ranks with this local rank, one per node, in node order."""
        return [node[local_rank] for node in self.nodes]

    def describe(self) -> str:
        return " | ".join(",".join(map(str, n)) for n in self.nodes)


def part(local, ranks_per_node, cyclic) -> int:
    """Which emulated node of its machine a rank is on, from (its index among the launch's
    ranks on the machine, their number): the launch's, not the communicator's, so that a
    sub-communicator sees the nodes its ranks are on. Consecutive ranks, or dealt out
    round-robin if `cyclic`; 0 when machines are not split."""
    if not ranks_per_node:
        return 0
    index, on_host = local
    if cyclic:
        return index % max(1, on_host // ranks_per_node)
    return index // ranks_per_node


def ranks_per_node_from_env():
    """(ranks per emulated node or None, cyclic) from PYCOLL_RANKS_PER_NODE."""
    raw = os.environ.get("PYCOLL_RANKS_PER_NODE", "")
    if raw == "":
        return None, False
    number, _, layout = raw.partition(":")
    try:
        k = int(number)
    except ValueError:
        k = 0
    if k < 1 or layout not in ("", "cyclic"):
        raise ValueError(
            f"PYCOLL_RANKS_PER_NODE={raw!r}: expected a positive integer, optionally followed "
            "by ':cyclic'"
        )
    return k, layout == "cyclic"
