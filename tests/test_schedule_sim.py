"""Every schedule, checked without processes by a symbolic simulator.

Each input element is a symbol (rank, index); a reduction is a nested pair (a, b), so the
simulator knows exactly which contributions an output holds and in what order they were
combined. All ranks run together over bounded FIFO channels (per directed pair, and one
broadcast channel per rank read by every peer), one step at a time; a state where no rank can
move is a deadlock. Checks: every output complete, each contribution exactly once, all-reduce
results combined in the same order on every rank (so bitwise identical), sender and receiver
agree on every message's length and format, nothing read from an output before it is written,
no message longer than a piece, no channel left holding a message.
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


class Sim:
    def __init__(self, algo, coll, n, count, root, piece, slots, oneshot=64 * 1024):
        self.n, self.coll, self.count, self.root, self.piece, self.slots = (
            n,
            coll,
            count,
            root,
            piece,
            slots,
        )
        self.steps = [
            deque(
                _C.schedule(algo, coll, r, n, count, root, piece=piece, oneshot_max_bytes=oneshot)
            )
            for r in range(n)
        ]
        m = count
        in_len = {"reduce_scatter": n * m}.get(coll, m)
        out_len = {"all_gather": n * m}.get(coll, m)
        self.inp = [[("x", r, i) for i in range(in_len)] for r in range(n)]
        if coll == "broadcast":  # in place: the root's initial output is the data
            self.out = [[("x", r, i) for i in range(out_len)] for r in range(n)]
        else:
            self.out = [[None] * out_len for _ in range(n)]
        self.p2p = {}  # (src, dst) -> deque of (payload, is_acc)
        self.bcast = [[] for _ in range(n)]  # src -> list of (payload, is_acc)
        self.cursor = [[0] * n for _ in range(n)]  # reader -> src -> messages read

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
                for j in range(m):
                    want = [("x", q, r * m + j) for q in range(n)]
                    exactly_once(self.out[r][j], want, f"r{r}[{j}]")
            elif coll == "all_gather":
                assert self.out[r] == [("x", k, j) for k in range(n) for j in range(m)]
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


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_twoshot_all_reduce(n):
    for count, piece, k in itertools.product([1, 7, 13, 40], [1, 4], [2, 3]):
        Sim("direct", "all_reduce", n, count, 0, piece, k, oneshot=0).run().check()


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
