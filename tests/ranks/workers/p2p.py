"""Point-to-point send/recv (Communicator.send/recv/batch_p2p, and HostComm.p2p's own checks)
against mpi4py's own Send/Recv of the same data.

Usage: mpiexec -n N python p2p.py matrix|semantics|eager|mismatch-size|mismatch-dtype|
                                  mismatch-late|timeout|dead|args|progress|engine
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import time

import checks
import numpy as np
from checks import expect, hard_exit, make_input, run_main
from mpi4py import MPI

import pycollectives as pc

SLOT = 4096  # small staging slots: a few KiB already take several pieces


def data(src: int, dst: int, count: int, dt, salt: int = 0) -> np.ndarray:
    return make_input(src * 131 + dst, count, dt, "sum", salt)


def p2p(comm, ops, async_op=False):
    """One batch through the public API: ops as (kind, array, peer, tag)."""
    return comm.batch_p2p([pc.P2POp(*o) for o in ops], async_op=async_op)


def mpi_reference(sends, recvs):
    """What MPI delivers for the same pattern: sends = [(array, dst, tag)], recvs = [(like, src,
    tag)]; moved as bytes, so that every dtype (bfloat16 included) goes through MPI."""
    world = MPI.COMM_WORLD
    reqs = [world.Isend(x.view(np.uint8), dest=d, tag=t) for x, d, t in sends]
    outs = [np.empty_like(like) for like, _, _ in recvs]
    reqs += [world.Irecv(o.view(np.uint8), source=s, tag=t) for o, (_, s, t) in zip(outs, recvs)]
    MPI.Request.Waitall(reqs)
    return outs


def check_pattern(comm, sends, recv_specs, what):
    """Our p2p of `sends` and recvs of `recv_specs` = [(count, dt, src, tag)] in one batch,
    compared bytewise with MPI's delivery of the same sends."""
    outs = [np.full(c, 77, dt) for c, dt, _, _ in recv_specs]
    ops = [("send", x, d, t) for x, d, t in sends]
    ops += [("recv", o, s, t) for o, (_, _, s, t) in zip(outs, recv_specs)]
    assert p2p(comm, ops) is None
    want = mpi_reference(sends, [(o, s, t) for o, (_, _, s, t) in zip(outs, recv_specs)])
    for got, ref in zip(outs, want):
        assert got.tobytes() == ref.tobytes(), f"{what}: differs from MPI ({got[:4]} vs {ref[:4]})"


