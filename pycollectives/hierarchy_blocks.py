"""Collectives that move blocks between ranks, and point-to-point messages, on a communicator
over several nodes (mixed into ``pycollectives.hierarchy.Hierarchical``).

All-to-all, gather, scatter and uneven all-gather / reduce-scatter run flat over all ranks
through MPI (``_net``, the same schedules as on one node): no intra-node phase would make fewer
bytes cross the network. Messages to a rank of this node go over shared memory, to other nodes
over MPI (``pycollectives.netp2p``).
"""

from __future__ import annotations

import numpy as np

from pycollectives import _C
from pycollectives.errors import CollectiveMismatch
from pycollectives.ops import AVG


class BlocksAndMessages:
    def flat(self, call, algorithm):
        """Collectives that move blocks between ranks (all-to-all, gather, scatter, uneven
        all-gather and reduce-scatter), flat over all ranks through MPI: no phase of them
        would cross the network less. Splits are checked on every rank before data moves."""
        c = call.collective
        count, dtype = _C.check_args(
            c, call.x, call.out, call.root, call.op, call.algorithm, self.rank, self.size,
            counts=call.counts, in_splits=call.in_splits, out_splits=call.out_splits,
        )  # fmt: skip
        algo = algorithm or ("ring" if c in ("all_gather", "reduce_scatter") else "direct")
        like = call.x if call.x is not None else call.out
        x = call.x if call.x is not None else np.empty(0, like.dtype)
        out = call.out if call.out is not None else np.empty(0, like.dtype)
        divisor = self.size if call.op == int(AVG) else 1
        lists = {"counts": call.counts or [], "send_counts": call.in_splits or []}
        lists["recv_counts"] = call.out_splits or []

        def run(seq):
            if c == "all_to_all":
                _check_splits(self.mpi.allgather((call.in_splits, call.out_splits)), seq)
            self.net.run(c, algo, self._all, x.reshape(-1), out.reshape(-1), count, dtype,
                         call.op, call.root, divisor, seq, **lists)  # fmt: skip

        return self.submit(run, call.async_op)

    def p2p(self, ops, async_op):
        """Messages to ranks of this node over shared memory, to other nodes over MPI."""
        _C.check_p2p(ops, self.rank, self.size)  # the host path's checks, on global ranks
        here = [o for o in ops if self.topo.node_of[o.peer] == self.node]
        away = [o for o in ops if self.topo.node_of[o.peer] != self.node]
        if away:
            self._p2p.check(away)
        local = [(o.kind, o.array, self.topo.local_of[o.peer], o.tag) for o in here]

        def run(seq):
            work = self.host.p2p(local, True) if local else None
            try:
                if away:
                    self._p2p.run(away, self.timeout)
            finally:
                if work is not None:
                    work.wait()

        return self.submit(run, async_op, collective=False)


def _check_splits(rows, seq):
    """Every rank's (send row, receive column) of an all-to-all, as every rank has them: the
    same verdict on every rank, before any data moves."""
    given = [r[0] is not None for r in rows]
    if any(given) and not all(given):
        raise CollectiveMismatch(
            f"all_to_all #{seq}: splits given on ranks {[q for q, g in enumerate(given) if g]} "
            f"but not on ranks {[q for q, g in enumerate(given) if not g]}"
        )
    if not any(given):
        return
    for q, (send, _) in enumerate(rows):
        for p, (_, recv) in enumerate(rows):
            if send[p] != recv[q]:
                raise CollectiveMismatch(
                    f"all_to_all #{seq}: splits disagree: rank {q} sends {send[p]} elements to "
                    f"rank {p}, which expects {recv[q]}"
                )
