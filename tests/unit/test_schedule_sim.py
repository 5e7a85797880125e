"""Every schedule, checked without processes by a symbolic simulator.

Each input element is a symbol (rank, index); a reduction is a nested pair (a, b), so the
simulator knows exactly which contributions an output holds and in what order they were
combined. All ranks run together over bounded FIFO channels (per directed pair, and one
broadcast channel per rank read by every peer), one step at a time; a state where no rank can
move is a deadlock. Checks: every output complete, each contribution exactly once, all-reduce
results combined in the same order on every rank (so bitwise identical), sender and receiver
agree on every message's length and format, nothing read from an output before it is written,
no message longer than a piece, no channel left holding a message. All-to-all, gather,
scatter and the uneven (per-rank counts) forms of all-gather and reduce-scatter run through the
same simulator: every element delivered exactly once, to its place.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from pycollectives import _C

ALL = _C.ALL_PEERS
NONE = _C.NO_PEER
TREE = ("all_reduce", "broadcast", "reduce")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


def leaves(v, acc):
    if isinstance(v, tuple) and v and v[0] == "+":
        leaves(v[1], acc)
        leaves(v[2], acc)
    else:
        acc.append(v)
    return acc


def offsets(lens):
    return [sum(lens[:k]) for k in range(len(lens))]


class Sim:
    """`counts`: per-rank blocks (all-gather, reduce-scatter); `matrix[q][p]`: elements rank q
    sends rank p (all-to-all). Each rank's schedule sees only what its rank knows."""

    def __init__(
        self, algo, coll, n, count, root, piece, slots, oneshot=64 * 1024, counts=None, matrix=None,
        lookahead=False,
    ):  # fmt: skip
        self.n, self.coll, self.count, self.root, self.piece, self.slots = (
            n,
            coll,
            count,
            root,
            piece,
            slots,
        )
        m = count
        self.counts = counts if counts is not None else [m] * n
        self.matrix = matrix if matrix is not None else [[m] * n for _ in range(n)]
        self.steps = []
        for r in range(n):
            kw = {}
            if counts is not None:
                kw["counts"] = counts
            if matrix is not None:
                kw["send_counts"] = matrix[r]
                kw["recv_counts"] = [matrix[q][r] for q in range(n)]
            s = _C.schedule(
                algo, coll, r, n, count, root, piece=piece, oneshot_max_bytes=oneshot,
                lookahead=lookahead, **kw,
            )  # fmt: skip
            self.steps.append(deque(s))
        self.inp = [[("x", r, i) for i in range(self.extents(r)[0])] for r in range(n)]
        if coll == "broadcast":  # in place: the root's initial output is the data
            self.out = [[("x", r, i) for i in range(m)] for r in range(n)]
        else:
            self.out = [[None] * self.extents(r)[1] for r in range(n)]
        self.p2p = {}  # (src, dst) -> deque of (payload, is_acc)
        self.bcast = [[] for _ in range(n)]  # src -> list of (payload, is_acc)
        self.cursor = [[0] * n for _ in range(n)]  # reader -> src -> messages read

    def extents(self, r):
        n, m, root = self.n, self.count, r == self.root
        total = sum(self.counts)
        return {
            "reduce_scatter": (total, self.counts[r]),
            "all_gather": (self.counts[r], total),
            "all_to_all": (sum(self.matrix[r]), sum(row[r] for row in self.matrix)),
            "gather": (m, n * m if root else 0),
            "scatter": (n * m if root else 0, m),
        }.get(self.coll, (m, m))

    # -- channels -----------------------------------------------------------------------------

    def can_send(self, r, to):
        if to == ALL:
            posted = len(self.bcast[r])
            return all(
                self.cursor[q][r] >= posted + 1 - self.slots for q in range(self.n) if q != r
            )
        return len(self.p2p.get((r, to), ())) < self.slots

    def put(self, r, to, payload, is_acc):
        assert len(payload) <= self.piece, "message longer than a piece"
        if to == ALL:
            self.bcast[r].append((payload, is_acc))
        else:
            self.p2p.setdefault((r, to), deque()).append((payload, is_acc))

    def peek(self, r, src, bcast):
        if bcast:
            i = self.cursor[r][src]
            return self.bcast[src][i] if i < len(self.bcast[src]) else None
        q = self.p2p.get((src, r))
        return q[0] if q else None

    def take(self, r, src, bcast, count, is_acc):
        msg = self.peek(r, src, bcast)
        payload, sent_acc = msg
        assert len(payload) == count, f"rank {r} expects {count} from {src}, got {len(payload)}"
        assert sent_acc == is_acc, f"rank {r}: format of message from {src} disagrees"
        if bcast:
            self.cursor[r][src] += 1
        else:
            self.p2p[(src, r)].popleft()
        return payload

    # -- steps --------------------------------------------------------------------------------

    def read(self, r, ref, count):
        buf, off = ref
        vals = (self.inp if buf == "in" else self.out)[r][off : off + count]
        assert len(vals) == count, "read past the end of a buffer"
        assert all(v is not None for v in vals), f"rank {r} reads output before it is written"
        return vals

    def write(self, r, ref, vals):
        buf, off = ref
        assert buf == "out"
        assert off + len(vals) <= len(self.out[r]), "write past the end of the output"
        self.out[r][off : off + len(vals)] = vals

    def try_step(self, r):
        s = self.steps[r][0]
        kind, cnt = s["kind"], s["count"]
        # Which messages a step takes and puts: the executors' own definition (algo/messages.h).
        srcs = s["recv_from"]
        if any(self.peek(r, q, s["bcast"]) is None for q in srcs):
            return False
        if any(not self.can_send(r, t) for t in s["send_to"]):
            return False
        self.steps[r].popleft()
        if kind == "copy":
            self.write(r, s["dst"], self.read(r, s["src"], cnt))
            return True
        if kind == "send":
            vals = self.read(r, s["src"], cnt)
            for t in s["send_to"]:
                self.put(r, t, vals, s["send_acc"])
            return True
        ins = {q: self.take(r, q, s["bcast"], cnt, s["recv_acc"]) for q in srcs}
        if s["reduces"]:
            local = self.read(r, s["src"], cnt)
            if s["from"] == ALL:  # every rank, in rank order
                parts = [local if q == r else ins[q] for q in range(self.n)]
            else:  # op(op(from, src), from2)
                parts = [ins[s["from"]], local] + ([ins[s["from2"]]] if s["from2"] != NONE else [])
            vals = [p[i] for p in parts[:1] for i in range(cnt)]
            for p in parts[1:]:
                vals = [("+", a, b) for a, b in zip(vals, p)]
        else:
            (vals,) = ins.values()
        if kind != "recv_reduce_send":
            self.write(r, s["dst"], vals)
        for t in s["send_to"]:
            self.put(r, t, vals, s["send_acc"])
        return True

    def run(self):
        while any(self.steps):
            moved = False
            for r in range(self.n):
                while self.steps[r] and self.try_step(r):
                    moved = True
            if not moved:
                stuck = {r: self.steps[r][0]["kind"] for r in range(self.n) if self.steps[r]}
                raise AssertionError(f"deadlock: {stuck}")
        assert not any(self.p2p.values()), "messages left in a channel"
        for r in range(self.n):
            for src in range(self.n):
                if src != r:
                    assert self.cursor[r][src] == len(self.bcast[src]), "unread broadcast"
        return self

    # -- results ------------------------------------------------------------------------------

    def check(self):
        n, m, coll = self.n, self.count, self.coll

        def exactly_once(v, want, where):
            got = sorted(leaves(v, []))
            assert got == sorted(want), f"{where}: holds {got}, expected {sorted(want)}"

        for r in range(n):
            if coll == "all_reduce":
                for i in range(m):
                    exactly_once(self.out[r][i], [("x", q, i) for q in range(n)], f"r{r}[{i}]")
                    assert self.out[r][i] == self.out[0][i], f"element {i}: order differs"
            elif coll == "reduce_scatter":
                base = offsets(self.counts)[r]
                for j in range(self.counts[r]):
                    want = [("x", q, base + j) for q in range(n)]
                    exactly_once(self.out[r][j], want, f"r{r}[{j}]")
            elif coll == "all_gather":
                want = [("x", k, j) for k in range(n) for j in range(self.counts[k])]
                assert self.out[r] == want, f"rank {r}"
            elif coll == "all_to_all":
                # Block from q: q's elements for r, from where q keeps them (its send offsets).
                want = [
                    ("x", q, offsets(self.matrix[q])[r] + j)
                    for q in range(n)
                    for j in range(self.matrix[q][r])
                ]
                assert self.out[r] == want, f"rank {r}"
            elif coll == "gather":
                want = [("x", k, j) for k in range(n) for j in range(m)] if r == self.root else []
                assert self.out[r] == want, f"rank {r}"
            elif coll == "scatter":
                assert self.out[r] == [("x", self.root, r * m + j) for j in range(m)], f"rank {r}"
            elif coll == "broadcast":
                assert self.out[r] == [("x", self.root, i) for i in range(m)]
            elif r == self.root:
                for i in range(m):
                    exactly_once(self.out[r][i], [("x", q, i) for q in range(n)], f"r{r}[{i}]")