def matrix():
    comm = pc.Communicator(staging_bytes=SLOT)
    r, n = comm.rank, comm.size
    # Counts: empty, one, odd, several slots, and one past the direct-write threshold.
    for dt in checks.DTYPES:
        for count in (0, 1, 7, 5 * SLOT // dt.itemsize + 3, (1 << 16) // dt.itemsize + 5):
            what = f"{dt} count={count}"
            nxt, prv = (r + 1) % n, (r - 1) % n
            # Ring exchange, one batch: to r+1, from r-1.
            check_pattern(
                comm, [(data(r, nxt, count, dt), nxt, 3)], [(count, dt, prv, 3)], "ring " + what
            )
            # Everyone to everyone, one batch, tags naming the sender.
            peers = [q for q in range(n) if q != r]
            sends = [(data(r, q, count, dt, 1), q, r) for q in peers]
            recvs = [(count, dt, q, q) for q in peers]
            check_pattern(comm, sends, recvs, "all pairs " + what)
    comm.barrier()
    if r == 0:
        print(f"p2p matrix ranks={n}", flush=True)
    comm.close()


def semantics():
    """Tags out of order, one tag in order, p2p between collectives, isend across a collective."""
    comm = pc.Communicator(staging_bytes=SLOT)
    r = comm.rank
    count = 3 * SLOT  # several pieces each
    a, b = data(0, 1, count, np.dtype(np.int32), 1), data(0, 1, count, np.dtype(np.int32), 2)
    if r == 0:  # tag 1 then tag 2, both in flight at once
        w = p2p(comm, [("send", a, 1, 1), ("send", b, 1, 2)], async_op=True)
        assert w.wait(timeout=30) and w.is_completed()
    elif r == 1:  # tag 2 first: blocks until it arrives while tag 1's send is pending
        got2, got1 = np.empty_like(b), np.empty_like(a)
        assert comm.recv(got2, 0, tag=2) is got2
        comm.recv(got1, src=0, tag=1)
        assert np.array_equal(got1, a) and np.array_equal(got2, b), "tags crossed"
    # Same tag three times: arrives in order (different sizes so a swap cannot go unnoticed).
    msgs = [np.full(c, i + 1, np.float64) for i, c in enumerate((5000, 1, 300))]
    if r == 0:
        w = p2p(comm, [("send", m, 1, 9) for m in msgs], async_op=True)
        w.wait()
    elif r == 1:
        outs = [np.zeros_like(m) for m in msgs]
        for o in outs:
            p2p(comm, [("recv", o, 0, 9)])
        assert all(np.array_equal(o, m) for o, m in zip(outs, msgs)), "same tag overtook"
    # p2p interleaved with collectives.
    x = np.full(1000, r + 1, np.float32)
    comm.all_reduce(x)
    y = np.empty(10, np.int64)
    peer = 1 - r if r < 2 else None
    if peer is not None:
        p2p(comm, [("send", np.arange(10) + r, peer, 0), ("recv", y, peer, 0)])
        assert np.array_equal(y, np.arange(10) + peer)
    comm.all_reduce(x)
    assert np.all(x == comm.size * sum(range(1, comm.size + 1)))
    # Rank 0: isend, then a blocking collective; rank 1: blocking recv, then the collective.
    # Only the background progress of rank 0 can complete rank 1's recv.
    big = data(0, 1, 200_000, np.dtype(np.float32))
    if r == 0:
        w = comm.send(big, 1, tag=5, async_op=True)
        comm.barrier()
        w.wait()
    else:
        if r == 1:
            got = np.empty_like(big)
            p2p(comm, [("recv", got, 0, 5)])
            assert np.array_equal(got, big)
        comm.barrier()
    if r == 0:
        print("p2p semantics", flush=True)
    comm.close()


def _same(got, want, what):
    if got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at byte {bad[0]}")


def _quick(t0, what, limit=5.0):
    """A phase that only a stuck message could slow to the communicator's timeout (30 s)."""
    took = time.monotonic() - t0
    assert took < limit, f"{what} took {took:.2f} s: messages waited for the program"


def progress():
    """Every send and receive progresses on its own, as MPI's do: whatever order the program
    waits in, with several messages in flight, beside collectives in flight. Run on several
    (emulated) nodes, where a ring mixes shared-memory and MPI links. A message that waited
    for the program to reach it would hang here until the 30 s timeout."""
    comm = pc.Communicator(timeout=30)
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    f32 = np.dtype(np.float32)
    # Two isends, then blocking recvs in the other order.
    t0 = time.monotonic()
    x, y = np.full(4, r, np.float32), np.full(4, 10 * r, np.float32)
    a, b = np.empty(4, np.float32), np.empty(4, np.float32)
    w1 = comm.send(x, nxt, tag=1, async_op=True)
    w2 = comm.send(y, nxt, tag=2, async_op=True)
    comm.recv(b, prv, tag=2)
    comm.recv(a, prv, tag=1)
    w1.wait()
    w2.wait()
    assert np.all(a == prv) and np.all(b == 10 * prv), (a, b)
    _quick(t0, "two isends received in the other order")
    # Four messages in flight (empty, small, past MPI's eager limit, large) on four tags,
    # received blocking in every order.
    sizes = (0, 3, 20_000, 300_000)
    t0 = time.monotonic()
    for k, order in enumerate(itertools.permutations(range(len(sizes)))):
        sends = [
            comm.send(data(r, nxt, c, f32, k + i), nxt, tag=10 + i, async_op=True)
            for i, c in enumerate(sizes)
        ]
        outs = [np.empty(c, np.float32) for c in sizes]
        for i in order:
            comm.recv(outs[i], prv, tag=10 + i)
        for w in reversed(sends):
            w.wait()
        for i, c in enumerate(sizes):
            _same(outs[i], data(prv, r, c, f32, k + i), f"tag {10 + i} received in order {order}")
    _quick(t0, "24 orders of 4 messages in flight", 15.0)
    # Receives posted first, all asynchronous, waited for in every order (sends last).
    t0 = time.monotonic()
    for k, order in enumerate(itertools.permutations(range(len(sizes)))):
        outs = [np.empty(c, np.float32) for c in sizes]
        recvs = [comm.recv(o, prv, tag=20 + i, async_op=True) for i, o in enumerate(outs)]
        sends = [
            comm.send(data(r, nxt, c, f32, 100 + k + i), nxt, tag=20 + i, async_op=True)
            for i, c in enumerate(sizes)
        ]
        for i in order:
            assert recvs[i].wait(timeout=20) and recvs[i].is_completed()
        for i, c in enumerate(sizes):
            want = data(prv, r, c, f32, 100 + k + i)
            _same(outs[i], want, f"async recv {i} waited in {order}")
        for w in sends:
            w.wait()
    _quick(t0, "24 orders of waits on posted receives", 15.0)
    # One tag, several messages of different sizes in flight: they arrive in issue order,
    # whichever receive is waited for first.
    t0 = time.monotonic()
    msgs = [np.full(c, i + 1, np.float64) for i, c in enumerate((70_000, 1, 0, 500, 9000))]
    outs = [np.zeros_like(m) for m in msgs]
    recvs = [comm.recv(o, prv, tag=7, async_op=True) for o in outs]
    sends = [comm.send(m, nxt, tag=7, async_op=True) for m in msgs]
    for w in reversed(recvs + sends):
        w.wait()
    for o, m in zip(outs, msgs):
        _same(o, m, "one tag, several in flight: overtaken")
    _quick(t0, "one tag, several messages in flight")
    # Batches both ways at once: a ring exchange each way in one batch_p2p, many times.
    t0 = time.monotonic()
    for i in range(20):
        to_next, to_prev = data(r, nxt, 100 + i, f32, i), data(r, prv, 50, f32, i)
        from_prev, from_next = np.empty(100 + (i + 0), np.float32), np.empty(50, np.float32)
        comm.batch_p2p([
            pc.P2POp("recv", from_prev, prv, 3), pc.P2POp("send", to_next, nxt, 3),
            pc.P2POp("send", to_prev, prv, 4), pc.P2POp("recv", from_next, nxt, 4),
        ])  # fmt: skip
        _same(from_prev, data(prv, r, 100 + i, f32, i), "batch ring forward")
        _same(from_next, data(nxt, r, 50, f32, i), "batch ring backward")
    _quick(t0, "20 two-way batches")
    # Beside collectives in flight: an isend, then a blocking collective, then the recv; a
    # receive posted, a collective, then the send; point-to-point while an all-reduce runs.
    t0 = time.monotonic()
    big = data(r, nxt, 200_000, f32)
    w = comm.send(big, nxt, tag=30, async_op=True)
    total = comm.all_reduce(np.full(1000, r + 1, np.int64))
    got = comm.recv(np.empty_like(big), prv, tag=30)
    w.wait()
    _same(got, data(prv, r, 200_000, f32), "isend across a blocking all_reduce")
    assert np.all(total == n * (n + 1) // 2), total
    got = np.empty_like(big)
    w = comm.recv(got, prv, tag=31, async_op=True)
    comm.barrier()
    comm.send(big, nxt, tag=31)
    w.wait()
    _same(got, data(prv, r, 200_000, f32), "recv posted across a barrier")
    # A receive posted before a collective completes while this rank is inside it: its peer
    # (half the ranks away, on another node) sends blocking, and only then joins.
    half = n // 2
    if n % 2 == 0 and r < half:
        got = np.empty_like(big)
        w = comm.recv(got, r + half, tag=32, async_op=True)
        comm.all_reduce(np.ones(10))
        w.wait()
        _same(got, data(r + half, r, 200_000, f32), "recv completed from inside a collective")
    elif n % 2 == 0:
        comm.send(data(r, r - half, 200_000, f32), r - half, tag=32)
        comm.all_reduce(np.ones(10))
    else:
        comm.all_reduce(np.ones(10))
    vec = np.full(300_000, float(r), np.float64)
    ar = comm.all_reduce(vec, async_op=True)
    for i in range(5):
        w = comm.send(np.full(1000, i + r, np.int32), nxt, tag=40 + i, async_op=True)
        got = comm.recv(np.empty(1000, np.int32), prv, tag=40 + i)
        w.wait()
        assert np.all(got == i + prv), f"p2p while an all_reduce was in flight: {got[:3]}"
    ar.wait()
    assert np.all(vec == n * (n - 1) / 2), vec[:3]
    _quick(t0, "point-to-point beside collectives")

    # Objects: gathered, broadcast, and sent as torch's send_object_list does (the size, then
    # the pickled bytes) around a ring shifted by q, for every q: every pair, local and remote.
    def blob(p):
        return {"from": p, "pad": "x" * (1000 * p)}

    t0 = time.monotonic()
    assert comm.all_gather_object(blob(r)) == [blob(p) for p in range(n)]
    assert comm.broadcast_object(blob(r), root=n - 1) == blob(n - 1)
    for q in range(1, n):
        dst, src = (r + q) % n, (r - q) % n
        payload = np.frombuffer(bytearray(pickle.dumps(blob(r))), np.uint8)
        size = np.empty(1, np.int64)
        comm.batch_p2p([pc.P2POp("send", np.array([payload.size]), dst, 9),
                        pc.P2POp("recv", size, src, 9)])  # fmt: skip
        inbox = np.empty(int(size[0]), np.uint8)
        comm.batch_p2p([pc.P2POp("send", payload, dst, 9), pc.P2POp("recv", inbox, src, 9)])
        assert pickle.loads(inbox.tobytes()) == blob(src), f"object from rank {src}"
    _quick(t0, "objects around every ring")
    comm.barrier()
    if r == 0:
        print(f"p2p progress ranks={n}", flush=True)
    comm.close()


def engine():
    """``_net.NetP2P`` alone on 2 ranks, with 1000-byte blocks so that messages are described
    to MPI as blocks and a tail: the bytes as sent, each op its own batch, all in flight,
    waited for in a random order; a tag past MPI's bound refused before anything is posted;
    a mismatch raised on both ends without touching the receiver's array; timeout, abort and
    close fail what is pending, promptly."""
    from pycollectives import _C, _net

    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    peer = 1 - r

    def start(eng, *ops):
        return eng.start(_C.check_p2p(list(ops), r, n))

    u8, f64 = np.dtype(np.uint8), np.dtype(np.float64)
    sizes = [(0, u8), (999, u8), (1000, u8), (1001, u8), (2500, u8), (375, f64), (30_001, f64)]
    # Every message inline where it fits 2500 bytes; none inline (header, data, verdict).
    for inline in (2500, 0):
        eng = _net.NetP2P(world, 20.0, block_bytes=1000, inline_bytes=inline)
        outs = [np.zeros(c, dt) for c, dt in sizes]
        works = [start(eng, ("recv", o, peer, i)) for i, o in enumerate(outs)]
        sent = [data(r, peer, c, dt) for c, dt in sizes]  # alive until sent: the engine holds none
        works += [start(eng, ("send", x, peer, i)) for i, x in enumerate(sent)]
        for k in np.random.default_rng(r).permutation(len(works)):
            assert works[k].wait(timeout=20) and works[k].is_completed()
        for o, (c, dt) in zip(outs, sizes):
            _same(o, data(peer, r, c, dt), f"{c} x {dt} in blocks of 1000 bytes, inline {inline}")
        eng.close()
    x = np.ones(10, np.float32)
    y = np.full(12, 7.0, np.float32)
    # A larger message that does not fit: both ends raise, from the receiver's verdict.
    eng = _net.NetP2P(world, 20.0, inline_bytes=0)
    expect(ValueError, lambda: start(eng, ("send", x, peer, eng.tag_ub + 1)), "largest tag")
    w = start(eng, ("send", x, peer, 99) if r == 0 else ("recv", y, peer, 99))
    msg = expect(pc.CollectiveMismatch, w.wait, "tag 99", "10 x float32", "12 x float32")
    assert np.all(y == 7.0), "a message that did not fit was written into the array"
    assert eng.error == msg, (eng.error, msg)
    expect(pc.CollectiveError, lambda: start(eng, ("send", x, peer, 1)), "earlier error")
    eng.close()
    # An inline message that does not fit: the send is done once sent; the receiver raises and
    # poisons the sender, whose next wait fails at once with the same description.
    eng = _net.NetP2P(world, 20.0)
    w = start(eng, ("send", x, peer, 98) if r == 0 else ("recv", y, peer, 98))
    if r == 0:
        assert w.wait(timeout=20)
        t0 = time.monotonic()
        w = start(eng, ("recv", y, peer, 97))  # never sent: the poison ends it
        msg = expect(pc.CollectiveMismatch, w.wait, "tag 98", "10 x float32", "12 x float32")
        assert time.monotonic() - t0 < 5, time.monotonic() - t0
        assert "send to rank 1" in msg and "rank 1 receives 12 x float32" in msg, msg
    else:
        msg = expect(pc.CollectiveMismatch, w.wait, "tag 98", "10 x float32", "12 x float32")
        assert "rank 0 sends 10 x float32" in msg, msg
    assert np.all(y == 7.0), "a message that did not fit was written into the array"
    assert eng.error in msg, (eng.error, msg)
    expect(pc.CollectiveError, lambda: start(eng, ("send", x, peer, 1)), "earlier error")
    eng.close()
    # Nobody sends: the recv times out after the engine's timeout, naming what it waited for.
    eng = _net.NetP2P(world, 0.5)
    t0 = time.monotonic()
    w = start(eng, ("recv", y, peer, 5))
    expect(pc.CollectiveTimeout, w.wait, f"recv from rank {peer} (tag 5", "sent no matching")
    assert time.monotonic() - t0 < 3, time.monotonic() - t0
    eng.close()
    # abort() and close() end pending waits at once.
    eng = _net.NetP2P(world, 20.0)
    w = start(eng, ("recv", y, peer, 6))
    expect(pc.CollectiveTimeout, lambda: w.wait(timeout=0.05), "not complete after")
    assert not w.is_completed()
    eng.abort("stopped by the test")
    expect(pc.CollectiveError, w.wait, "stopped by the test")
    eng.close()
    eng = _net.NetP2P(world, 20.0)
    w = start(eng, ("recv", y, peer, 7))
    eng.close()
    expect(pc.CollectiveError, w.wait, "closed with point-to-point operations in flight")
    expect(pc.CollectiveError, lambda: start(eng, ("recv", y, peer, 7)), "closed")
    world.Barrier()
    print(f"p2p engine rank={r}", flush=True)


def eager():
    """Small sends go out before their recv is posted (PYCOLL_P2P_EAGER_BYTES, the test sets
    it): matched, unexpected then posted, many more than the ring holds, mixed with large
    messages of the same tag, all in issue order per tag."""
    comm = pc.Communicator(staging_bytes=SLOT)
    r, world = comm.rank, MPI.COMM_WORLD
    small = [data(0, 1, c, np.dtype(np.int64), i) for i, c in enumerate((1, 0, 17, SLOT // 8))]
    # Matched: the recv is posted (its request is out) before the send starts.
    if r == 1:
        outs = [np.zeros_like(m) for m in small]
        w = p2p(comm, [("recv", o, 0, 10 + i) for i, o in enumerate(outs)], async_op=True)
        world.Barrier()
        w.wait(timeout=30)
        assert all(np.array_equal(o, m) for o, m in zip(outs, small)), "eager matched"
    else:
        world.Barrier()
        p2p(comm, [("send", m, 1, 10 + i) for i, m in enumerate(small)])
    # Unexpected: 40 messages (ten times the ring) on 40 tags, received newest first, so that
    # every older one must be queued to reach it.
    msgs = [data(0, 1, 1 + i, np.dtype(np.float32), i) for i in range(40)]
    if r == 0:
        w = p2p(comm, [("send", m, 1, 100 + i) for i, m in enumerate(msgs)], async_op=True)
        world.Barrier()
        w.wait(timeout=30)
    else:
        world.Barrier()
        time.sleep(0.05)  # let them all be written (as far as the ring holds)
        outs = [np.zeros_like(m) for m in msgs]
        for i in reversed(range(40)):
            assert comm.recv(outs[i], 0, tag=100 + i) is outs[i]
        assert all(np.array_equal(o, m) for o, m in zip(outs, msgs)), "unexpected queue"
    # One tag, eager and rendezvous (slots and direct writes) interleaved: issue order holds,
    # whichever way the recvs are posted (one at a time, or all in one batch).
    sizes = (9000, 3, 70_000, 0, 500, 1, 20_000)
    mixed = [np.full(c, i + 1, np.float64) for i, c in enumerate(sizes)]
    for batch in (False, True):
        if r == 0:
            p2p(comm, [("send", m, 1, 7) for m in mixed], async_op=True).wait(timeout=30)
        elif r == 1:
            outs = [np.zeros_like(m) for m in mixed]
            if batch:
                p2p(comm, [("recv", o, 0, 7) for o in outs])
            else:
                for o in outs:
                    comm.recv(o, 0, tag=7)
            assert all(np.array_equal(o, m) for o, m in zip(outs, mixed)), "same tag overtook"
    comm.barrier()
    if r == 0:
        print("p2p eager", flush=True)
    comm.close()


def sender_raises(comm, ops, *words):
    """Sends `ops`, one of whose recvs does not fit: the message CollectiveMismatch carries. On
    one node the send raises. Across nodes a small message is done once sent, as MPI's eager
    send, and the receiver poisons the sender: its next wait (a recv nobody sends) fails at once
    with the same description."""
    if comm.topology.num_nodes == 1:
        return expect(pc.CollectiveMismatch, lambda: p2p(comm, ops), *words)
    p2p(comm, ops)
    never = np.empty(1, np.int8)
    t0 = time.monotonic()
    msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, [("recv", never, 1 - comm.rank, 30)]),
                 *words)  # fmt: skip
    assert time.monotonic() - t0 < 5, f"the poison took {time.monotonic() - t0:.1f} s"
    return msg


def mismatch_late():
    """An eager message that does not fit a recv posted after it arrived (it waited in the
    unexpected queue): both ranks raise."""
    comm = pc.Communicator(staging_bytes=SLOT)
    r = comm.rank
    if r == 0:
        ops = [("send", np.ones(10, np.float32), 1, 4), ("send", np.ones(3, np.int8), 1, 8)]
        msg = sender_raises(comm, ops, "rank 1")
    else:
        ok = np.zeros(3, np.int8)
        comm.recv(ok, 0, tag=8)  # drains tag 4's message into the unexpected queue
        assert np.all(ok == 1)
        y = np.empty(11, np.float32)
        msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, [("recv", y, 0, 4)]), "rank 0")
    assert all(w in msg for w in ("tag 4", "10 x float32", "11 x float32")), msg
    print(f"mismatch late rank {r}", flush=True)


def mismatch(field):
    comm = pc.Communicator(staging_bytes=SLOT)
    r = comm.rank
    if r == 0:
        x = np.ones(10, np.float32)
        msg = sender_raises(comm, [("send", x, 1, 4)], "rank 1")
    else:
        y = np.empty(12, np.float32) if field == "size" else np.empty(10, np.int32)
        msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, [("recv", y, 0, 4)]), "rank 0")
    want = ["tag 4", "10 x float32", "12 x float32" if field == "size" else "10 x int32"]
    assert all(w in msg for w in want), msg
    # The communicator is poisoned: the next operation says why at once.
    expect(pc.CollectiveError, lambda: p2p(comm, [("send", x if r == 0 else y, 1 - r, 5)]),
           "earlier error")  # fmt: skip
    print(f"mismatch {field} rank {r}", flush=True)


