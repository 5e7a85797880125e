"""Hierarchical collectives on nodes of different sizes (mixed into
``pycollectives.backends.hierarchical.Hierarchical``).

Where every node has the same number of ranks, each column (the ranks with one local rank, one
per node) carries a shard between nodes. Where nodes differ (5 ranks on nodes of 3 and 2, a
subgroup with one member on some node, members interleaved), columns do not reach every node,
so each node speaks through one *representative*: its lowest rank (local rank 0), or the root
on the root's node.

- all-reduce: reduce to the representative inside each node, all-reduce among the
  representatives, broadcast inside each node;
- reduce-scatter: reduce inside each node, reduce-scatter among the representatives of blocks
  laid out node by node (each node's padded to the largest node's), scatter inside each node;
- all-gather: gather inside each node, all-gather among the representatives (blocks padded the
  same way), broadcast inside each node;
- broadcast: among the representatives (the root's node's is the root), then inside each node;
- reduce: inside each node to its representative (the root on its node), then among them to the
  root.

An average is a sum inside the nodes, divided by the number of ranks once, between nodes. Every
rank's result comes from one reduction among the representatives, so it is the same bits on
every rank. The check across nodes (``call_check``) exchanges each node's status with every
rank, since no column reaches every node: every rank holds every node's status before any byte
of the user's arrays is written, as on even nodes.
"""

from __future__ import annotations

import numpy as np

from pycollectives.ops import AVG, SUM


class UnevenNodes:
    """The five hierarchical collectives where nodes differ in size. Each method takes what
    its even counterpart takes (a checked Call, its count, dtype code and record) and runs only
    the hierarchical form: flat schedules are the same on any placement."""

    def _uneven_layout(self):
        """Every rank's slot when blocks are laid out node by node, each node padded to the
        largest: rank `nodes[i][k]` at i * widest + k."""
        nodes = self.topo.nodes
        self.widest = max(len(n) for n in nodes)
        self.slot = np.empty(self.size, np.intp)
        for i, members in enumerate(nodes):
            self.slot[members] = i * self.widest + np.arange(len(members))

    def representatives(self, root=None) -> list:
        """One rank per node, in node order: its lowest, or `root` on the root's node."""
        reps = [n[0] for n in self.topo.nodes]
        if root is not None:
            reps[self.topo.node_of[root]] = root
        return reps

    def _split_avg(self, op):
        """(the op inside nodes, the op between them, the divisor between them): an average
        is a sum inside the nodes divided by every rank's count once."""
        if op == int(AVG):
            return int(SUM), op, self.size
        return op, op, 1

    def _between(self, collective, group, x, out, count, dtype, op, root, divisor, seq):
        algo = self._inter(collective, count * x.itemsize)
        self.net.run(collective, algo, group, x, out, count, dtype, op, root, divisor, seq)

    def all_reduce_uneven(self, call, count, dtype, record):
        x, out, op = call.x, call.out, call.op
        res = x if out is None else out
        inner, between, divisor = self._split_avg(op)

        def run(seq):
            flat_x, flat_res = x.reshape(-1), res.reshape(-1)
            part = np.empty(count, x.dtype)
            status = self.node_status(
                record, lambda outer: self._local("reduce", flat_x, part, inner, 0, outer)
            )
            self.column_check(status, seq)
            if self.local == 0:
                reps = self.representatives()
                self._between("all_reduce", reps, part, part, count, dtype, between, 0, divisor,
                              seq)  # fmt: skip
                flat_res[:] = part
            self._local("broadcast", flat_res, root=0, outer=record)

        return self.submit(run, call.async_op)

    def reduce_scatter_uneven(self, call, m, dtype, record):
        x, out, op = call.x, call.out, call.op
        inner, between, divisor = self._split_avg(op)
        mine = len(self.topo.nodes[self.node])

        def run(seq):
            full = np.empty(self.size * m, x.dtype)
            status = self.node_status(
                record,
                lambda outer: self._local("reduce", x.reshape(-1), full, inner, 0, outer),
            )
            self.column_check(status, seq)
            block = self.widest * m
            ours = np.empty(block, x.dtype)
            if self.local == 0:
                laid = np.zeros(self.nodes * block, x.dtype)  # padding: reduced, never read
                laid.reshape(self.nodes * self.widest, m)[self.slot] = full.reshape(self.size, m)
                self._between("reduce_scatter", self.representatives(), laid, ours, block, dtype,
                              between, 0, divisor, seq)  # fmt: skip
            self._local("scatter", ours[: mine * m], out.reshape(-1), root=0, outer=record)

        return self.submit(run, call.async_op)

    def all_gather_uneven(self, call, m, dtype, record):
        x, out = call.x, call.out
        mine = len(self.topo.nodes[self.node])

        def run(seq):
            block = self.widest * m
            laid = np.empty(self.nodes * block, x.dtype)
            ours = np.zeros(block, x.dtype)  # padding: carried, never read
            status = self.node_status(
                record,
                lambda outer: self._local(
                    "gather", x.reshape(-1), ours[: mine * m], root=0, outer=outer
                ),  # fmt: skip
            )
            self.column_check(status, seq)
            if self.local == 0:
                self._between("all_gather", self.representatives(), ours, laid, block, dtype, 0,
                              0, 1, seq)  # fmt: skip
            self._local("broadcast", laid, root=0, outer=record)
            out.reshape(self.size, m)[:] = laid.reshape(self.nodes * self.widest, m)[self.slot]

        return self.submit(run, call.async_op)

    def broadcast_uneven(self, call, count, dtype, record):
        x, root = call.x, call.root

        def run(seq):
            flat = x.reshape(-1)
            self.column_check(self.node_status(record), seq)
            reps = self.representatives(root)
            if self.rank in reps:
                root_node = self.topo.node_of[root]
                self._between("broadcast", reps, flat, flat, count, dtype, 0, root_node, 1, seq)
            here = self.topo.local_of[reps[self.node]]
            self._local("broadcast", flat, root=here, outer=record)

        return self.submit(run, call.async_op)

    def reduce_uneven(self, call, count, dtype, record):
        x, out, root, op = call.x, call.out, call.root, call.op
        res = x if out is None else out
        inner, between, divisor = self._split_avg(op)

        def run(seq):
            flat_x, flat_res = x.reshape(-1), res.reshape(-1)
            reps = self.representatives(root)
            here = self.topo.local_of[reps[self.node]]
            part = np.empty(count, x.dtype)
            status = self.node_status(
                record, lambda outer: self._local("reduce", flat_x, part, inner, here, outer)
            )
            self.column_check(status, seq)
            if self.rank in reps:
                root_node = self.topo.node_of[root]
                self._between("reduce", reps, part, flat_res, count, dtype, between, root_node,
                              divisor, seq)  # fmt: skip

        return self.submit(run, call.async_op)