def cases(algos, sizes, counts, pieces, slots):
    for algo, coll, n, count, piece, k in itertools.product(
        algos, COLLECTIVES, sizes, counts, pieces, slots
    ):
        if algo == "tree" and coll not in TREE:
            continue
        roots = range(n) if coll in ("broadcast", "reduce") else [0]
        for root in roots:
            yield algo, coll, n, count, root, piece, k


@pytest.mark.parametrize("algo", ["ring", "tree", "direct"])
def test_schedules_complete_exactly_once_without_deadlock(algo):
    checked = 0
    for _, coll, n, count, root, piece, k in cases(
        [algo], [1, 2, 3, 4, 5, 6, 8], [0, 1, 7, 13], [1, 3, 64], [2, 3]
    ):
        Sim(algo, coll, n, count, root, piece, k).run().check()
        checked += 1
    assert checked > 100


def test_ring_all_reduce_with_lookahead():
    """The host's ring sends each piece's first message before the previous piece's last
    receive: the same checks, and no deadlock with the fewest slots a channel may have (2)."""
    checked = 0
    for n, count, piece, k in itertools.product(
        [1, 2, 3, 4, 5, 8], [0, 1, 7, 13, 40], [1, 3], [2, 3]
    ):
        Sim("ring", "all_reduce", n, count, 0, piece, k, lookahead=True).run().check()
        checked += 1
    assert checked > 100
    # It changes the order of steps, not of the messages on any channel.
    plain = _C.schedule("ring", "all_reduce", 1, 3, 13, piece=2)
    ahead = _C.schedule("ring", "all_reduce", 1, 3, 13, piece=2, lookahead=True)
    assert plain != ahead
    assert sorted(map(str, plain)) == sorted(map(str, ahead))
    for peer in range(3):
        sent = [[s["src"], s["count"]] for s in plain if peer in s["send_to"]]
        assert sent == [[s["src"], s["count"]] for s in ahead if peer in s["send_to"]]