def timeout():
    comm = pc.Communicator()
    if comm.rank == 0:
        y = np.empty(4, np.int64)
        t0 = time.monotonic()
        msg = expect(pc.CollectiveTimeout, lambda: p2p(comm, [("recv", y, 1, 6)]), "rank 1")
        took = time.monotonic() - t0
        assert "recv from rank 1 (tag 6" in msg and "timed out" in msg, msg
        assert 1.9 < took < 4, took
        expect(pc.CollectiveError, lambda: p2p(comm, [("recv", y, 1, 6)]), "earlier error")
        print(f"timeout after {took:.2f} s", flush=True)
    MPI.COMM_WORLD.Barrier()


def dead():
    """Rank 1 exits with its large send half delivered (run with PYCOLL_P2P_CMA=0, so that the
    message streams through the two slots)."""
    comm = pc.Communicator(staging_bytes=SLOT, staging_slots=2)
    y = np.empty(1 << 20, np.uint8)
    if comm.rank == 0:
        w = p2p(comm, [("recv", y, 1, 1)], async_op=True)
        MPI.COMM_WORLD.Barrier()  # our request is in the ring
    else:
        MPI.COMM_WORLD.Barrier()
        # Starting the send matches the request and fills both slots; then rank 1 is gone.
        p2p(comm, [("send", y, 0, 1)], async_op=True)
        os._exit(0)  # at once: a rank that saved its coverage first would finish the send
    t0 = time.monotonic()
    expect(pc.CollectiveError, lambda: w.wait(timeout=30), "rank 1", "no longer running")
    took = time.monotonic() - t0
    assert took < 5, took
    print(f"dead peer detected within {took:.2f} s", flush=True)
    hard_exit(0)


