"""The communicator: rendezvous once, then every operation dispatched to one backend."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np

from pycollectives import trace
from pycollectives.backends import Call, HostBackend, P2POp
from pycollectives.backends.hierarchical import Hierarchical
from pycollectives.errors import CollectiveError, CollectiveMismatch
from pycollectives.ops import SUM, algo_code, collective_code, op_code
from pycollectives.options import Options, checked_timeout
from pycollectives.runtime import arrays, bootstrap, shared
from pycollectives.runtime.store_board import BoardStoreGroup, StoreBoard
from pycollectives.runtime.topology import Topology, ranks_per_node_from_env
from pycollectives.work import InFlight, Work

# What every rank contributes when the first GPU collective starts the CUDA transport.
_GPU_HANDSHAKE = b"pycollectives:cuda-transport-v1"
# Native codes of the collectives that take the one-step path (Communicator._run_now).
_AR, _RS, _AG, _BC, _RED = map(
    collective_code, ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
)


def _flag(value):
    """A call's reproducible=: None (the communicator's setting), True or False."""
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"reproducible must be True, False or None, got {value!r}")


def _not_now(*args) -> bool:
    """The one-step path where there is none (several nodes, closed, traced): never taken."""
    return False


class Communicator:
    """A group of ranks that run collectives and exchange messages.

    Made from an mpi4py communicator (``MPI.COMM_WORLD`` by default); under torchrun or another
    ``env://`` launcher (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) the ranks
    meet through torch's ``TCPStore`` instead (see ``pycollectives.runtime.bootstrap``).
    Creating it is collective: the ranks of each machine exchange the names of their
    shared-memory segments once; after that, operations on one machine never go through MPI. Over
    several machines (nodes) collectives are hierarchical: shared memory inside each node, MPI
    between nodes (``pycollectives.backends.hierarchical``). CUDA arrays run over CUDA IPC
    (``pycollectives.backends.cuda``).

    Args:
        mpi_comm: an ``mpi4py.MPI.Comm``; defaults to the launch's world.
        timeout: seconds any operation may wait for a peer before raising
            ``CollectiveTimeout`` (env ``PYCOLL_TIMEOUT``, default 300).
        staging_bytes: size of one staging slot; messages are pipelined through slots of this
            size (env ``PYCOLL_STAGING_BYTES``, default 256 KiB).
        staging_slots: slots per peer channel (env ``PYCOLL_STAGING_SLOTS``, default 4).
        reproducible: every reduction (all-reduce, reduce-scatter, reduce) sums each element
            in rank order, ``((x0 + x1) + x2) + ...`` in the accumulation type, so its result's
            bits depend on the ranks' inputs alone, not on the algorithm, path, slot or block
            sizes or node placement (env ``PYCOLL_REPRODUCIBLE``, default off). Reductions
            then run the direct schedules (or the shared buffers', which sum in that order),
            whatever ``algorithm=`` says; across nodes, flat over all ranks.

    Every other knob is read once from the environment (``pycollectives.options``). Every rank
    must call the same collectives in the same order, with matching sizes, dtype, op and root;
    a disagreement raises ``CollectiveMismatch``. Example::

        comm = pc.Communicator()
        x = np.arange(8, dtype=np.float32)
        comm.all_reduce(x, op="sum")              # in place
        out = np.empty(8 * comm.size, np.float32)
        comm.all_gather(x, out)                   # rank-major
        comm.close()
    """

    def __init__(
        self, mpi_comm=None, *, timeout=None, staging_bytes=None, staging_slots=None,
        reproducible=None,
    ):  # fmt: skip
        self.options = Options.resolve(
            timeout=timeout,
            staging_bytes=staging_bytes,
            staging_slots=staging_slots,
            reproducible=reproducible,
        )
        self._host = self._host_run = None
        self._run_now = _not_now
        self._cuda = None  # the CUDA transport, made by the first operation on GPU arrays
        self._cuda_error = None
        self._staged = None  # send/recv of GPU arrays, made by the first one
        self._group = bootstrap.world(mpi_comm, self.options.timeout)
        try:
            self.topology = Topology.of_group(self._group, *ranks_per_node_from_env())
            if self.topology.num_nodes == 1:
                self._host = HostBackend(self._group, self.options)
            else:
                self._host = Hierarchical.connect(self._group, self.options, self.topology)
        except BaseException:
            self._group.free()
            raise
        self.rank, self.size = self._group.rank, self._group.size
        self.previous_ranks = None  # set by shrink
        self._inflight = InFlight()
        # One machine: numpy calls go straight to the host backend's native run (_host_run,
        # see _run), and a blocking call on numpy arrays with no conversion to make runs in one
        # native step (_run_now: False when the call is not that, and the general path takes
        # it; once the CUDA communicator exists, blocking calls on cupy arrays too: see
        # _open_cuda). Traced, every call goes through _run, where it is recorded.
        if isinstance(self._host, HostBackend):
            self._host_run = self._host.run
            if not trace.enabled():
                self._run_now = self._host.c.run_now
                arrays.torch_to_core()  # torch CPU tensors too, where torch is loaded
        trace.instrument(self)  # PYCOLL_TRACE: a timeline of this communicator's calls

    @classmethod
    def local(cls, n: int, **kw) -> list:
        """`n` communicators whose ranks are threads of this process (as NCCL's
        ``ncclCommInitAll`` serves one process driving several devices): ``comms[r]`` is rank
        r, to be used by one thread each. Collectives run over shared memory as between
        processes, with the GIL released while they move data. Keyword arguments as for
        ``Communicator``. Example::

            comms = pc.Communicator.local(4)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda c: c.all_reduce(x[c.rank]), comms))
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"Communicator.local needs a positive number of ranks, got {n!r}")
        timeout = Options.resolve(timeout=kw.get("timeout")).timeout
        shared = bootstrap.ThreadGroup.shared(n)
        groups = [bootstrap.ThreadGroup(r, shared, timeout) for r in range(n)]
        made, errors = [None] * n, [None] * n

        def make(r):
            try:
                made[r] = cls(groups[r], **kw)
            except BaseException as e:  # the others must not wait for this one
                errors[r] = e
                groups[r].abort()

        threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [e for e in errors if e is not None]
        if failed:
            for c in made:
                if c is not None:
                    c.close()
            raise failed[0]
        return made

    # -- lifetime -----------------------------------------------------------------------------

    def close(self):
        """Waits for asynchronous work, then releases the shared memory. Later calls raise
        CollectiveError."""
        if self._host is None:
            return
        try:
            while True:  # on a failed communicator, the errors of work in flight are known
                try:
                    self._inflight.wait_all()
                    break
                except CollectiveError:
                    if not self._host.failed:
                        raise
            if self._cuda is not None:
                try:  # what a blocking GPU call's device wait left, if no later call raised it
                    self._cuda.check()
                except CollectiveError:
                    if not self._host.failed:
                        raise
                self._cuda.close()  # collective: no peer still reads this rank's GPU memory
        finally:
            self._cuda = self._host_run = self._staged = None
            self._run_now = _not_now
            self._host.close()
            self._host = None
            self._group.free()
            if trace.enabled():
                trace.write()

    def split(self, color, key=None, **kw):
        """A communicator of the ranks that pass the same `color`, ranked by `key` (default:
        their rank here) then by rank, as ``MPI_Comm_split`` and ``ncclCommSplit``; None on a
        rank whose color is None (or negative). Collective over this communicator. The new
        one has shared memory of its own and, over several nodes, the nodes its ranks are on:
        shared memory among the ranks of one node, MPI (or, under torchrun, gloo) between
        nodes. Keyword arguments as for ``Communicator``; by default this one's timeout and
        staging. Example (the ranks of each node, and one rank per node)::

            node = comm.split(comm.topology.node_of[comm.rank])
            leaders = comm.split(0 if node.rank == 0 else None)
        """
        self._backend()  # not closed
        group = self._group.split(color, self.rank if key is None else key)
        if group is None:
            return None
        kw = self._made_like_this(kw)
        return Communicator(group, **kw)

    def abort(self, reason: str = "aborted by the application"):
        """Makes this rank's communicator unusable at once (as ``ncclCommAbort``): an
        operation waiting in it, on any thread, raises CollectiveError, and so does every later
        one. Peers waiting for this rank see its silence as usual (timeout)."""
        self._backend().abort(reason)

    # -- after a failure ------------------------------------------------------------------------

    def revoke(self):
        """Revokes the communicator, as ``MPIX_Comm_revoke``: every operation of every rank on
        it, waiting now or started later, raises CollectiveError at once, instead of waiting
        for a rank that will not come. Call it when this rank saw a failure its peers may not
        see (a dead peer it alone waited for); then ``shrink``. Only ``agree`` and ``shrink``
        still work on a revoked communicator. On one machine and across nodes (over the store);
        the error names the first rank that revoked."""
        self._board("revoke").revoke()

    def agree(self, flag: int) -> int:
        """The bitwise AND of `flag` over the ranks still running, the same on each of them,
        as ``MPIX_Comm_agree``: a rank that has exited is left out, one that exits during the
        call is left out or counted alike on every rank. Works on a revoked or failed
        communicator: what a training loop asks to decide whether every survivor finished a
        step. Every running rank must call it; it waits up to the timeout for each."""
        if not isinstance(flag, (int, np.integer)) or not 0 <= flag < 2**64:
            raise ValueError(f"agree takes an int in [0, 2**64), got {flag!r}")
        result = 2**64 - 1
        for _, value, _ in self._board("agree").board_exchange(int(flag)):
            result &= value
        return result

    def shrink(self, **kw):
        """A new communicator of the ranks of this one that are still running, in their order
        here, as ``MPIX_Comm_shrink`` and ``ncclCommShrink``. Collective over the survivors,
        on shared memory alone (no MPI call: the MPI world may be unusable after a death); a
        rank that dies while it runs is left out too. ``previous_ranks`` of the new
        communicator lists each of its ranks' rank here. This one stays revoked or failed:
        close it. Keyword arguments as for ``Communicator``; by default this one's. Example::

            try:
                comm.all_reduce(grad)
            except CollectiveError:
                comm.revoke()              # peers still waiting stop at once
                comm, old = comm.shrink(), comm
                old.close()
        """
        board = self._board("shrink")
        kw = self._made_like_this(kw)
        for _ in range(self.size):  # each new try follows a death
            members = [rank for rank, _, _ in board.board_exchange(1)]
            if isinstance(board, StoreBoard):  # between nodes: on a board of their own
                prefix = f"{board.prefix}/shrink{board.rounds}"
                group = BoardStoreGroup(board.group_store, board.instances, members, self.rank,
                                        prefix, kw["timeout"])  # fmt: skip
            else:
                group = bootstrap.BoardGroup(board, members, self.rank)
            try:
                made = Communicator(group, **kw)
            except CollectiveError:
                if not group.lost:
                    raise
                continue
            made.previous_ranks = tuple(members)
            return made
        raise CollectiveError("shrink: every try lost a rank")  # not reached: ranks are finite

    def grow(self, **kw):
        """A communicator of this one's ranks (first, in their order) and the processes
        waiting to join the job (``python -m pycollectives.launch --elastic --replace`` starts
        one for each rank that dies; its ``Communicator()`` waits to be taken in), or None when
        none waits. Collective; call it where a new rank can start, at a step boundary, and
        hand the newcomers the state they need (``broadcast``). In a job started by
        ``pycollectives.launch --elastic``: on one machine newcomers ask through files
        (``PYCOLL_RENDEZVOUS``), across machines (``--nnodes``) through the job's store, as
        any process started with ``PYCOLL_JOIN=1`` and the job's ``MASTER_ADDR`` and
        ``MASTER_PORT`` does. This one stays usable: close it once the new one is in use.
        Keyword arguments as for ``Communicator``."""
        import uuid
        from pathlib import Path

        from pycollectives.checkpoint import write_atomically

        self._backend()
        folder = os.environ.get("PYCOLL_RENDEZVOUS", "")
        store = getattr(self._group, "store", None)
        if not folder and store is not None:
            return self._grow_over_store(store, self._made_like_this(kw))
        if not folder:
            raise CollectiveError(
                "grow: new ranks join a job started by python -m pycollectives.launch --elastic "
                "(PYCOLL_RENDEZVOUS is not set, and the ranks did not meet through a store)"
            )
        where = Path(folder) / "join"
        plan = None
        if self.rank == 0:
            waiting = sorted(p.name[:-4] for p in where.glob("*.req")) if where.is_dir() else []
            plan = (waiting, f"grow-{uuid.uuid4().hex[:12]}")

        def admit(name, answer):
            write_atomically(where / f"{name}.admit", lambda f: f.write(answer.encode()))
            (where / f"{name}.req").unlink(missing_ok=True)

        admitted = self._admit(plan, admit)
        if admitted is None:
            return None
        size, prefix = admitted
        kw = self._made_like_this(kw)
        group = bootstrap.FileGroup(folder, self.rank, size, prefix, kw["timeout"])
        return Communicator(group, **kw)

    def _grow_over_store(self, store, kw: dict):
        """grow where the ranks meet through a store: rank 0 takes in every process that has
        asked under a ticket (``StoreGroup.join``), in ticket order, and answers each."""
        import uuid

        join = bootstrap.JOIN
        plan = None
        if self.rank == 0:
            taken = store.add(f"{join}/taken", 0)
            waiting = []
            for ticket in range(taken + 1, store.add(f"{join}/tickets", 0) + 1):
                if not store.check([f"{join}/ask/{ticket}"]):
                    break  # a ticket taken, its request not yet written: from it next time
                waiting.append(ticket)
            plan = (waiting, f"pycollectives/grow-{uuid.uuid4().hex[:12]}")
        admitted = self._admit(plan, lambda ticket, text: store.set(f"{join}/admit/{ticket}", text))
        if admitted is None:
            return None
        size, prefix = admitted
        if self.rank == 0:
            store.add(f"{join}/taken", size - self.size)
        group = bootstrap.StoreGroup(self.rank, size, store, prefix, kw["timeout"])
        return Communicator(group, **kw)

    def _admit(self, plan, admit):
        """grow's answer to the processes waiting to join: `plan` is rank 0's (the waiting
        processes in the order they join, the new communicator's prefix), which every rank
        receives. Rank 0 hands each its rank, the new size and the prefix, as JSON
        (``admit(who, answer)``). Returns (new size, prefix), or None where none waits."""
        import json

        waiting, prefix = self.broadcast_object(plan, root=0)
        if not waiting:
            return None
        size = self.size + len(waiting)
        if self.rank == 0:
            for i, who in enumerate(waiting):
                admit(who, json.dumps({"rank": self.size + i, "size": size, "prefix": prefix}))
        return size, prefix

    def _made_like_this(self, kw: dict) -> dict:
        """Keyword arguments of a communicator made from this one (split, shrink, grow): `kw`
        over this one's timeout and staging."""
        o = self.options
        return {"timeout": o.timeout, "staging_bytes": o.staging_bytes,
                "staging_slots": o.staging_slots, "reproducible": o.reproducible,
                **kw}  # fmt: skip

    def _board(self, what: str):
        """The fault-tolerant board: shared memory on one machine, the store between nodes
        met through one (``runtime.store_board``)."""
        host = self._backend()
        if isinstance(host, HostBackend):
            return host.c
        board = getattr(host, "board", None)
        if board is None:
            raise CollectiveError(
                f"{what}: this communicator spans {self.topology.num_nodes} nodes under "
                "mpiexec; revoke, agree and shrink work on one machine, or between machines "
                "that meet through a store (torchrun, python -m pycollectives.launch --elastic "
                "--nnodes); under mpiexec the job restarts (pycollectives.launch --max-restarts)"
            )
        return board

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Interpreter shutdown may have torn down MPI already; the mapping goes with the process.
        self._host = None

    def _backend(self):
        if self._host is None:
            raise CollectiveError("the communicator is closed")
        return self._host

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        """The algorithm ``algorithm=None`` picks for `collective` on `nbytes` of input
        ("hierarchical" on a communicator over several nodes)."""
        return self._backend().algorithm_for(collective, nbytes)

    @property
    def timeout(self) -> float:
        """Seconds an operation may wait for a peer."""
        return self._backend().timeout

    @timeout.setter
    def timeout(self, seconds: float):
        seconds = checked_timeout(seconds)
        self._backend().timeout = seconds
        if self._cuda is not None:
            self._cuda.timeout = seconds

    @property
    def staging_bytes(self) -> int:
        """Bytes of one host staging slot: as asked (``staging_bytes=``,
        ``PYCOLL_STAGING_BYTES``), else 256 KiB, or less where /dev/shm is small."""
        backend = self._backend()
        native = getattr(backend, "c", None) or getattr(backend, "host", None)
        return self.options.staging_bytes if native is None else native.slot_bytes

    @property
    def seq(self) -> int:
        """Number of collectives this rank has started (host and GPU arrays alike)."""
        gpu = 0 if self._cuda is None else self._cuda.seq
        return self._backend().seq + gpu

    # -- dispatch -----------------------------------------------------------------------------

    def _run(self, call: Call, result):
        """Runs `call` on the backend of its arrays; returns `result`, or a Work."""
        x, out = call.x, call.out
        if (
            self._host_run is not None
            and type(x) is np.ndarray
            and call.stream is None
            and (out is None or type(out) is np.ndarray)
        ):  # numpy arrays, the common case: straight to the shared-memory transport
            handle = self._host_run(call)
        else:
            backend, call = self._backend_for(call)
            handle = backend.run(call)
        return self._finish(handle, (x, out), result, call.async_op)

    def _finish(self, handle, held, result, async_op):
        if handle is None:
            return result
        work = Work(handle, held, result)
        self._inflight.add(work)  # its arrays stay alive until it completes
        return work if async_op else result

    def _backend_for(self, call: Call):
        """(the backend of `call`'s arrays, the call as that backend takes it)."""
        host = self._backend()
        if arrays.is_cuda_array(call.x) or arrays.is_cuda_array(call.out):
            if self._cuda is None:
                self._start_cuda(call)
            return self._cuda, call
        if call.stream is not None:
            raise TypeError("stream= applies to CUDA arrays; these are host arrays")
        if arrays.torch_loaded():  # torch CPU tensors: their memory, seen as numpy arrays
            arrays.torch_to_core()  # ... and from the next call on, blocking ones in one step
            call = call._replace(x=arrays.host_view(call.x), out=arrays.host_view(call.out))
        return host, call

    # -- collectives --------------------------------------------------------------------------
    # Each takes algorithm= ("ring", "tree", "direct"; None: automatic), then async_op= and
    # stream= by keyword only (CudaComm's collectives take the same arguments in the same
    # order): with async_op=True it returns a Work instead of the output array. numpy arrays
    # (and torch CPU tensors) run over shared memory (and MPI between nodes); CUDA arrays
    # (cupy, torch, any ``__cuda_array_interface__`` or DLPack) on the GPU, queued on `stream`
    # (default: the array library's current stream); the call returns without waiting for the
    # GPU.

    def all_reduce(
        self, x, out=None, op=SUM, algorithm=None, *, async_op=False, stream=None,
        reproducible=None,
    ):  # fmt: skip
        """Reduces `x` over all ranks; every rank gets the result in `out` (default: in `x`),
        bitwise identical on every rank. Returns the output array. `reproducible` (True or
        False; None: the communicator's setting) sums every element in rank order, whatever
        the algorithm and path (see ``Communicator``)."""
        if reproducible is None and self._run_now(_AR, x, out, op, 0, algorithm, async_op, stream):
            return x if out is None else out
        op, algorithm = op_code(op), algo_code(algorithm)
        call = Call("all_reduce", x, out, op, 0, algorithm, async_op, stream,
                    reproducible=_flag(reproducible))  # fmt: skip
        return self._run(call, x if out is None else out)

    def reduce_scatter(
        self, x, out, op=SUM, counts=None, algorithm=None, *, async_op=False, stream=None,
        reproducible=None,
    ):  # fmt: skip
        """Reduces `x` over all ranks; rank r gets block r in `out`. Blocks are ``out.size``
        elements each, or ``counts[r]`` (a list of per-rank sizes, ``x.size == sum(counts)``).
        `reproducible` as for ``all_reduce``."""
        if (
            counts is None
            and reproducible is None
            and self._run_now(_RS, x, out, op, 0, algorithm, async_op, stream)
        ):
            return out
        counts = _sizes(counts, "counts")
        op, algorithm = op_code(op), algo_code(algorithm)
        call = Call("reduce_scatter", x, out, op, 0, algorithm, async_op, stream, counts,
                    reproducible=_flag(reproducible))  # fmt: skip
        return self._run(call, out)

    def all_gather(self, x, out, counts=None, algorithm=None, *, async_op=False, stream=None):
        """Gathers every rank's `x` into `out`, rank-major: ``size * x.size`` elements, or
        ``sum(counts)`` with rank r contributing ``counts[r]``."""
        if counts is None and self._run_now(_AG, x, out, 0, 0, algorithm, async_op, stream):
            return out
        counts, algorithm = _sizes(counts, "counts"), algo_code(algorithm)
        call = Call("all_gather", x, out, 0, 0, algorithm, async_op, stream, counts)
        return self._run(call, out)

    def broadcast(self, x, root=0, algorithm=None, *, async_op=False, stream=None):
        """Copies the root's `x` into `x` on every rank."""
        if self._run_now(_BC, x, None, 0, root, algorithm, async_op, stream):
            return x
        algorithm = algo_code(algorithm)
        call = Call("broadcast", x, None, 0, root, algorithm, async_op, stream)
        return self._run(call, x)

    def reduce(
        self, x, out=None, root=0, op=SUM, algorithm=None, *, async_op=False, stream=None,
        reproducible=None,
    ):  # fmt: skip
        """Reduces `x` over all ranks into the root's `out` (default: the root's `x`).
        Elsewhere `out` is checked but not written. Returns the output array. `reproducible`
        as for ``all_reduce``."""
        if reproducible is None and self._run_now(
            _RED, x, out, op, root, algorithm, async_op, stream
        ):
            return x if out is None else out
        op, algorithm = op_code(op), algo_code(algorithm)
        call = Call("reduce", x, out, op, root, algorithm, async_op, stream,
                    reproducible=_flag(reproducible))  # fmt: skip
        return self._run(call, x if out is None else out)

    def all_to_all(
        self, x, out, in_splits=None, out_splits=None, algorithm=None, *, async_op=False,
        stream=None,
    ):  # fmt: skip
        """Block j of `x` goes to rank j; `out` receives rank i's block as block i. Blocks are
        ``x.size / size`` elements, or as `in_splits` (what this rank sends to each rank) and
        `out_splits` (what it receives from each) say."""
        call = Call("all_to_all", x, out, 0, 0, algo_code(algorithm), async_op, stream,
                    in_splits=_sizes(in_splits, "in_splits"),
                    out_splits=_sizes(out_splits, "out_splits"))  # fmt: skip
        return self._run(call, out)

    def gather(self, x, out=None, root=0, algorithm=None, *, async_op=False, stream=None):
        """Gathers every rank's `x` into the root's `out` (``size * x.size``, rank-major);
        `out` is None off the root."""
        algorithm = algo_code(algorithm)
        call = Call("gather", x, out, 0, root, algorithm, async_op, stream)
        return self._run(call, out)

    def scatter(self, x, out, root=0, algorithm=None, *, async_op=False, stream=None):
        """Block r of the root's `x` (``size * out.size`` elements) goes to rank r's `out`;
        `x` is None off the root."""
        algorithm = algo_code(algorithm)
        call = Call("scatter", x, out, 0, root, algorithm, async_op, stream)
        return self._run(call, out)

    def barrier(self, async_op=False):
        """Returns once every rank has entered the barrier (after this rank's earlier work).
        Once GPU collectives have run, a blocking barrier also waits until this rank's GPU
        collectives have finished on the device."""
        backend = self._backend()
        if self._cuda is not None and not async_op:
            self._cuda.barrier()
        return self._finish(backend.barrier(async_op), (), None, async_op)

    # -- point to point -----------------------------------------------------------------------
    # Messages between two ranks with one tag arrive in the order they were sent; different
    # tags may be received in any order. A size or dtype mismatch between the ends raises
    # CollectiveMismatch on both.

    def send(self, x, dst, tag=0, async_op=False, stream=None):
        """Sends `x` to rank `dst` (returns once `x` may be reused, or a Work)."""
        return self.batch_p2p([P2POp("send", x, dst, tag)], async_op, stream, x)

    def recv(self, out, src, tag=0, async_op=False, stream=None):
        """Receives from rank `src` into `out`. Returns `out`, or a Work."""
        return self.batch_p2p([P2POp("recv", out, src, tag)], async_op, stream, out)

    def batch_p2p(self, ops, async_op=False, stream=None, _result=None):
        """Starts every ``P2POp`` in `ops` at once and returns one Work for all of them
        (blocking: waits for all), as torch's ``batch_isend_irecv``."""
        ops = list(ops)
        numpy = True
        for o in ops:
            if type(o) is not P2POp:
                raise TypeError(f"batch_p2p takes a list of pycollectives.P2POp, got {o!r}")
            numpy = numpy and type(o.array) is np.ndarray
        host = self._backend()
        if numpy and stream is None:  # the common case: straight to the host backend
            handle = host.p2p(ops, async_op) if ops else None
        elif any(arrays.is_cuda_array(o.array) for o in ops):
            handle = self._staged_p2p().run(ops, async_op, stream)
        elif stream is not None:
            raise TypeError("stream= applies to CUDA arrays; these are host arrays")
        else:  # torch CPU tensors are seen as numpy arrays; anything else, the native error
            ops = [P2POp(o.kind, arrays.host_view(o.array), o.peer, o.tag) for o in ops]
            handle = host.p2p(ops, async_op)
        if handle is None:
            return _result
        return self._finish(handle, tuple(o.array for o in ops), _result, async_op)

    def _staged_p2p(self):
        """send/recv of GPU arrays: through page-locked host memory (``cuda_p2p``)."""
        if self._staged is None:
            from pycollectives.backends.cuda.env import _native
            from pycollectives.backends.cuda.p2p import StagedP2P

            try:
                native = _native()
            except ImportError as e:
                raise CollectiveError(f"send/recv of CUDA arrays: no CUDA support ({e})") from e
            self._staged = StagedP2P(
                self._backend().p2p, self.rank, self.size, lambda: self.timeout, native
            )
        return self._staged

    # -- shared buffers -----------------------------------------------------------------------

    def empty(self, shape, dtype=np.float32, device=None):
        """A numpy array in memory the ranks of this machine can map: all-reduce, reduce-scatter,
        all-gather, broadcast and reduce on such arrays (every buffer, on every rank) move each
        byte once, without staging slots (``pycollectives.runtime.shared``). Collective: every rank
        calls it with the same shape and dtype. Example::

            grads = comm.empty(1 << 20, np.float32)
            grads[:] = local_gradients
            comm.all_reduce(grads)               # over the mapped buffers

        With `device` (``"cuda"``, ``"cuda:N"`` or ``N``): a cupy array of GPU memory every rank
        maps (registered, ``CudaComm.empty``); an all-reduce whose input and output are such
        arrays runs the two-shot over them. The CUDA transport is set up by the first such call
        or GPU collective, collectively."""
        if device is None or device == "cpu":
            return shared.empty(self, shape, dtype)
        return self._cuda_for("empty", _cuda_device(device)).empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32, device=None):
        """As ``empty``, filled with zeros."""
        if device is None or device == "cpu":
            return shared.zeros(self, shape, dtype)
        return self._cuda_for("zeros", _cuda_device(device)).zeros(shape, dtype)

    def register(self, array):
        """Registers an existing CUDA array (cupy, torch, ``__cuda_array_interface__``) so that
        peers map it, as ``empty(..., device=...)``'s arrays are (``CudaComm.register``).
        Collective: every rank registers its own array, in the same order. Returns `array`."""
        info = arrays.describe(array)
        if not info.is_cuda:
            raise TypeError(
                "register: takes CUDA arrays; for host memory every rank maps, use comm.empty"
            )
        return self._cuda_for("register", None, (array,)).register(array)

    # -- Python objects -----------------------------------------------------------------------

    def broadcast_object(self, obj=None, root=0):
        """The root's `obj` (pickled) on every rank; its size is broadcast first."""
        data = _pickled(obj) if self.rank == root else None
        size = np.array([0 if data is None else data.size], np.int64)
        self.broadcast(size, root)
        buf = data if data is not None else np.empty(int(size[0]), np.uint8)
        self.broadcast(buf, root)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (pickled), in rank order; sizes are gathered first."""
        data = _pickled(obj)
        sizes = np.empty(self.size, np.int64)
        self.all_gather(np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        self.all_gather(data, out, counts=sizes.tolist())
        ends = np.cumsum(sizes)
        return [pickle.loads(out[e - n : e].tobytes()) for n, e in zip(sizes.tolist(), ends)]

    # -- GPU arrays ---------------------------------------------------------------------------

    def _start_cuda(self, call: Call):
        """Makes the CUDA communicator, collectively, when the first GPU collective arrives.

        The arguments are checked first (an error before anything moves). Then the ranks agree,
        over shared memory with the usual fingerprint and timeout, that all of them are in a
        GPU collective: a rank that passed host arrays gets CollectiveMismatch, not a hang.
        """
        from pycollectives.backends.cuda.args import check_args

        if self._cuda_error is not None:
            raise CollectiveError(self._cuda_error)
        check_args(call, self.rank, self.size)
        self._open_cuda(call.collective, None, (call.x, call.out))

    def _cuda_for(self, name: str, device, arrays=None):
        """The CUDA communicator, made now (collectively) if no GPU call has made it yet."""
        self._backend()  # not closed
        if self._cuda is None:
            self._open_cuda(name, device, arrays)
        elif device is not None and device != self._cuda.device:
            raise ValueError(
                f"{name}: device {device}, but this communicator's GPU is {self._cuda.device}"
            )
        return self._cuda

    def _open_cuda(self, name: str, device=None, arrays=None):
        """Makes the CUDA communicator on `device` (None: chosen as CudaComm chooses, from
        `arrays` if given): every rank must be in a GPU operation (the GPU handshake)."""
        from pycollectives.backends.cuda import CudaComm

        if self._cuda_error is not None:
            raise CollectiveError(self._cuda_error)
        if isinstance(self._group, bootstrap.ThreadGroup):
            raise CollectiveError(
                f"{name}: CUDA arrays on the thread ranks of Communicator.local are not "
                "supported (the CUDA transport joins processes over CUDA IPC); pass host "
                "arrays, or launch one process per GPU"
            )
        if self.topology.num_nodes > 1:
            raise CollectiveError(
                f"{name}: CUDA arrays on a communicator over {self.topology.num_nodes} "
                "nodes are not supported (the CUDA transport is for the GPUs of one machine); "
                "copy them to host memory, or use a communicator within one node"
            )
        token = np.frombuffer(_GPU_HANDSHAKE, np.uint8)
        seen = np.empty(self.size * token.size, np.uint8)
        self._host.run(Call("all_gather", token, seen))
        rows = seen.reshape(self.size, -1)
        strangers = [r for r, row in enumerate(rows) if row.tobytes() != _GPU_HANDSHAKE]
        if strangers:
            raise CollectiveMismatch(
                f"{name}: this rank passed CUDA arrays, ranks {strangers} did not"
            )
        try:
            opts = self.options.replace(timeout=self.timeout)
            self._cuda = CudaComm(
                self._group, self.rank, self.size, options=opts, device=device, arrays=arrays
            )
        except CollectiveError as e:
            # Every rank failed alike (the setup is one exchange): later GPU calls say why.
            self._cuda_error = str(e)
            raise
        # Blocking calls on cupy arrays take the one-step path too, straight to the device.
        route = self._cuda.run_now_route() if self._run_now is not _not_now else None
        if route is not None:
            self._run_now = self._host.c.run_now_via(*route)


def _cuda_device(device):
    """A CUDA device as CudaComm takes it: None ("cuda": chosen as usual) or its ordinal."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if device == "cuda":
        return None
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or an int, got {device!r}")


def _sizes(values, name):
    """A list of non-negative element counts, or None."""
    if values is None:
        return None
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of element counts, got {values!r}") from None
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must not be negative, got {out}")
    return out


def _pickled(obj) -> np.ndarray:
    return np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), np.uint8)