@pytest.mark.parametrize("n", [2, 3, 5, 7])
@pytest.mark.parametrize("lookahead", [False, True])
def test_twoshot_all_reduce(n, lookahead):
    # With lookahead (the host's), each piece's partials go out before the previous piece's
    # reduced shards come in: no deadlock with 2 slots a channel either.
    for count, piece, k in itertools.product([1, 7, 13, 40], [1, 4], [2, 3]):
        Sim("direct", "all_reduce", n, count, 0, piece, k, oneshot=0,
            lookahead=lookahead).run().check()  # fmt: skip


def test_large_rank_counts():
    for algo in ("ring", "tree", "direct"):
        Sim(algo, "all_reduce", 16, 50, 0, 4, 2).run().check()
        Sim(algo, "reduce", 13, 20, 7, 3, 1).run().check()


def test_double_tree_every_rank_a_leaf_somewhere():
    for n in range(2, 40):
        for r in range(n):
            steps = _C.schedule("tree", "all_reduce", r, n, 2, piece=1)
            # A leaf only sends its own data up and receives the result: interior in at most
            # one of the two trees means at most one step with children (reduce steps).
            assert sum(s["kind"].startswith("recv_reduce") for s in steps) <= 1, (n, r)


def test_one_slot_per_channel_deadlocks():
    # Why the transport insists on two slots per channel: a step holds its incoming slot while
    # it waits for an outgoing one.
    with pytest.raises(AssertionError, match="deadlock"):
        Sim("ring", "all_reduce", 2, 8, 0, 2, 1).run()


