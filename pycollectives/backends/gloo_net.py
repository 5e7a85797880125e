"""Between nodes without MPI: torch's gloo over the rendezvous store.

A job launched by torchrun (or any ``env://`` launcher) over several machines has no MPI world
to carry the inter-node phase of a hierarchical collective
(``pycollectives.backends.hierarchical``). There it runs over gloo process groups made on the
same ``TCPStore`` the ranks met through: one over every rank (the flat collectives and messages to
other nodes) and one over the ranks with this rank's local rank (the inter-node phase). Gloo runs
its own algorithms for each phase; what the hierarchy adds is the same as over MPI: shared memory
inside each node, each byte across the network once per node.

Gloo's messages carry nothing of what each rank asked for: every call is checked before its
data moves by the check across nodes (``pycollectives.backends.call_check``), whose exchange
between nodes is here an all-gather of the statuses over the column's gloo group
(``GlooCheck``). Every wait is bounded by the communicator's timeout; a gloo failure (a peer
gone, a timeout) makes the engine, and with it the communicator, unusable.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import zlib
from datetime import timedelta

import numpy as np

from pycollectives import _C, ops
from pycollectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from pycollectives.runtime import arrays

# A gloo wait looks for an abort or a revocation between slices of this length.
_SLICE = timedelta(milliseconds=20)
_ABANDONED: set = set()  # ids of gloo groups kept alive for good (GlooNet._abandon)


def _torch():
    import torch
    import torch.distributed as dist

    return torch, dist


def _tensor(a: np.ndarray):
    """A flat CPU tensor over a numpy array's memory (no copy)."""
    return arrays.torch_view(a.reshape(-1))


def _reduce_op(code: int):
    _, dist = _torch()
    name = "SUM" if code == ops.AVG else ops.torch_name(code)  # avg: a sum, divided after
    return getattr(dist.ReduceOp, name)


def _finish_avg(a: np.ndarray, divisor: int):
    """An average's last step, on the sum in `a`: integers truncate toward zero, as the
    native reductions do."""
    t = _tensor(a)
    if t.is_floating_point():
        t.div_(divisor)
    else:
        t.div_(divisor, rounding_mode="trunc")


def _raise_from(e: Exception, what: str):
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        raise CollectiveTimeout(f"{what}: timed out over gloo: {text}") from None
    raise CollectiveError(f"{what}: failed over gloo (a peer gone?): {text}") from None


