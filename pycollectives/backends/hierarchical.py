"""Communicators that span several nodes.

Inside a node, ranks talk over shared memory (the host transport); between nodes, over MPI
point-to-point messages (``pycollectives._net``), which run the same ring, tree and direct
schedules, or, where there is no MPI world (torchrun, ``env://``), over torch's gloo on the
rendezvous store (``pycollectives.backends.gloo_net``). A collective on such a communicator is
hierarchical, as in Horovod and NCCL:

- all-reduce: reduce-scatter inside each node, all-reduce of each shard among the ranks with
  the same local rank (one per node), all-gather inside each node;
- reduce-scatter: reduce-scatter inside the node, then among the ranks with the same local rank;
- all-gather: all-gather among the ranks with the same local rank, then inside the node;
- broadcast: among the ranks with the root's local rank, then inside each node;
- reduce: inside each node to the root's local rank, then among those ranks to the root.

Each byte crosses the network once per node rather than once per rank. Where nodes hold
different numbers of ranks, each node speaks through one representative instead
(``pycollectives.backends.hierarchical_uneven``). ``algorithm="ring"``
(or tree, direct) instead runs that schedule flat over all ranks, every link through MPI.

Before any byte of the user's arrays is written, every rank holds every rank's call and reaches
the same verdict on it (``pycollectives.backends.call_check``): a disagreement raises the same
``CollectiveMismatch`` on every rank, never a wrong answer or a wait.

``PYCOLL_RANKS_PER_NODE=k`` splits each machine into nodes of k consecutive ranks, so that this
code runs, and is tested, on one machine; ``k:cyclic`` deals the ranks out round-robin instead
(rank r on node r mod (ranks / k)), as a launcher that places ranks cyclically would.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pycollectives import _C
from pycollectives.backends import Call, call_check
from pycollectives.backends.hierarchical_flat import BlocksAndMessages
from pycollectives.backends.hierarchical_uneven import UnevenNodes
from pycollectives.errors import CollectiveError, CollectiveMismatch
from pycollectives.ops import ALGORITHMS_FOR, AVG, REDUCING, algo_code, collective_code
from pycollectives.runtime.bootstrap import StoreGroup
from pycollectives.runtime.store_board import BoardStoreGroup, board_for, dead_after
from pycollectives.runtime.topology import Topology
from pycollectives.trace import flight
from pycollectives.work import FutureCompletion

# All-reduce shards and all-gather blocks of at most this many bytes travel with the check
# across nodes. Above it the ring between nodes is faster: on 2 nodes x 1 rank here, 43 against
# 38 us at 32 KiB, 90 against 63 us at 64 KiB (benchmarks/check_across_nodes.py, unchecked
# against before).
_RIDE_MAX_BYTES = 16 << 10
_DIRECT = algo_code("direct")


def load_net_transport():
    """The ``_net`` module, checked against the MPI that mpi4py loaded (both must be of one
    family: MPICH and its derivatives, or Open MPI)."""
    try:
        from pycollectives import _net
    except ImportError as e:
        raise CollectiveError(
            "this build has no inter-node transport (it was built with PYCOLL_NET=OFF, or its "
            f"MPI library cannot be loaded: {e}); reinstall pycollectives with the job's MPI "
            "present (pip install mpich mpi4py, or MPI_HOME / mpicc on PATH)"
        ) from None
    from mpi4py import MPI

    vendor = MPI.get_vendor()[0]
    running = "Open MPI" if vendor == "Open MPI" else "MPICH"
    if _net.built_with_mpi in ("MPICH", "Open MPI") and _net.built_with_mpi != running:
        raise CollectiveError(
            f"pycollectives was built against {_net.built_with_mpi} but mpi4py runs {vendor}; "
            "reinstall pycollectives with the MPI the job uses (MPI_HOME, or mpicc on PATH)"
        )
    return _net


class Hierarchical(BlocksAndMessages, UnevenNodes):
    """The collectives of a communicator over several nodes (see the module docstring).

    `host` is this node's shared-memory communicator (a ``_C.HostComm``), `net` the MPI
    transport over all ranks (a ``_net.NetComm``). Every collective checks its arguments
    first, the same way on every rank, then runs its phases in order; collectives run one at
    a time in issue order, asynchronous ones on a worker thread.
    """

    @classmethod
    def connect(cls, group, opts, topology: Topology):
        """Shared memory inside this node; between nodes MPI where `group` has it, else gloo
        over the rendezvous store (``pycollectives.backends.gloo_net``). Collective over
        `group` (`opts` the communicator's ``Options``)."""
        from pycollectives.backends import gathered_or_raise, rendezvous

        rank = group.rank
        if group.mpi is None and not isinstance(group, StoreGroup):
            raise CollectiveError(
                f"a communicator over {topology.num_nodes} nodes needs MPI or a store between "
                "them; launch with mpiexec or torchrun"
            )
        node_group = group.split(topology.node_of[rank], rank)
        host, error = None, None
        try:
            host = rendezvous(node_group, opts)
            host.set_rank_names(topology.nodes[topology.node_of[rank]])  # messages: our ranks
        except (CollectiveError, ValueError) as e:
            error = str(e)
        # One node's failure is every rank's error, not a hang on the other nodes.
        trying = isinstance(group, BoardStoreGroup)  # a try of shrink: all fail alike or none
        try:
            name = None if host is None else host.segment_name
            ident = flight.comm_id(
                gathered_or_raise(group, "cannot set up the nodes", name, error)[0]
            )
        except CollectiveError:
            node_group.free()
            if trying:
                group.lost = True
            raise
        try:
            net, p2p, check = cls._engines(group, opts, topology)
        except Exception as e:  # gloo's own too: a member lost while connecting
            node_group.free()
            if not trying:
                raise
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if trying:
            try:
                gathered_or_raise(group, "cannot connect the survivors", error=error)
            except CollectiveError:
                group.lost = True
                if error is None:
                    node_group.free()
                raise
        flight.attach(host, opts, ident, rank, group.size)  # one directory for every node's ranks
        inter = opts.inter_algorithm or opts.algorithm
        hier = cls(topology, rank, host, net, inter_algo=inter, reproducible=opts.reproducible)
        hier._node_group, hier._p2p, hier._group = node_group, p2p, group
        if not p2p.takes_arrays:  # MPI's engine: blocking batches to other nodes in one call
            p2p.set_nodes(topology.node_of, topology.node_of[rank])
            hier._p2p_run_away = p2p.run_away
        hier.check, hier.checking = check, opts.check_mismatch
        if isinstance(group, StoreGroup):  # revoke, agree and shrink over the store
            hier.board = board_for(group, opts.timeout, hier._revoked)
        return hier

    @staticmethod
    def _engines(group, opts, topology):
        """(collectives, messages, the check across nodes) between nodes: ``_net`` over MPI, or
        gloo over the store. Collective over `group`."""
        if group.mpi is None:
            from pycollectives.backends.gloo_net import GlooCheck, GlooNet, GlooP2P

            net = GlooNet(group, opts.timeout)
            if isinstance(group, BoardStoreGroup):  # a try of shrink: a member may die now
                net.connect_timeout = min(opts.timeout, 3 * dead_after() + 2)
            p2p = GlooP2P(net)  # collective: the gloo group of every rank
            if topology.ranks_per_node is not None:  # and this rank's column's, made by all now
                net.process_group(topology.group(topology.local_of[group.rank]))
            net.connect_timeout = None
            widest = max(len(n) for n in topology.nodes)
            return net, p2p, GlooCheck(net, call_check.status_width(widest))
        _net = load_net_transport()
        mpi = group.mpi
        net = _net.NetComm(mpi, piece_bytes=opts.net_piece_bytes, window=8, timeout=opts.timeout)
        # collective: each duplicates `mpi`
        return net, _net.NetP2P(mpi, opts.timeout), _net.NetCheck(mpi, opts.timeout)

    def __init__(
        self, topology: Topology, rank: int, host, net, inter_algo=None, reproducible=False
    ):
        self._node_group = None
        self._p2p = None  # messages to other nodes
        self._p2p_run_away = None
        self._group = None  # every rank's rendezvous group
        self.topo = topology
        self.rank = rank
        self.size = topology.size
        self.host = host
        self.net = net
        # Reductions flat over all ranks in the direct schedules, which sum in rank order
        # (PYCOLL_REPRODUCIBLE): a node's partial sums would add the ranks out of order.
        self.reproducible = reproducible
        self.nodes = topology.num_nodes
        self.local_size = topology.ranks_per_node  # None: nodes differ (hierarchical_uneven)
        self.even = self.local_size is not None
        self.node = topology.node_of[rank]
        self.local = topology.local_of[rank]
        self.inter_algo = inter_algo
        self._all = list(range(self.size))
        if self.even:  # perm[j * nodes + i] = the rank with local rank j on node i.
            self.perm = np.array(
                [self.topo.nodes[i][j] for j in range(self.local_size) for i in range(self.nodes)]
            )
        else:
            self._uneven_layout()
        self.seq = 0
        self.check = None  # the check across nodes (call_check)
        self.checking = True  # off only to measure its cost (PYCOLL_CHECK_MISMATCH=0)
        self._pool = None
        self._error = None
        self.board = None  # the fault-tolerant board over the store (store_board), if any
        self._flight_call = None  # the next submit's call, for the flight recorder
        self._revoke_reason = None

    # -- running ------------------------------------------------------------------------------

    def submit(self, fn, async_op, collective=True):
        """Runs fn(seq) after every collective issued before it; returns a Work's native handle
        (async_op) or None. Only collectives count in `seq` (every rank runs them); the first
        is #1, as on one node."""
        # The call in the flight recorder of this node's communicator, whose own entries are
        # this call's node-local phases (set by run and barrier; taken whatever happens next).
        what, self._flight_call = self._flight_call, None
        self._check_usable()
        self.seq += int(collective)
        seq = self.seq
        fid = 0 if what is None else self.host.flight_begin(*what, seq, async_op)

        def guarded():
            if async_op:
                self.host.flight_mark(fid, flight.STARTED)
            self._check_usable()
            try:
                fn(seq)
            except CollectiveError as e:
                if self._revoke_reason is None:
                    self.abort(str(e))  # writes the ring, this call in it as it was
                self.host.flight_mark(fid, flight.FAILED)
                if self._revoke_reason is not None:  # what ended the wait, whichever it was
                    raise CollectiveError(f"collective #{seq}: {self._revoke_reason}") from None
                raise
            self.host.flight_mark(fid, flight.ENDED)

        if async_op:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pycoll-hier")
            return FutureCompletion(self._pool.submit(guarded), seq)
        if self._pool is not None:
            self._pool.submit(guarded).result()
        else:
            guarded()
        return None

    def abort(self, reason: str):
        """Unusable from now on: a wait in the shared-memory part ends at once, and every
        message in flight to another node fails."""
        if self._error is None:
            self._error = reason
        self.host.abort(reason)
        if self._p2p is not None:
            self._p2p.abort(reason)

    @property
    def failed(self) -> bool:
        """Unusable after an error, an abort or a revocation."""
        return self._error is not None or self.host.poisoned

    def _revoked(self, by: int):
        """The communicator is revoked by rank `by` (seen on the store by every rank's
        heartbeat thread): every wait of this rank's ends at once, in shared memory or over
        gloo, and every operation raises, naming `by`."""
        who = "this rank" if by == self.rank else f"rank {by}"
        reason = self._revoke_reason = f"the communicator was revoked by {who}"
        if self._error is None:
            self._error = reason
        self.host.abort(reason)
        self.net.abort(reason)
        if self._p2p is not None:
            self._p2p.abort(reason)

    def close(self):
        if self.board is not None:
            self.board.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.check is not None:
            self.check.close()
        if self._p2p is not None:
            self._p2p.close()
            self._p2p = None
        if self._node_group is not None:
            self._node_group.free()
            self._node_group = None

    # -- the backend protocol (pycollectives.backends) ----------------------------------------

    @property
    def timeout(self) -> float:
        return self.host.timeout

    @timeout.setter
    def timeout(self, seconds: float):
        self.host.timeout = seconds
        self.net.timeout = seconds
        if self.check is not None:
            self.check.timeout = seconds
        if self._p2p is not None:
            self._p2p.timeout = seconds

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        return "direct" if self._rank_ordered(collective) else "hierarchical"

    def _local(self, collective, x, out=None, op=0, root=0, outer=None):
        """`collective` among this node's ranks over shared memory, blocking (the node-local
        step of a hierarchical collective), through the host's one way in; `outer` is the
        record of the call it is a phase of (compared by the node's ranks with its own)."""
        self.host.run_call(Call(collective, x, out, op, root), outer)

    def _rank_ordered(self, collective, asked=None) -> bool:
        """Whether `collective` runs in rank order: `asked` (a call's reproducible=), else
        this communicator's setting."""
        on = self.reproducible if asked is None else asked
        return bool(on) and collective in REDUCING

    def run(self, call):
        """Runs a ``backends.Call``; algorithm code 0 means hierarchical, others flat."""
        c = call.collective
        if self._rank_ordered(c, call.reproducible):  # before the record: ranks that disagree
            # raise there
            call = call._replace(algorithm=_DIRECT)
        a = None if call.algorithm == 0 else _C.ALGORITHMS[call.algorithm]
        # The caller's error, or these (the record: this call as every rank must make it).
        count, dtype, record = _C.call_record(call, self.rank, self.size, self.seq + 1)
        record = record if self.checking else None
        root = call.root if c in ("broadcast", "reduce", "gather", "scatter") else 0
        self._flight_call = (collective_code(c), count, dtype, call.op, root)
        try:
            return self._dispatch(call, a, count, dtype, record)
        finally:
            self._flight_call = None  # a call refused before its submit leaves nothing behind

    def _dispatch(self, call, a, count, dtype, record):
        c = call.collective
        if a is not None or c in ("all_to_all", "gather", "scatter") or call.counts is not None:
            return self.flat(call, a, count, dtype, record)
        if not self.even:  # and no algorithm named (flat above)
            uneven = getattr(self, f"{c}_uneven", None)
            if uneven is None:
                raise CollectiveError(f"{c}: unknown collective")
            return uneven(call, count, dtype, record)
        if c == "all_reduce":
            return self.all_reduce(call, count, dtype, record)
        if c == "reduce_scatter":
            return self.reduce_scatter(call, count, dtype, record)
        if c == "all_gather":
            return self.all_gather(call, count, dtype, record)
        if c == "broadcast":
            return self.broadcast(call, count, dtype, record)
        if c == "reduce":
            return self.reduce(call, count, dtype, record)
        raise CollectiveError(f"{c}: unknown collective")

    def _check_usable(self):
        if self._error is None and self._p2p is not None and self._p2p.error is not None:
            self.abort(self._p2p.error)  # a message to another node failed
        if self._error is not None:
            raise CollectiveError(f"communicator is unusable after an earlier error: {self._error}")

    def _inter(self, collective, nbytes):
        forced = self.inter_algo
        if forced is not None and forced in ALGORITHMS_FOR[collective]:
            return forced
        return "ring"

    def _net(self, collective, algo, group, x, out, count, dtype, op, root, seq):
        divisor = len(group) if op == int(AVG) else 1
        self.net.run(collective, algo, group, x, out, count, dtype, op, root, divisor, seq)

    # -- the check across nodes (call_check) ---------------------------------------------------

    def node_status(self, record, first_phase=None):
        """This node's status for the call `record` (None: not checked): from its first
        node-local phase, `first_phase(record)`, or a barrier of the node's ranks. A
        disagreement there is not raised yet: the status says who called what."""
        if record is None:
            if first_phase is not None:
                first_phase(None)
            return None
        try:
            if first_phase is None:
                self.host.barrier(False, record)
            else:
                first_phase(record)
        except CollectiveMismatch:
            return call_check.each_status(self.host.outer_records(self.host.seq))
        return call_check.same_status(record)

    def column_check(self, status, seq):
        """Every node's status, from the members of this rank's column (every rank where nodes
        differ); raises the verdict."""
        if status is None:
            return
        if not self.even:  # no column reaches every node: every rank's, one per node read
            statuses = self.check.exchange(self._all, f"collective #{seq}", status)
            call_check.verdict([statuses[n[0]] for n in self.topo.nodes], self.topo.nodes)
            return
        column = self.topo.group(self.local)
        statuses = self.check.exchange(column, f"collective #{seq}", status)
        call_check.verdict(statuses, self.topo.nodes)

    def checked(self, record, seq):
        """The whole check, for a call whose first step is not node-local."""
        self.column_check(self.node_status(record), seq)

    def ride_reduce(self, status, what, part, dtype, op):
        """The check across nodes with `part` riding along: every member of this rank's column
        reduces every member's, in node order, into `part`, so the check costs no message of
        its own; raises the verdict. `status` None: unchecked (the shards still ride)."""
        column = self.topo.group(self.local)
        divisor = len(column) if op == int(AVG) else 1
        statuses, reduced = self.check.exchange_reduce(
            column, what, status or b"", part, part, dtype, op, divisor
        )
        # Reduced: every node's status is ours; only its kind is left to look at.
        if status is not None and not (reduced and call_check.is_same(status)):
            call_check.verdict(statuses, self.topo.nodes)
        if not reduced:
            raise CollectiveMismatch(f"{what}: shards between nodes differ")

    def ride_gather(self, status, what, block, out):
        """The check across nodes with `block` riding along: member k of this rank's column's
        lands in `out`'s k-th block; raises the verdict."""
        column = self.topo.group(self.local)
        statuses, sizes_ok = self.check.exchange_into(column, what, status, block, out)
        call_check.verdict(statuses, self.topo.nodes)
        if not sizes_ok:
            raise CollectiveMismatch(f"{what}: blocks between nodes differ")

    # -- collectives ------------------------------------------------------------------------
    # Each takes a checked Call (its count and dtype code, and its record: None when unchecked)
    # and runs it hierarchically; a named algorithm runs flat (BlocksAndMessages.flat). No
    # byte of the user's arrays is written before the check across nodes has passed.

    def all_reduce(self, call, count, dtype, record):
        x, out, op, async_op = call.x, call.out, call.op, call.async_op
        res = x if out is None else out

        def run(seq):
            L = self.local_size
            shard = -(-count // L)
            flat_x, flat_res = x.reshape(-1), res.reshape(-1)
            padded = shard * L != count
            if padded:
                src = np.zeros(shard * L, x.dtype)
                src[:count] = flat_x
            else:
                src = flat_x
            part = np.empty(shard, x.dtype)
            status = self.node_status(
                record, lambda outer: self._local("reduce_scatter", src, part, op, outer=outer)
            )
            column = self.topo.group(self.local)
            nbytes = shard * x.itemsize
            if self._rides(nbytes):
                self.ride_reduce(status, f"all_reduce #{seq}", part, dtype, op)
            else:
                self.column_check(status, seq)
                algo = self._inter("all_reduce", nbytes)
                self._net("all_reduce", algo, column, part, part, shard, dtype, op, 0, seq)
            if padded:
                full = np.empty(shard * L, x.dtype)
                self._local("all_gather", part, full, outer=record)
                flat_res[:] = full[:count]
            else:
                self._local("all_gather", part, flat_res, outer=record)

        return self.submit(run, async_op)

    def _rides(self, nbytes):
        """Whether `nbytes` per rank go with the check (over MPI, the inter-node algorithm not
        forced): one message to every other node, fewer hops than a ring's."""
        return (
            self.even
            and self.inter_algo is None
            and nbytes <= _RIDE_MAX_BYTES
            and hasattr(self.check, "exchange_reduce")
        )

    def reduce_scatter(self, call, m, dtype, record):
        x, out, op, async_op = call.x, call.out, call.op, call.async_op

        def run(seq):
            # Blocks regrouped by local rank: local rank j reduces the blocks of every rank
            # with local rank j, then those ranks reduce them across nodes.
            y = x.reshape(self.size, m)[self.perm]
            z = np.empty(self.nodes * m, x.dtype)
            status = self.node_status(
                record,
                lambda outer: self._local("reduce_scatter", y.reshape(-1), z, op, outer=outer),
            )
            self.column_check(status, seq)
            algo = self._inter("reduce_scatter", m * x.itemsize)
            self._net("reduce_scatter", algo, self.topo.group(self.local), z, out.reshape(-1),
                      m, dtype, op, 0, seq)  # fmt: skip

        return self.submit(run, async_op)

    def all_gather(self, call, m, dtype, record):
        x, out, async_op = call.x, call.out, call.async_op

        def run(seq):
            flat_out = out.reshape(-1)
            z = np.empty(self.nodes * m, x.dtype)
            column = self.topo.group(self.local)
            status = self.node_status(record)
            if status is not None and self._rides(m * x.itemsize):
                # What lands is the all-gather between nodes.
                self.ride_gather(status, f"all_gather #{seq}", x.reshape(-1), z)
            else:
                self.column_check(status, seq)
                algo = self._inter("all_gather", m * x.itemsize)
                self._net("all_gather", algo, column, x.reshape(-1), z, m, dtype, 0, 0, seq)
            y = np.empty(self.size * m, x.dtype)
            self._local("all_gather", z, y, outer=record)
            flat_out.reshape(self.size, m)[self.perm] = y.reshape(self.size, m)

        return self.submit(run, async_op)

    def broadcast(self, call, count, dtype, record):
        x, root, async_op = call.x, call.root, call.async_op

        def run(seq):
            flat = x.reshape(-1)
            status = self.node_status(record)
            root_node, root_local = self.topo.node_of[root], self.topo.local_of[root]
            nbytes = count * x.itemsize
            if status is not None and self.local == root_local and self._rides(nbytes):
                # The root's column: every member's vector rides with the statuses (one
                # message to every other node instead of the check's and the broadcast's).
                z = np.empty(self.nodes * count, x.dtype)
                self.ride_gather(status, f"broadcast #{seq}", flat, z)
                if self.topo.node_of[self.rank] != root_node:
                    flat[:] = z[root_node * count : (root_node + 1) * count]
            else:
                self.column_check(status, seq)
                if self.local == root_local:
                    algo = self._inter("broadcast", nbytes)
                    self._net("broadcast", algo, self.topo.group(root_local), flat, flat, count,
                              dtype, 0, root_node, seq)  # fmt: skip
            self._local("broadcast", flat, root=root_local, outer=record)

        return self.submit(run, async_op)

    def reduce(self, call, count, dtype, record):
        x, out, root, op, async_op = call.x, call.out, call.root, call.op, call.async_op
        res = x if out is None else out

        def run(seq):
            flat_x, flat_res = x.reshape(-1), res.reshape(-1)
            root_node, root_local = self.topo.node_of[root], self.topo.local_of[root]
            part = np.empty(count, x.dtype)
            status = self.node_status(
                record, lambda outer: self._local("reduce", flat_x, part, op, root_local, outer)
            )
            nbytes = count * x.itemsize
            if status is not None and self.local == root_local and self._rides(nbytes):
                # The root's column: the partial sums ride with the statuses, reduced by each.
                self.ride_reduce(status, f"reduce #{seq}", part, dtype, op)
                if self.rank == root:
                    flat_res[:] = part
                return
            self.column_check(status, seq)
            if self.local == root_local:
                algo = self._inter("reduce", nbytes)
                self._net("reduce", algo, self.topo.group(root_local), part, flat_res, count,
                          dtype, op, root_node, seq)  # fmt: skip

        return self.submit(run, async_op)

    def barrier(self, async_op):
        """Every rank's arrival, in the check across nodes itself: this node's ranks meet in
        its first step, every node's status reaches every rank in its second."""
        checking = self.checking
        self._flight_call = (flight.BARRIER, 0, 0, 0, 0)

        def run(seq):
            record = _C.barrier_record(seq) if checking else None
            if record is not None:
                self.checked(record, seq)
                return
            self.host.barrier(False)
            if self.local == 0 and self.nodes > 1:
                token = np.zeros(1, np.int8)
                self._net("all_reduce", "ring", self.topo.group(0), token, token, 1, 0, 0, 0, seq)
            self.host.barrier(False)

        return self.submit(run, async_op)
