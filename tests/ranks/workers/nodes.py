"""A communicator over several nodes, and its sub-communicators (split).

Under an env:// launch (torchrun, or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) with no MPI world, each process names its machine with PYCOLL_HOST_ID: shared
memory inside each node, gloo between them. Under mpiexec, PYCOLL_RANKS_PER_NODE emulates the
nodes: MPI between them.

Usage: RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. PYCOLL_HOST_ID=.. python nodes.py CASE
   or: PYCOLL_RANKS_PER_NODE=k mpiexec -n N python nodes.py CASE
CASE: collectives, blocks, messages, split, mismatch, p2p_mismatch, or several,
comma-separated (a mismatch last: it leaves the communicator unusable).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from checks import DTYPES, check_close, digest, expect, make_input, reference, run_main, valid

import pycollectives as pc

OPS = ["sum", "max", "avg"]


def nodes_expected(comm) -> list:
    """The nodes every rank should see: ranks grouped by their PYCOLL_HOST_ID, or in blocks
    of PYCOLL_RANKS_PER_NODE consecutive ranks."""
    if os.environ.get("PYCOLL_HOST_ID"):
        hosts = comm.all_gather_object(os.environ["PYCOLL_HOST_ID"])
    else:
        k = int(os.environ.get("PYCOLL_RANKS_PER_NODE") or comm.size)
        hosts = [r // k for r in range(comm.size)]
    order = list(dict.fromkeys(hosts))
    return [[r for r, h in enumerate(hosts) if h == name] for name in order]


def same_everywhere(comm, outputs):
    mine = [digest(a) for _, a in outputs]
    for theirs in comm.all_gather_object(mine):
        for (what, _), d, e in zip(outputs, mine, theirs):
            assert d == e, f"{what}: results differ bitwise between ranks"


def collectives(comm):
    """The five hierarchical collectives (and each flat over gloo) against numpy."""
    r, n = comm.rank, comm.size
    flat_dtypes = [np.dtype(np.float32), np.dtype(np.int64)]  # gloo's, over all ranks
    for algorithm, dtypes in ((None, DTYPES), ("ring", flat_dtypes)):
        for dt in dtypes:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in (1, 3 * n + 1, 1000):
                    what = f"{dt.name} {op} count={count} algorithm={algorithm}"
                    inputs = [make_input(q, count, dt, op) for q in range(n)]
                    want = reference(inputs, op, dt)
                    x = inputs[r].copy()
                    comm.all_reduce(x, op=op, algorithm=algorithm)
                    check_close(x, want, dt, n, f"all_reduce {what}", op)
                    out = np.empty(count, dt)
                    parts = [make_input(q, n * count, dt, op, 1) for q in range(n)]
                    comm.reduce_scatter(parts[r], out, op=op, algorithm=algorithm)
                    rs_want = reference(parts, op, dt)[r * count : (r + 1) * count]
                    check_close(out, rs_want, dt, n, f"reduce_scatter {what}", op)
                    red = inputs[r].copy()
                    root = n - 1
                    comm.reduce(red, root=root, op=op, algorithm=algorithm)
                    if r == root:
                        check_close(red, want, dt, n, f"reduce {what}", op)
                    else:
                        assert np.array_equal(red.view(np.uint8), inputs[r].view(np.uint8)), (
                            f"reduce {what}: input of rank {r} changed"
                        )
                    same_everywhere(comm, [(f"all_reduce {what}", x)])
            for count in (1, 1000):
                x = make_input(r, count, dt, "sum")
                out = np.empty(n * count, dt)
                comm.all_gather(x, out, algorithm=algorithm)
                want = np.concatenate([make_input(q, count, dt, "sum") for q in range(n)])
                assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), f"all_gather {dt}"
                for root in (0, n - 1):
                    b = make_input(r, count, dt, "sum", 2)
                    comm.broadcast(b, root=root, algorithm=algorithm)
                    want = make_input(root, count, dt, "sum", 2)
                    assert np.array_equal(b.view(np.uint8), want.view(np.uint8)), f"bcast {dt}"


def blocks(comm):
    """All-to-all (even and uneven), gather, scatter, uneven all-gather and reduce-scatter."""
    r, n = comm.rank, comm.size
    x = np.arange(n * 3, dtype=np.float32) + 100 * r
    out = np.empty_like(x)
    comm.all_to_all(x, out)
    want = np.concatenate(
        [np.arange(r * 3, r * 3 + 3, dtype=np.float32) + 100 * q for q in range(n)]
    )
    np.testing.assert_array_equal(out, want)
    send = [q + 1 for q in range(n)]  # rank r sends q+1 elements to rank q
    recv = [r + 1] * n
    x = np.concatenate([np.full(q + 1, 10 * r + q, np.int64) for q in range(n)])
    out = np.empty(sum(recv), np.int64)
    comm.all_to_all(x, out, in_splits=send, out_splits=recv)
    np.testing.assert_array_equal(
        out, np.concatenate([np.full(r + 1, 10 * q + r) for q in range(n)])
    )
    g = np.full(5, r, np.int32)
    gout = np.empty(5 * n, np.int32) if r == 1 else None
    comm.gather(g, gout, root=1)
    if r == 1:
        np.testing.assert_array_equal(gout, np.repeat(np.arange(n, dtype=np.int32), 5))
    s = np.arange(4 * n, dtype=np.float64) if r == 2 % n else None
    sout = np.empty(4)
    comm.scatter(s, sout, root=2 % n)
    np.testing.assert_array_equal(sout, np.arange(4 * r, 4 * r + 4, dtype=np.float64))
    counts = [q + 1 for q in range(n)]
    x = np.full(r + 1, r, np.float64)
    out = np.empty(sum(counts))
    comm.all_gather(x, out, counts=counts)
    np.testing.assert_array_equal(out, np.repeat(np.arange(n, dtype=np.float64), counts))
    x = np.arange(sum(counts), dtype=np.float64) * (r + 1)
    out = np.empty(counts[r])
    comm.reduce_scatter(x, out, counts=counts)
    start = sum(counts[:r])
    want = np.arange(start, start + counts[r], dtype=np.float64) * (n * (n + 1) / 2)
    np.testing.assert_array_equal(out, want)


def messages(comm):
    """A plain ring exchange (every rank sends right, then receives from the left), which
    crosses nodes; then a batch of sends and receives to every rank at once."""
    r, n = comm.rank, comm.size
    x = np.arange(50_000, dtype=np.float32) + r
    got = np.empty_like(x)
    work = comm.send(x, (r + 1) % n, tag=3, async_op=True)
    comm.recv(got, (r - 1) % n, tag=3)
    work.wait()
    np.testing.assert_array_equal(got, np.arange(50_000, dtype=np.float32) + (r - 1) % n)
    outs = {q: np.empty(7, np.int64) for q in range(n) if q != r}
    ops = [pc.P2POp("send", np.full(7, 100 * r + q, np.int64), q) for q in outs]
    ops += [pc.P2POp("recv", outs[q], q) for q in outs]
    comm.batch_p2p(ops)
    for q, a in outs.items():
        np.testing.assert_array_equal(a, np.full(7, 100 * q + r))


def p2p_mismatch(comm):
    """Rank r and r ^ 1 (on two nodes where the machines alternate): 6 elements sent, 5
    expected. Both ends raise, the receiver's array untouched (and, as on one node, the
    communicator is unusable after)."""
    r, peer = comm.rank, comm.rank ^ 1
    if peer >= comm.size:
        return
    big = 2**31 - 1  # past gloo's tags (3 per message), refused before anything moves
    if comm.topology.node_of[peer] != comm.topology.node_of[r] and comm._group.mpi is None:
        expect(ValueError, lambda: comm.send(np.ones(1), peer, tag=big), "largest tag")
    if r % 2 == 0:
        expect(pc.CollectiveMismatch, lambda: comm.send(np.ones(6, np.float32), peer),
               "rank", str(peer), "receives 5 x float32")  # fmt: skip
    else:
        into = np.full(5, -1.0, np.float32)
        expect(pc.CollectiveMismatch, lambda: comm.recv(into, peer), "sends 6 x float32")
        assert (into == -1).all(), into


def split(comm):
    """Sub-communicators: the ranks of each node; one rank per node (across nodes, over
    gloo); the odd ranks, ranked backwards."""
    r, n = comm.rank, comm.size
    nodes = nodes_expected(comm)
    node = next(i for i, members in enumerate(nodes) if r in members)
    with comm.split(node) as inside:
        assert inside.topology.num_nodes == 1 and inside.size == len(nodes[node])
        x = np.array([r], np.int64)
        inside.all_reduce(x)
        assert x[0] == sum(nodes[node]), (x, nodes)
    local = nodes[node].index(r)
    across = comm.split(0 if local == 0 else None)
    if local == 0:
        assert across.size == len(nodes) and across.topology.num_nodes == len(nodes)
        x = np.full(10, r, np.float64)
        across.all_reduce(x)
        np.testing.assert_array_equal(x, np.full(10, sum(m[0] for m in nodes)))
        across.close()
    else:
        assert across is None
    odd = comm.split(r % 2, key=-r)
    members = sorted((q for q in range(n) if q % 2 == r % 2), reverse=True)
    assert (odd.rank, odd.size) == (members.index(r), len(members)), (odd.rank, members)
    got = odd.all_gather_object(r)
    assert got == members, got
    want_nodes = len({next(i for i, m in enumerate(nodes) if q in m) for q in members})
    assert odd.topology.num_nodes == want_nodes, (odd.topology.describe(), nodes)
    x = np.full(3, r, np.int32)
    odd.all_reduce(x, op="max")
    np.testing.assert_array_equal(x, np.full(3, max(members)))
    odd.close()
    expect(TypeError, lambda: comm.split(1.5), "color")
    # Ranks 0, 1, 3 and the last: nodes of different sizes (over several nodes) are refused on
    # every member alike, before anything is set up.
    members = sorted({0, 1, 3 % n, n - 1})
    sizes = {sum(q in node for q in members) for node in nodes} - {0}
    if r not in members:
        assert comm.split(None) is None
    elif len(sizes) > 1:
        expect(ValueError, lambda: comm.split(0), "same number of ranks on every node")
    else:
        comm.split(0).close()


def mismatch(comm):
    """Ranks on different nodes that disagree on a count: CollectiveMismatch on every rank
    before any data moves (the disagreement is only between nodes)."""
    nodes = nodes_expected(comm)
    node = next(i for i, m in enumerate(nodes) if comm.rank in m)
    x = np.ones(10 + node, np.float32)
    expect(pc.CollectiveMismatch, lambda: comm.all_reduce(x), "count")


CASES = {"collectives": collectives, "blocks": blocks, "messages": messages, "split": split,
         "mismatch": mismatch, "p2p_mismatch": p2p_mismatch}  # fmt: skip
LAST = ("mismatch", "p2p_mismatch")  # they leave the communicator unusable


def main():
    """Runs the cases named (comma-separated) one after the other on one communicator; each
    reports "rank R ok CASE" or "rank R failed CASE: why" (mismatch leaves it unusable: last)."""
    with pc.Communicator(timeout=30) as comm:
        # met through the store (no MPI world), or through MPI under mpiexec
        assert (comm._group.mpi is None) == ("PYCOLL_HOST_ID" in os.environ)
        nodes = nodes_expected(comm)
        assert comm.topology.nodes == nodes, (comm.topology.describe(), nodes)
        for case in sys.argv[1].split(","):
            try:
                CASES[case](comm)
                if case not in LAST:
                    comm.barrier()
                line = f"rank {comm.rank} ok {case}"
            except Exception as e:  # reported by the test of this case, with the rank
                line = f"rank {comm.rank} failed {case}: {type(e).__name__}: {e}"
            sys.stdout.write(line.replace("\n", " ") + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    run_main(main)