class GlooNet:
    """Collectives among ranks of a ``StoreGroup`` over gloo: ``run`` takes what
    ``_net.NetComm.run`` takes (ranks of the group, flat arrays, native codes). It keeps one
    gloo group per set of ranks, shared with the messages (``GlooP2P``), and whether they are
    still usable."""

    def __init__(self, group, timeout: float):
        self._group, self.rank, self.size, self.timeout = group, group.rank, group.size, timeout
        self._groups: dict = {}
        self.error = None
        self.connect_timeout = None  # seconds a new gloo group may take to connect (None: timeout)

    def process_group(self, members):
        """The gloo group over `members` (ranks of the store group, in this order); made by
        all of them together the first time any of them asks."""
        key = tuple(members)
        pg = self._groups.get(key)
        if pg is None:  # one per set of members: a second would meet under the same keys
            _, dist = _torch()
            name = (
                "-".join(map(str, key)) if len(key) <= 16 else f"{zlib.crc32(repr(key).encode())}"
            )
            store = dist.PrefixStore(f"{self._group.prefix}/gloo/{name}", self._group.store)
            seconds = timedelta(seconds=self.connect_timeout or self.timeout)
            pg = dist.ProcessGroupGloo(store, key.index(self.rank), len(key), seconds)
            if self.connect_timeout is not None:
                pg.set_timeout(timedelta(seconds=self.timeout))
            self._groups[key] = pg
        return pg

    def check_usable(self):
        if self.error is not None:
            raise CollectiveError(
                f"the gloo engine is unusable after an earlier error: {self.error}"
            )

    def fail(self, e: Exception, what: str):
        try:
            _raise_from(e, what)
        except CollectiveError as err:
            if self.error is None:
                self.error = str(err)
            raise

    def wait(self, work, what: str):
        """Waits for gloo's `work` up to the timeout, in slices: between them, an abort or a
        revocation (``abort``, from any thread) ends the wait with CollectiveError."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError as e:
                if work.is_completed():  # done meanwhile, or failed of itself (a peer gone)
                    try:
                        work.wait()
                        return
                    except RuntimeError as failed:
                        self.fail(failed, what)
                if self.error is not None:
                    self._abandon()
                    raise CollectiveError(f"{what}: {self.error}") from None
                if time.monotonic() > deadline:
                    self.fail(e, what)

    def abort(self, reason: str):
        """Unusable from now on; a wait in progress on any thread ends within a slice."""
        if self.error is None:
            self.error = reason

    def _abandon(self):
        """This engine's gloo groups are never destroyed: a collective cut short still waits
        in one of them, and gloo's destructor would wait for it (up to its timeout, for peers
        that have gone on to other groups)."""
        for pg in self._groups.values():
            if id(pg) not in _ABANDONED:
                _ABANDONED.add(id(pg))
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))

    def close(self):
        self._groups.clear()

    def run(self, collective, algorithm, members, x, out, count, dtype, op, root, divisor, seq,
            counts=(), send_counts=(), recv_counts=()):  # fmt: skip
        """One collective among `members`, which the check across nodes has found every one
        of them to call alike; `algorithm` is gloo's to choose, but for "direct" reductions
        (reproducible mode), which sum in rank order (_reduce_in_rank_order)."""
        self.check_usable()
        what = f"{collective} #{seq}"
        pg = self.process_group(members)
        me, n = members.index(self.rank), len(members)
        if algorithm == "direct" and collective in ops.REDUCING:
            self._reduce_in_rank_order(pg, collective, me, n, x, out, dtype, op, root, counts,
                                       divisor, what)  # fmt: skip
            return
        try:
            work, then = self._start(pg, collective, me, n, x, out, op, root, counts,
                                     send_counts, recv_counts)  # fmt: skip
        except RuntimeError as e:  # refused before it started
            self.fail(e, what)
        self.wait(work, what)
        if then is not None:
            then()
        if op == int(ops.AVG) and collective in ("all_reduce", "reduce_scatter", "reduce"):
            if collective != "reduce" or me == root:
                _finish_avg(out, divisor)

    def _start(self, pg, c, me, n, x, out, op, root, counts, send_counts, recv_counts):
        """The gloo work of one collective, and what to do once it is done (or None)."""
        _, dist = _torch()
        T = _tensor
        if c == "all_reduce":
            if out is not x:
                np.copyto(out, x)
            o = dist.AllreduceOptions()
            o.reduceOp = _reduce_op(op)
            return pg.allreduce([T(out)], o), None
        if c == "broadcast":
            o = dist.BroadcastOptions()
            o.rootRank, o.rootTensor = root, 0
            return pg.broadcast([T(x)], o), None
        if c == "reduce":
            buf = out if me == root else x.copy()  # gloo reduces in place, on every rank
            if me == root and out is not x:
                np.copyto(out, x)
            o = dist.ReduceOptions()
            o.rootRank, o.rootTensor, o.reduceOp = root, 0, _reduce_op(op)
            return pg.reduce([T(buf)], o), None
        if c == "all_gather" and counts:
            return self._all_gather_uneven(pg, me, n, x, out, counts)
        if c == "all_gather":
            return pg._allgather_base(T(out), T(x)), None
        if c == "reduce_scatter" and counts:
            return self._reduce_scatter_uneven(pg, me, n, x, out, op, counts)
        if c == "reduce_scatter":
            o = dist.ReduceScatterOptions()
            o.reduceOp = _reduce_op(op)
            return pg._reduce_scatter_base(T(out), T(x), o), None
        if c == "gather":
            o = dist.GatherOptions()
            o.rootRank = root
            into = [[T(b) for b in np.split(out.reshape(-1), n)]] if me == root else []
            return pg.gather(into, [T(x)], o), None
        if c == "scatter":
            o = dist.ScatterOptions()
            o.rootRank = root
            src = [[T(b) for b in np.split(x.reshape(-1), n)]] if me == root else []
            return pg.scatter([T(out)], src, o), None
        if c == "all_to_all":
            sent = list(send_counts) if send_counts else []
            got = list(recv_counts) if recv_counts else []
            return pg.alltoall_base(T(out), T(x), got, sent, dist.AllToAllOptions()), None
        raise CollectiveError(f"{c}: not a collective the gloo engine runs")

    def _reduce_in_rank_order(self, pg, c, me, n, x, out, dtype, op, root, counts, divisor, what):
        """A reduction whose every element is summed in rank order, as the direct schedules
        sum on one machine (gloo's own reductions sum in an order of their own, and half
        precision in itself): block q of every rank's input goes to rank q (an all-to-all),
        which folds the rows in rank order natively (_C.fold_rows, the accumulation type, an
        average divided once); an all-reduce or reduce then gathers the folded blocks."""
        _, dist = _torch()
        flat = x.reshape(-1)
        total = len(flat)
        if c == "reduce_scatter":
            sizes = [int(k) for k in counts] if counts else [total // n] * n
        else:  # blocks of ceil(total / n), the last ones shorter
            per = -(-total // n)
            sizes = [max(0, min(per, total - q * per)) for q in range(n)]
        mine = sizes[me]
        rows = np.empty(n * mine, x.dtype)
        try:
            work = pg.alltoall_base(_tensor(rows), _tensor(flat), [mine] * n, sizes,
                                    dist.AllToAllOptions())  # fmt: skip
        except RuntimeError as e:
            self.fail(e, what)
        self.wait(work, what)
        if c == "reduce_scatter":
            _C.fold_rows(rows, out.reshape(-1), dtype, op, divisor)
            return
        folded = np.empty(mine, x.dtype)
        _C.fold_rows(rows, folded, dtype, op, divisor)
        into = out if c == "all_reduce" or me == root else np.empty(total, x.dtype)
        work, pack = self._all_gather_uneven(pg, me, n, folded, into, sizes)
        self.wait(work, what)
        pack()

    def _all_gather_uneven(self, pg, me, n, x, out, counts):
        """Gloo gathers equal blocks: each rank's block padded to the largest, then packed."""
        m = max(counts)
        block = np.zeros(m, x.dtype)
        block[: counts[me]] = x.reshape(-1)
        full = np.empty(n * m, x.dtype)
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()

        def pack():
            flat = out.reshape(-1)
            for r in range(n):
                flat[starts[r] : starts[r + 1]] = full[r * m : r * m + counts[r]]

        return pg._allgather_base(_tensor(full), _tensor(block)), pack

    def _reduce_scatter_uneven(self, pg, me, n, x, out, op, counts):
        """Gloo reduce-scatters equal blocks: each destination's block padded to the largest."""
        _, dist = _torch()
        m = max(counts)
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        blocks = np.zeros((n, m), x.dtype)
        flat = x.reshape(-1)
        for r in range(n):
            blocks[r, : counts[r]] = flat[starts[r] : starts[r + 1]]
        mine = np.empty(m, x.dtype)
        o = dist.ReduceScatterOptions()
        o.reduceOp = _reduce_op(op)

        def unpack():
            out.reshape(-1)[:] = mine[: counts[me]]

        return pg._reduce_scatter_base(_tensor(mine), _tensor(blocks), o), unpack