def test_simulator_catches_broken_schedules():
    sim = Sim("ring", "all_reduce", 3, 7, 0, 64, 2)
    sim.steps[1].popleft()  # rank 1 skips its first step
    with pytest.raises(AssertionError):
        sim.run().check()
    sim = Sim("tree", "all_reduce", 4, 8, 0, 64, 2)
    steps = list(sim.steps[2])
    sim.steps[2] = deque(steps[1::-1] + steps[2:]) if len(steps) > 1 else deque(steps)
    with pytest.raises(AssertionError):
        sim.run().check()


# -- all-to-all, gather, scatter, uneven all-gather / reduce-scatter ---------------------------

SIZES = [1, 2, 3, 4, 5, 6]


def uneven_counts(n, seed):
    """Per-rank counts with zeros, ones and longer blocks, different for every seed."""
    return [(seed * 7 + 3 * k * k + k) % 9 if (seed + k) % 3 else 0 for k in range(n)]


@pytest.mark.parametrize("coll", ["all_to_all", "gather", "scatter"])
def test_personalised_collectives(coll):
    for n, count, piece, k in itertools.product(SIZES, [0, 1, 7, 13], [1, 3, 64], [2, 3]):
        for root in range(n) if coll != "all_to_all" else [0]:
            Sim("direct", coll, n, count, root, piece, k).run().check()


@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_uneven_splits(n):
    for seed, piece, k in itertools.product(range(4), [1, 2, 5], [2, 3]):
        matrix = [uneven_counts(n, seed * n + q) for q in range(n)]
        Sim("direct", "all_to_all", n, 0, 0, piece, k, matrix=matrix).run().check()
    zeros = [[0] * n for _ in range(n)]
    Sim("direct", "all_to_all", n, 0, 0, 2, 2, matrix=zeros).run().check()


@pytest.mark.parametrize("algo", ["ring", "direct"])
@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter"])
def test_uneven_counts(algo, coll):
    for n, seed, piece, k in itertools.product(SIZES, range(5), [1, 3, 64], [2, 3]):
        counts = uneven_counts(n, seed)
        Sim(algo, coll, n, 0, 0, piece, k, counts=counts).run().check()
    Sim(algo, coll, 4, 0, 0, 2, 2, counts=[0, 0, 0, 0]).run().check()
    Sim(algo, coll, 3, 0, 0, 2, 2, counts=[0, 5, 0]).run().check()


def test_all_to_all_peers_in_shifted_order():
    # At step k of a piece, rank r sends to r+k and receives from r-k: no peer is the target
    # of two ranks in the same step.
    n = 5
    for r in range(n):
        steps = [
            s for s in _C.schedule("direct", "all_to_all", r, n, 1, piece=1) if s["kind"] != "copy"
        ]
        assert [s["to"] for s in steps[0::2]] == [(r + k) % n for k in range(1, n)]
        assert [s["from"] for s in steps[1::2]] == [(r - k) % n for k in range(1, n)]


def test_simulator_catches_disagreeing_splits():
    matrix = [[1, 2], [3, 4]]
    sim = Sim("direct", "all_to_all", 2, 0, 0, 8, 2, matrix=matrix)
    # Rank 1 expects 4 elements from rank 0 where rank 0 sends 2.
    sim.steps[1] = deque(
        _C.schedule(
            "direct", "all_to_all", 1, 2, 0, piece=8, send_counts=[3, 4], recv_counts=[4, 4]
        )
    )
    with pytest.raises(AssertionError):
        sim.run().check()
