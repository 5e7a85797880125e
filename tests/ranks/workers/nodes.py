"""A communicator over several nodes, and its sub-communicators (split).

Under an env:// launch (torchrun, or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) with no MPI world, each process names its machine with PYCOLL_HOST_ID: shared
memory inside each node, gloo between them. Under mpiexec, PYCOLL_RANKS_PER_NODE emulates the
nodes: MPI between them.

Usage: RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. PYCOLL_HOST_ID=.. python nodes.py CASE
   or: PYCOLL_RANKS_PER_NODE=k mpiexec -n N python nodes.py CASE
CASE: collectives, blocks, messages, split, random_splits, reproducible, mismatch, p2p_mismatch,
or several, comma-separated (a mismatch last: it leaves the communicator unusable).
"""

from __future__ import annotations

import os
import socket
import sys

import checks
import numpy as np
from checks import (
    check_close,
    digest,
    expect,
    is_float,
    make_input,
    reference,
    run_main,
    valid,
)

import pycollectives as pc

OPS = ["sum", "max", "avg"]


def nodes_expected(comm) -> list:
    """The nodes every rank should see: ranks grouped by their PYCOLL_HOST_ID, in blocks of
    PYCOLL_RANKS_PER_NODE consecutive ranks (or dealt round-robin), or by host name."""
    if os.environ.get("PYCOLL_HOST_ID"):
        hosts = comm.all_gather_object(os.environ["PYCOLL_HOST_ID"])
    elif not os.environ.get("PYCOLL_RANKS_PER_NODE"):  # machines, or namespace nodes
        hosts = comm.all_gather_object(socket.gethostname())
    else:
        given = os.environ["PYCOLL_RANKS_PER_NODE"]
        number, _, layout = given.partition(":")
        k = int(number)
        cyclic = max(1, comm.size // k)  # round-robin over this many nodes
        hosts = [r % cyclic if layout else r // k for r in range(comm.size)]
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
    for algorithm, dtypes in ((None, checks.DTYPES), ("ring", flat_dtypes)):
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
    # Ranks 0, 1, 3 and the last: nodes of different sizes where the world spans several.
    members = sorted({0, 1, 3 % n, n - 1})
    sub = comm.split(0 if r in members else None)
    if r in members:
        x = np.full(5, r + 1, np.int64)
        sub.all_reduce(x)
        np.testing.assert_array_equal(x, np.full(5, sum(members) + len(members)))
        sub.close()
    else:
        assert sub is None


def random_splits(comm, rounds=12):
    """Random colors (some ranks in none) and keys, the same on every rank from one seed per
    round: each sub-communicator as MPI_Comm_split makes it (members of a color ranked by key,
    then rank; under mpiexec, MPI's own split compared), on the nodes its members are on, and
    its five hierarchical collectives against numpy, the same bits on every member. Every
    other round places its members unevenly over the nodes."""
    r, n = comm.rank, comm.size
    node_of = {q: i for i, m in enumerate(nodes_expected(comm)) for q in m}
    mpi = comm._group.mpi
    for k in range(rounds):
        rng = np.random.default_rng(7000 + k)
        colors, keys = rng.integers(-1, 3, n), rng.integers(0, 3, n)
        if k % 2:  # every other round one color, over members placed unevenly on the nodes
            colors = _uneven_members(rng, node_of, n, colors)
        color = None if colors[r] < 0 else int(colors[r])
        sub = comm.split(color, key=int(keys[r]))
        if mpi is not None:
            from mpi4py import MPI

            ref = mpi.Split(MPI.UNDEFINED if color is None else color, int(keys[r]))
            if color is not None:
                assert (ref.rank, ref.size) == (sub.rank, sub.size), (k, ref.rank, sub.rank)
                ref.Free()
        if color is None:
            assert sub is None, k
            continue
        members = sorted((q for q in range(n) if colors[q] == color), key=lambda q: (keys[q], q))
        assert (sub.rank, sub.size) == (members.index(r), len(members)), (k, members)
        hosts = [node_of[q] for q in members]
        order = list(dict.fromkeys(hosts))
        want_nodes = [[s for s, h in enumerate(hosts) if h == node] for node in order]
        assert sub.topology.nodes == want_nodes, (k, sub.topology.describe(), want_nodes)
        with sub:
            _five(sub, members, f"round {k} {sub.topology.describe()}")


def _uneven_members(rng, node_of, n, colors):
    """Colors 0 and -1 (none) where the 0s span several nodes, not as many on each; `colors`
    where 100 draws found no such set (one node, one rank per node)."""
    for _ in range(100):
        chosen = rng.random(n) < 0.6
        per_node = np.bincount([node_of[q] for q in range(n) if chosen[q]])
        per_node = per_node[per_node > 0]
        if len(per_node) > 1 and len(set(per_node)) > 1:
            return np.where(chosen, 0, -1)
    return colors


def _five(sub, members, where):
    """All-reduce (sum, avg), reduce-scatter, all-gather, broadcast and reduce on `sub` (whose
    rank s is rank members[s] of the world) against numpy; the same bits on every member."""
    s, m = sub.rank, sub.size
    count = 3 * m + 1
    outputs = []
    for dt, op in ((np.dtype(np.float32), "sum"), (np.dtype(np.float64), "avg"),
                   (np.dtype(np.int32), "max")):  # fmt: skip
        inputs = [make_input(members[q], count * m, dt, op) for q in range(m)]
        want = reference(inputs, op, dt)
        x = inputs[s][:count].copy()
        sub.all_reduce(x, op=op)
        check_close(x, reference([a[:count] for a in inputs], op, dt), dt, m,
                    f"{where}: all_reduce {dt} {op}", op)  # fmt: skip
        out = np.empty(count, dt)
        sub.reduce_scatter(inputs[s].copy(), out, op=op)
        check_close(out, want[s * count : (s + 1) * count], dt, m,
                    f"{where}: reduce_scatter {dt} {op}", op)  # fmt: skip
        root = (m - 1 + len(outputs)) % m
        red = np.zeros(count, dt)
        sub.reduce(inputs[s][:count].copy(), red, root=root, op=op)
        if s == root:
            check_close(red, reference([a[:count] for a in inputs], op, dt), dt, m,
                        f"{where}: reduce {dt} {op} root={root}", op)  # fmt: skip
        outputs.append((f"{where}: all_reduce {dt} {op}", x))
    blocks = np.empty(m * 4, np.int64)
    sub.all_gather(np.arange(4, dtype=np.int64) + 10 * members[s], blocks)
    want = np.concatenate([np.arange(4) + 10 * q for q in members])
    np.testing.assert_array_equal(blocks, want, err_msg=f"{where}: all_gather")
    for root in {0, m - 1}:
        b = np.full(6, members[s], np.float32)
        sub.broadcast(b, root=root)
        np.testing.assert_array_equal(b, np.full(6, members[root]), err_msg=f"{where}: bcast")
    same_everywhere(sub, outputs)


def mismatch(comm):
    """Ranks on different nodes that disagree on a count: CollectiveMismatch on every rank
    before any data moves (the disagreement is only between nodes)."""
    nodes = nodes_expected(comm)
    node = next(i for i, m in enumerate(nodes) if comm.rank in m)
    x = np.ones(10 + node, np.float32)
    expect(pc.CollectiveMismatch, lambda: comm.all_reduce(x), "count")


def reproducible(comm):
    """Reductions in rank order (a call's reproducible=): workers/reproducible.py's matrix, one
    algorithm per case in turn, the float dtypes and int32. Over gloo, whose own reductions
    add in an order of their own, the ranks trade blocks and fold them in rank order."""
    from reproducible import matrix

    dtypes = [dt for dt in checks.DTYPES if is_float(dt) or dt == np.dtype(np.int32)]
    matrix(comm, dtypes, (3001,), rotate=True, reproducible=True)


CASES = {"collectives": collectives, "blocks": blocks, "messages": messages, "split": split,
         "random_splits": random_splits, "reproducible": reproducible, "mismatch": mismatch,
         "p2p_mismatch": p2p_mismatch}  # fmt: skip
LAST = ("mismatch", "p2p_mismatch")  # they leave the communicator unusable


def main():
    """Runs the cases named (comma-separated) one after the other on one communicator; each
    reports "rank R ok CASE" or "rank R failed CASE: why" (mismatch leaves it unusable: last)."""
    with pc.Communicator(timeout=30) as comm:
        # met through the store (no MPI world), or through MPI under mpiexec
        assert (comm._group.mpi is None) == ("PMI_RANK" not in os.environ)
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