class GlooCheck:
    """The check across nodes' exchange (``call_check``) over gloo: an all-gather of the column
    members' statuses, each padded to `width` bytes behind its length, over the column's gloo
    group."""

    def __init__(self, net: GlooNet, width: int):
        self._net, self._width = net, width

    timeout = property(lambda self: self._net.timeout,
                       lambda self, seconds: setattr(self._net, "timeout", seconds))  # fmt: skip

    def exchange(self, group, what: str, status: bytes) -> list:
        self._net.check_usable()
        pg = self._net.process_group(group)
        row = 4 + self._width
        mine = np.zeros(row, np.uint8)
        mine[:4] = np.frombuffer(np.uint32(len(status)).tobytes(), np.uint8)
        mine[4 : 4 + len(status)] = np.frombuffer(status, np.uint8)
        every = np.empty(len(group) * row, np.uint8)
        try:
            work = pg._allgather_base(_tensor(every), _tensor(mine))
        except RuntimeError as e:
            self._net.fail(e, f"{what}: the check across nodes")
        self._net.wait(work, f"{what}: the check across nodes")
        rows = every.reshape(len(group), row)
        return [r[4 : 4 + int(r[:4].view(np.uint32)[0])].tobytes() for r in rows]

    def close(self):
        pass


# A message to another node is three gloo messages on tags derived from the user's: a header
# (count, dtype code) and the data from the sender, then the receiver's verdict back (0, or its
# own count and dtype). Gloo aborts a process that receives more bytes than it posted for, so
# the receiver posts for the data only once the header has said how much comes: into the
# user's array when the two agree, else into scratch memory of the announced size, and both
# ends raise CollectiveMismatch. A gloo send or receive completes only in a wait on it, so each
# message is driven by a thread of its own, blocked in those waits (bounded by the timeout).
# Gloo matches messages between two ranks on one tag in the order they are posted: everything
# a sender posts, it posts at once, in issue order; a receiver's thread posts for its data and
# its verdict only after the receive issued before it from that rank on that tag has.
_HEADER, _DATA, _VERDICT = range(3)
_TAG_MAX = (2**31 - 1 - _VERDICT) // 3  # gloo's tags are non-negative ints


