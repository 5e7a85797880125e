"""Point-to-point send/recv (Communicator.send/recv/batch_p2p, and HostComm.p2p's own checks)
against mpi4py's own Send/Recv of the same data.

Usage: mpiexec -n N python p2p.py matrix|semantics|eager|mismatch-size|mismatch-dtype|
                                  mismatch-late|timeout|dead|args
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from common import DTYPES, expect, make_input, run_main
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
    for dt in DTYPES:
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
        print(f"PASS p2p matrix ranks={n}", flush=True)
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
        print("PASS p2p semantics", flush=True)
    comm.close()


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
        print("PASS p2p eager", flush=True)
    comm.close()


def mismatch_late():
    """An eager message that does not fit a recv posted after it arrived (it waited in the
    unexpected queue): both ranks raise."""
    comm = pc.Communicator(staging_bytes=SLOT)
    r = comm.rank
    if r == 0:
        ops = [("send", np.ones(10, np.float32), 1, 4), ("send", np.ones(3, np.int8), 1, 8)]
        msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, ops), "rank 1")
    else:
        ok = np.zeros(3, np.int8)
        comm.recv(ok, 0, tag=8)  # drains tag 4's message into the unexpected queue
        assert np.all(ok == 1)
        y = np.empty(11, np.float32)
        msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, [("recv", y, 0, 4)]), "rank 0")
    assert all(w in msg for w in ("tag 4", "10 x float32", "11 x float32")), msg
    print(f"PASS mismatch late rank {r}", flush=True)


def mismatch(field):
    comm = pc.Communicator(staging_bytes=SLOT)
    r = comm.rank
    if r == 0:
        x = np.ones(10, np.float32)
        msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, [("send", x, 1, 4)]), "rank 1")
    else:
        y = np.empty(12, np.float32) if field == "size" else np.empty(10, np.int32)
        msg = expect(pc.CollectiveMismatch, lambda: p2p(comm, [("recv", y, 0, 4)]), "rank 0")
    want = ["tag 4", "10 x float32", "12 x float32" if field == "size" else "10 x int32"]
    assert all(w in msg for w in want), msg
    # The communicator is poisoned: the next operation says why at once.
    expect(pc.CollectiveError, lambda: p2p(comm, [("send", x if r == 0 else y, 1 - r, 5)]),
           "earlier error")  # fmt: skip
    print(f"PASS mismatch {field} rank {r}", flush=True)


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
        print(f"PASS timeout after {took:.2f} s", flush=True)
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
        os._exit(0)
    t0 = time.monotonic()
    expect(pc.CollectiveError, lambda: w.wait(timeout=30), "rank 1", "no longer running")
    took = time.monotonic() - t0
    assert took < 5, took
    print(f"PASS dead peer detected within {took:.2f} s", flush=True)
    os._exit(0)


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
    print(f"PASS args rank {r}", flush=True)
    comm.close()


if __name__ == "__main__":
    modes = {"matrix": matrix, "semantics": semantics, "timeout": timeout, "dead": dead}
    modes |= {"args": args, "mismatch-size": lambda: mismatch("size")}
    modes["mismatch-dtype"] = lambda: mismatch("dtype")
    modes |= {"eager": eager, "mismatch-late": mismatch_late}
    run_main(modes[sys.argv[1]])