def args():
    comm = pc.Communicator()
    r, c = comm.rank, comm._host.c
    expect(TypeError, lambda: comm.batch_p2p([("send", np.zeros(1), 1 - r, 0)]), "P2POp")
    expect(ValueError, lambda: pc.P2POp("put", np.zeros(1), 1 - r), "kind")
    x = np.zeros(4, np.float32)
    bad = [
        (TypeError, [("send", [1, 2], 1 - r, 0)], "numpy"),
        (TypeError, [("send", x.astype(np.complex64), 1 - r, 0)], "dtype"),
        (ValueError, [("recv", np.zeros((4, 4), np.float32)[:, 0], 1 - r, 0)], "contiguous"),
        (ValueError, [("recv", np.frombuffer(b"abcd", np.uint8), 1 - r, 0)], "read-only"),
        (ValueError, [("send", x, r, 0)], "peer"),
        (ValueError, [("send", x, 2, 0)], "peer"),
        (TypeError, [("send", x, 1.0, 0)], "peer must be an int"),
        (ValueError, [("send", x, 1 - r, -1)], "tag"),
        (TypeError, [("send", x, 1 - r, "a")], "tag must be an int"),
        (ValueError, [("put", x, 1 - r, 0)], "kind"),
        (TypeError, [("send", x, 1 - r)], "tuple"),
        (TypeError, "send", "list"),
        # A valid op first: nothing may move when a later op is bad.
        (ValueError, [("send", x, 1 - r, 0), ("recv", x, 1 - r, 0)], "overlaps"),
    ]
    for exc, ops, word in bad:
        expect(exc, lambda ops=ops: c.p2p(ops), word)
    # Nothing moved: a real exchange now gets exactly the peer's data.
    y = np.empty(4, np.float32)
    c.p2p([("send", np.full(4, r, np.float32), 1 - r, 0), ("recv", y, 1 - r, 0)])
    assert np.all(y == 1 - r) and not c.poisoned
    assert c.p2p([]) is None
    print(f"args rank {r}", flush=True)
    comm.close()