def _tag(tag: int, part: int) -> int:
    return 3 * tag + part


def _sized(count, dtype) -> str:
    return f"{int(count)} x {ops.DTYPES[int(dtype)]}"


class _Message:
    """One message to or from a rank of another node, driven by its own thread (started by
    `go`, once everything it needs is posted): `done` is set when it is over, with `error`
    None or what to raise."""

    def __init__(self, net, world, peer, tag, count, dtype):
        self.net, self.world, self.peer, self.tag = net, world, peer, tag
        self.count, self.dtype = count, dtype
        self.deadline = time.monotonic() + net.timeout
        self.error, self.done = None, threading.Event()
        self.verdict = np.zeros(3, np.int64)

    def go(self):
        threading.Thread(target=self._drive, daemon=True, name="pycoll-gloo-msg").start()
        return self

    def mismatch(self, text):
        """As on one node: the error, which leaves the communicator unusable."""
        self.net.abort(text)
        return CollectiveMismatch(text)

    def _wait(self, work):
        left = max(0.0, self.deadline - time.monotonic())
        work.wait(timedelta(seconds=left))

    def _drive(self):
        try:
            self.error = self.run()
        except RuntimeError as e:
            try:
                self.net.fail(e, f"{self.what} rank {self.peer} (tag {self.tag})")
            except CollectiveError as err:
                self.error = err
        except BaseException as e:  # noqa: BLE001 - raised in the thread that waits
            self.error = e
        self.done.set()


class _Send(_Message):
    what = "send to"

    def __init__(self, net, world, peer, tag, array, count, dtype):
        super().__init__(net, world, peer, tag, count, dtype)
        self.header = np.array([count, dtype], np.int64)
        self.posted = [  # at once, in issue order (see above)
            world.send([_tensor(self.header)], peer, _tag(tag, _HEADER)),
            world.send([_tensor(array)], peer, _tag(tag, _DATA)),
            world.recv([_tensor(self.verdict)], peer, _tag(tag, _VERDICT)),
        ]

    def run(self):
        for work in self.posted:
            self._wait(work)
        if self.verdict[0] == 0:
            return None
        return self.mismatch(
            f"send to rank {self.peer} (tag {self.tag}, {_sized(self.count, self.dtype)}): the "
            f"matching recv does not fit: this rank sends {_sized(self.count, self.dtype)}, "
            f"rank {self.peer} receives {_sized(self.verdict[1], self.verdict[2])}"
        )


