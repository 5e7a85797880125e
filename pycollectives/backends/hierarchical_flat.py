"""Collectives that move blocks between ranks, and point-to-point messages, on a communicator
over several nodes (mixed into ``pycollectives.backends.hierarchical.Hierarchical``).

All-to-all, gather, scatter and uneven all-gather / reduce-scatter run flat over all ranks
through MPI (``_net``, the same schedules as on one node): no intra-node phase would make fewer
bytes cross the network. So does every collective whose algorithm is named. Messages to a rank
of this node go over shared memory, to other nodes over MPI (``_net.NetP2P``: posted at once,
progressing on their own).
"""

from __future__ import annotations

import time

import numpy as np

from pycollectives import _C
from pycollectives.errors import CollectiveError, CollectiveMismatch
from pycollectives.ops import AVG


class BlocksAndMessages:
    def flat(self, call, algorithm, count, dtype, record):
        """A collective flat over all ranks through MPI (``_net``, the schedules of one node):
        every collective with a named algorithm, and those that move blocks between ranks
        (all-to-all, gather, scatter, uneven all-gather and reduce-scatter), where no phase
        within a node would make fewer bytes cross the network. `call` is checked (its `count`
        and `dtype` code, and its `record`, compared across nodes first); splits are compared
        across ranks before data moves."""
        c = call.collective
        algo = algorithm or ("ring" if c in ("all_gather", "reduce_scatter") else "direct")
        like = call.x if call.x is not None else call.out
        x = call.x if call.x is not None else np.empty(0, like.dtype)
        out = call.out
        if out is None:  # in place (the single-array forms), or nothing received here
            out = x if c in ("all_reduce", "reduce", "broadcast") else np.empty(0, like.dtype)
        divisor = self.size if call.op == int(AVG) else 1
        lists = {"counts": call.counts or [], "send_counts": call.in_splits or []}
        lists["recv_counts"] = call.out_splits or []

        def run(seq):
            self.checked(record, seq)
            if c == "all_to_all":
                _check_splits(self._group.allgather((call.in_splits, call.out_splits)), seq)
            self.net.run(c, algo, self._all, x.reshape(-1), out.reshape(-1), count, dtype,
                         call.op, call.root, divisor, seq, **lists)  # fmt: skip

        return self.submit(run, call.async_op)

    def p2p(self, ops, async_op):
        """Messages to ranks of this node over shared memory, to other nodes over MPI
        (``_net.NetP2P``). Every one is posted now and progresses on its own, whatever the
        order in which this or any rank waits, and beside collectives in flight; returns a
        handle (async_op) or None once all are done."""
        run_away = self._p2p_run_away
        if not async_op and run_away is not None and self._error is None:
            # Every peer on another node and waited for now: checked, posted and waited for in
            # one native call, which wakes no progress thread (an engine poisoned since raises
            # there, and this communicator at its next call).
            if run_away(ops, self.rank, self.size):
                return None
        self._check_usable()
        node_of, node = self.topo.node_of, self.node
        described = _C.check_p2p(ops, self.rank, self.size)  # the host path's checks
        away, here = [], []
        for o, d in zip(ops, described):
            if node_of[o.peer] != node:
                away.append((o, d) if self._p2p.takes_arrays else d)
            else:
                here.append((o.kind, o.array, self.topo.local_of[o.peer], o.tag))
        if not away:
            return self.host.p2p(here, async_op)
        net = self._p2p.start(away)  # every tag checked before anything is posted
        if here:
            try:
                local = self.host.p2p(here, async_op)
            except CollectiveError as e:
                self.abort(str(e))
                raise
            net = _Messages([net] if local is None else [net, local], self)
        # Alone, the MPI part's error poisons its engine, and so this communicator at its next
        # call (_check_usable).
        if async_op:
            return net
        net.wait()
        return None


class _Messages:
    """The native side of a Work (``pycollectives.work.Work``) for point-to-point operations
    on a communicator over several nodes: done when its messages to this node (shared memory)
    and to other nodes (MPI) are. An error in either makes the whole communicator unusable."""

    __slots__ = ("_parts", "_hier", "seq")

    def __init__(self, parts, hier):
        self._parts, self._hier, self.seq = parts, hier, hier.seq

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        error = None
        for part in self._parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                part.wait(left)
            except CollectiveError as e:
                if not part.is_completed():  # only out of time: nothing failed
                    raise
                if error is None:
                    error = e
                    self._hier.abort(str(e))  # the other part fails at once, not at its deadline
        if error is not None:
            raise error
        return True

    def is_completed(self):
        return all(part.is_completed() for part in self._parts)


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