def args_across():
    """Bad ops to a rank on another node, through the public API: each refused before anything
    moves (a blocking batch to other nodes is checked, posted and waited for in one native
    call); then an exchange gets exactly the peer's data."""
    comm = pc.Communicator()
    r, p = comm.rank, 1 - comm.rank
    assert comm.topology.num_nodes == 2, comm.topology.describe()
    x = np.zeros(4, np.float32)
    bad = [
        (TypeError, [pc.P2POp("send", x.astype(np.complex64), p)], "dtype"),
        (ValueError, [pc.P2POp("recv", np.zeros((4, 4), np.float32)[:, 0], p)], "contiguous"),
        (ValueError, [pc.P2POp("recv", np.frombuffer(b"abcd", np.uint8), p)], "read-only"),
        (ValueError, [pc.P2POp("send", x, 2)], "peer"),
        (TypeError, [pc.P2POp("send", x, 1.0)], "peer must be an int"),
        (ValueError, [pc.P2POp("send", x, p, -1)], "tag"),
        (ValueError, [pc.P2POp("send", x, p, 2**40)], "largest tag"),
        (ValueError, [pc.P2POp("send", x, p), pc.P2POp("recv", x, p)], "overlaps"),
    ]
    for exc, ops, word in bad:
        expect(exc, lambda ops=ops: comm.batch_p2p(ops), word)
    y = np.empty(4, np.float32)
    comm.batch_p2p([pc.P2POp("send", np.full(4, r, np.float32), p), pc.P2POp("recv", y, p)])
    assert np.all(y == p), y
    print(f"args across rank {r}", flush=True)
    comm.close()


def main():
    modes = {"matrix": matrix, "semantics": semantics, "timeout": timeout, "dead": dead}
    modes |= {"args": args, "args-across": args_across, "mismatch-size": lambda: mismatch("size")}
    modes["mismatch-dtype"] = lambda: mismatch("dtype")
    modes |= {"eager": eager, "mismatch-late": mismatch_late, "progress": progress}
    modes["engine"] = engine
    for mode in sys.argv[1].split(","):  # several, one after the other: MODE,MODE,...
        modes[mode]()


if __name__ == "__main__":
    run_main(main)