class _Recv(_Message):
    what = "recv from"

    def __init__(self, net, world, peer, tag, array, count, dtype, before):
        super().__init__(net, world, peer, tag, count, dtype)
        self.array = array
        # The receive issued before this one from `peer` on `tag` (None: none in flight):
        # its data and verdict are posted before this one's.
        self.before = before
        self.data_posted, self.verdict_posted = threading.Event(), threading.Event()
        self.header = np.zeros(2, np.int64)
        self.posted = world.recv([_tensor(self.header)], peer, _tag(tag, _HEADER))

    def _after(self, posted):
        """Waits (bounded) until the receive before this one has posted what `posted` names."""
        if self.before is not None:
            getattr(self.before, posted).wait(max(0.0, self.deadline - time.monotonic()))

    def run(self):
        try:
            self._wait(self.posted)
            count, dtype = (int(v) for v in self.header)
            into, error = self.array, None
            if (count, dtype) != (self.count, self.dtype):
                error = self.mismatch(
                    f"recv from rank {self.peer} (tag {self.tag}, "
                    f"{_sized(self.count, self.dtype)}): the matching send does not fit: rank "
                    f"{self.peer} sends {_sized(count, dtype)}, this rank receives "
                    f"{_sized(self.count, self.dtype)}"
                )
                self.verdict[:] = (1, self.count, self.dtype)
                into = np.empty(count * arrays.DTYPE_SIZES[ops.DTYPES[dtype]], np.uint8)
            self._after("data_posted")
            data = self.world.recv([_tensor(into)], self.peer, _tag(self.tag, _DATA))
            self.data_posted.set()
            self._wait(data)
            self._after("verdict_posted")
            verdict = self.world.send([_tensor(self.verdict)], self.peer, _tag(self.tag, _VERDICT))
            self.verdict_posted.set()
            self._wait(verdict)
            return error
        finally:  # failed or not, the receives after this one go on
            self.data_posted.set()
            self.verdict_posted.set()
            self.before = self.array = None  # nothing kept alive by the receive after it


class GlooP2P:
    """Messages to ranks on other nodes over the gloo group of every rank, which it shares
    with the collectives (`net`), as ``_net.NetP2P``'s: each posted at once and moving on its
    own (whatever order, or whether, the program waits in), a mismatch of size or dtype raised
    on both ends without touching the receiver's array."""

    takes_arrays = True  # start() takes (P2POp, native description) pairs

    def __init__(self, net: GlooNet):
        self._net = net
        self._seq = itertools.count()
        self._world = net.process_group(range(net.size))  # collective: made by every rank
        self._last = {}  # (peer, tag) -> the last receive issued from peer on tag
        self._issuing = threading.Lock()

    timeout = property(lambda self: self._net.timeout,
                       lambda self, seconds: setattr(self._net, "timeout", seconds))  # fmt: skip
    error = property(lambda self: self._net.error)

    def start(self, ops_):
        """Posts every (P2POp, description) in `ops_`; the caller keeps the arrays alive until
        the work is done."""
        self._net.check_usable()
        for o, d in ops_:  # every tag checked before anything is posted
            if d[5] > _TAG_MAX:
                raise ValueError(
                    f"{o.kind}: tag {d[5]} for rank {d[4]} on another node exceeds the largest "
                    f"tag over gloo, {_TAG_MAX}"
                )
        parts = []
        try:
            with self._issuing:  # in issue order, whichever threads issue
                for o, (_, _, count, dtype, peer, tag) in ops_:
                    if o.kind == "send":
                        part = _Send(self._net, self._world, peer, tag, o.array, count, dtype)
                    else:
                        before = self._last.get((peer, tag))
                        if before is not None and before.done.is_set():
                            before = None
                        part = _Recv(self._net, self._world, peer, tag, o.array, count, dtype,
                                     before)  # fmt: skip
                        self._last[(peer, tag)] = part
                        if len(self._last) > 64:  # only those in flight can be waited behind
                            self._last = {
                                k: m for k, m in self._last.items() if not m.done.is_set()
                            }
                    parts.append(part.go())
        except RuntimeError as e:
            self._net.fail(e, "point-to-point")
        return _Messages(parts, next(self._seq))

    def abort(self, reason: str):
        self._net.abort(reason)

    def close(self):
        self._net.close()


class _Messages:
    """A batch of messages to and from other nodes: the native side of a ``Work``."""

    __slots__ = ("_parts", "seq")

    def __init__(self, parts, seq):
        self._parts, self.seq = parts, seq

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for part in self._parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not part.done.wait(left):
                raise CollectiveTimeout(
                    f"{part.what} rank {part.peer} (tag {part.tag}): not complete after {timeout} s"
                )
        errors = [p.error for p in self._parts if p.error is not None]
        if errors:
            raise errors[0]
        return True

    def is_completed(self):
        return all(p.done.is_set() for p in self._parts)
