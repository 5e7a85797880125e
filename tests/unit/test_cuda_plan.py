"""Planning for the CUDA kernels (pure host code, no GPU): the device steps are the schedule's
steps, message counts pair up between ranks, and per-block slices tile every message."""

from __future__ import annotations

import pytest

from pycollectives import _C

cu = pytest.importorskip("pycollectives._cuda")

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
CODES = {name: i for i, name in enumerate(COLLECTIVES + ["all_to_all", "gather", "scatter"])}
ALGOS = {"ring": 1, "tree": 2, "direct": 3}
FLOAT16, FLOAT32 = 4, 6
BUFS = {0: "", 1: "in", 2: "out"}
PARTIAL = ("all_reduce", "reduce_scatter", "reduce")


def plans(collective, algo, size, count, root, dtype, slot, lists=None):
    """Every rank's plan; `lists(rank)`: that rank's per-rank counts as keywords."""
    c = CODES[collective]
    return [
        cu.plan(c, ALGOS[algo], r, size, count, root, dtype, slot, **(lists(r) if lists else {}))
        for r in range(size)
    ]


def check_plans(collective, algo, size, count, root, slot, lists=None):
    """Each rank's plan is its schedule's steps in the kernel's format, no message is larger
    than a slot, and what one rank sends on a channel the other end receives."""
    for dtype in (FLOAT32, FLOAT16):
        acc = 4
        partial = collective in PARTIAL
        esize = 4 if dtype == FLOAT32 else 2
        piece = slot // (acc if partial else esize)
        ps = plans(collective, algo, size, count, root, dtype, slot, lists)
        for r, p in enumerate(ps):
            kw = lists(r) if lists else {}
            want = _C.schedule(
                algo, collective, r, size, count, root, piece, acc, shard_align=16, **kw
            )
            assert len(p["steps"]) == len(want)
            for got, w in zip(p["steps"], want):
                kind, flags, src_buf, dst_buf, frm, frm2, to, to2, n, src_off, dst_off = got
                assert kind == w["kind"]
                assert (frm, frm2, to, to2) == (w["from"], w["from2"], w["to"], w["to2"])
                assert n == w["count"]
                if kind != "copy":  # a local copy needs no staging slot
                    assert n * (acc if partial else esize) <= slot
                assert bool(flags & 1) == w["recv_acc"] and bool(flags & 2) == w["send_acc"]
                assert bool(flags & 4) == w["bcast"]
                assert (BUFS[src_buf], src_off) == w["src"]
                assert (BUFS[dst_buf], dst_off) == w["dst"]
        for a in range(size):
            for b in range(size):
                if a != b:
                    assert ps[a]["sent"][b] == ps[b]["received"][a]
                    assert ps[a]["bcast_sent"] == ps[b]["bcast_received"][a]


CASES = [
    (coll, algo, size, count)
    for coll in COLLECTIVES
    for algo in ALGOS
    if algo != "tree" or coll in ("all_reduce", "broadcast", "reduce")
    for size in (1, 2, 3, 4, 5)
    for count in (0, 1, 7, 1000, 5000)
]


@pytest.mark.parametrize("collective,algo,size,count", CASES)
def test_plan_is_the_schedule(collective, algo, size, count):
    check_plans(collective, algo, size, count, size - 1, 4096)


@pytest.mark.parametrize("collective", ["all_to_all", "gather", "scatter"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 7, 5000])
def test_direct_only_plans_are_the_schedule(collective, size, count):
    for root in range(size) if collective != "all_to_all" else [0]:
        check_plans(collective, "direct", size, count, root, 4096)


def split_matrix(size, long):
    """Row q: what rank q sends to each rank; zeros, short blocks and one long one."""
    return [[(q * 3 + p * 5) % 4 * (q != p or q == 1) + long * (p == q == 0) for p in range(size)]
            for q in range(size)]  # fmt: skip


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("long", [0, 5000])
def test_plans_with_per_rank_counts_are_the_schedule(size, long):
    m = split_matrix(size, long)
    splits = lambda r: {"send_counts": m[r], "recv_counts": [row[r] for row in m]}  # noqa: E731
    check_plans("all_to_all", "direct", size, 0, 0, 4096, splits)
    counts = m[0]  # the same list on every rank
    for collective in ("all_gather", "reduce_scatter"):
        for algo in ("ring", "direct"):
            check_plans(collective, algo, size, sum(counts), 0, 4096, lambda r: {"counts": counts})


def test_plans_with_per_rank_counts_refuse_bad_lists():
    with pytest.raises(ValueError, match="entries"):
        cu.plan(CODES["all_gather"], 1, 0, 3, 3, 0, FLOAT32, 4096, counts=[1, 2])
    with pytest.raises(ValueError, match="sum of counts"):
        cu.plan(CODES["all_gather"], 1, 0, 2, 4, 0, FLOAT32, 4096, counts=[1, 2])
    with pytest.raises(ValueError, match="together"):
        cu.plan(CODES["all_to_all"], 3, 0, 2, 0, 0, FLOAT32, 4096, send_counts=[1, 2])


@pytest.mark.parametrize("algo", ["ring", "direct"])
@pytest.mark.parametrize("size", [2, 3, 5, 7])
def test_all_reduce_shards_keep_slices_vectorised(algo, size):
    # Ring and two-shot shards of whole 16-byte words: every step's offsets, and so every
    # block's slice, start on a 16-byte boundary of a 16-byte-aligned array, for every type.
    count = 5000 if algo == "ring" else 100_000  # two-shot above the one-shot limit
    for dtype, esize in ((0, 1), (FLOAT16, 2), (FLOAT32, 4), (7, 8)):
        for r, p in enumerate(plans("all_reduce", algo, size, count, 0, dtype, 4096)):
            for step in p["steps"]:
                src_off, dst_off = step[9], step[10]
                assert src_off * esize % 16 == 0 and dst_off * esize % 16 == 0, (r, step)


@pytest.mark.parametrize("nblocks", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 65536, 65537])
def test_block_slices_tile_the_message(n, nblocks):
    covered = 0
    for b in range(nblocks):
        lo, hi = cu.block_slice(n, nblocks, b)
        assert lo == covered or lo == hi == n
        assert lo % 16 == 0 or lo == n  # 16-byte aligned for every element type
        covered = hi
    assert covered == n


@pytest.mark.parametrize("slot", [4096, 64 << 10, 1 << 20])
@pytest.mark.parametrize("nblocks", [1, 3, 16, 32])
def test_channels_carry_each_message_in_as_few_blocks_as_hold_it(slot, nblocks):
    # The blocks a message uses tile it, each slice fits its block's sub-slot in every wire
    # type, and small messages use few blocks (the others skip them, flags and all).
    sub = cu.segment_layout(4, 4, nblocks, slot)["sub_slot_bytes"]
    for n in (0, 1, 15, 17, 100, 1000, 4096, 65537, slot // 4, slot // 2, slot):
        covered, used = 0, 0
        for b in range(nblocks):
            lo, hi = cu.channel_slice(n, nblocks, slot, b)
            assert lo == covered or lo == hi == n, (n, b, lo, hi)
            assert lo % 16 == 0 or lo == n
            if hi > lo:
                used += 1
                assert all((hi - lo) * w <= sub for w in (1, 2, 4, 8) if n * w <= slot)
            covered = hi
        assert covered == n
        if n * 8 <= sub - 128:
            assert used <= 1, (n, used)


@pytest.mark.parametrize("slot", [4096, 1 << 20, 3 << 20])
@pytest.mark.parametrize("nblocks", [1, 4, 8, 32])
def test_sub_slots_hold_the_largest_slice(slot, nblocks):
    layout = cu.segment_layout(4, 4, nblocks, slot)
    for wire in (1, 2, 4, 8):  # bytes per element on the wire
        piece = slot // wire
        largest = max(
            hi - lo for lo, hi in (cu.block_slice(piece, nblocks, b) for b in range(nblocks))
        )
        assert largest * wire <= layout["sub_slot_bytes"]
    assert layout["sub_slot_bytes"] % 256 == 0 and layout["flags_bytes"] % 256 == 0
    assert (
        layout["total_bytes"] >= layout["flags_bytes"] + nblocks * 5 * 4 * layout["sub_slot_bytes"]
    )


def test_plan_limits():
    with pytest.raises(ValueError, match="at most"):
        cu.plan(0, 1, 0, cu.MAX_RANKS + 1, 10, 0, FLOAT32, 4096)
    with pytest.raises(ValueError, match="not available"):
        cu.plan(2, 2, 0, 2, 10, 0, FLOAT32, 4096)  # tree all-gather


# The LL format (device/plan.h, ll_message): which messages use it is a function of the message
# (count, wire type) and the layout, computed by each end for its own side of the message.
DTYPES = {  # name: (code, element bytes, accumulation bytes)
    "int8": (0, 1, 1), "uint8": (1, 1, 1), "int32": (2, 4, 4), "int64": (3, 8, 8),
    "float16": (4, 2, 4), "bfloat16": (5, 2, 4), "float32": (6, 4, 4), "float64": (7, 8, 8),
}  # fmt: skip
RECEIVES = ("recv", "recv_reduce_send", "recv_reduce_copy", "recv_reduce_copy_send",
            "recv_copy_send")  # fmt: skip
SENDS = ("send", "recv_reduce_send", "recv_reduce_copy_send", "recv_copy_send")
# (slot bytes, blocks): the CUDA transport's default layout, the emulated device's default and
# its small-slot one, where LL messages span several blocks.
LL_LAYOUTS = [(1 << 20, 16), (64 << 10, 4), (4096, 4)]


def channel_messages(plan, rank, size, elem, acc):
    """What each message of `rank`'s plan is, as this end sees it, on each channel: (count,
    wire bytes, LL?), in order. Channels: (sender, receiver), or (sender, "bcast", receiver)."""
    sent, received = {}, {}
    for kind, flags, _, _, frm, frm2, to, to2, count, _, _ in plan["steps"]:
        if kind in RECEIVES:
            wire = acc if flags & cu.RECV_ACC else elem
            peers = [q for q in range(size) if q != rank] if frm == -2 else [frm, frm2]
            for q in (q for q in peers if q != -1):
                ch = (q, "bcast", rank) if flags & cu.RECV_BCAST else (q, rank)
                received.setdefault(ch, []).append((count, wire, bool(flags & cu.RECV_LL)))
        if kind in SENDS:
            wire = acc if flags & cu.SEND_ACC else elem
            for t in (t for t in (to, to2) if t != -1):
                ends = (
                    [(rank, "bcast", q) for q in range(size) if q != rank]
                    if t == -2
                    else [(rank, t)]
                )
                for ch in ends:
                    sent.setdefault(ch, []).append((count, wire, bool(flags & cu.SEND_LL)))
    return sent, received


@pytest.mark.parametrize("slot,nblocks", LL_LAYOUTS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_ll_rule_sender_and_receiver_agree(collective, slot, nblocks):
    """Every message's two ends mark it LL alike, for every dtype, rank count, algorithm and
    count around the limit; no LL message is over the limit or leaves its LL sub-slot."""
    limit = 32 << 10
    layout = cu.segment_layout(4, 4, nblocks, slot, limit)
    algos = [a for a in ALGOS if a != "tree" or collective in ("all_reduce", "broadcast", "reduce")]
    ll_seen = 0
    for name, (code, elem, acc) in DTYPES.items():
        wire_max = acc if collective in PARTIAL else elem
        edge = limit // wire_max
        for size in (2, 3, 4, 5):
            for count in (1, 7, edge // 3, edge - 1, edge, edge + 1, 2 * edge + 5):
                for algo in algos:
                    ends = [
                        channel_messages(
                            cu.plan(CODES[collective], ALGOS[algo], r, size, count, 1 % size, code,
                                    slot, nblocks=nblocks, ll_max_bytes=limit),
                            r, size, elem, acc,
                        )
                        for r in range(size)
                    ]  # fmt: skip
                    sent = {ch: m for s, _ in ends for ch, m in s.items()}
                    received = {ch: m for _, r in ends for ch, m in r.items()}
                    case = f"{collective} {algo} {name} ranks={size} count={count}"
                    assert sent == received, case
                    for msgs in sent.values():
                        for n, wire, ll in msgs:
                            ll_seen += ll
                            if not ll:
                                continue
                            assert n * wire <= limit, case
                            lo, hi = cu.channel_slice(n, nblocks, slot, 0)
                            words = ((hi - lo) * wire + 3) // 4
                            assert 8 * words <= layout["ll_sub_slot_bytes"], case
    assert ll_seen > 0


def test_ll_rule_limits():
    # No limit, no LL; one element always fits; over the limit never.
    def ll_bits(count, limit, dtype=FLOAT32, collective="all_reduce"):
        p = cu.plan(CODES[collective], ALGOS["direct"], 0, 2, count, 0, dtype, 64 << 10,
                    nblocks=4, ll_max_bytes=limit)  # fmt: skip
        return [f & (cu.RECV_LL | cu.SEND_LL) for _, f, *_ in p["steps"]]

    assert ll_bits(1, 0) == [0, 0]
    assert ll_bits(1, 4) == [cu.SEND_LL, cu.RECV_LL]  # one-shot: send, then receive-reduce
    assert ll_bits(2, 4) == [0, 0]
    assert ll_bits(8, 16, FLOAT16) == [0, 0]  # partial sums travel as float32: 32 bytes
    assert ll_bits(4, 16, FLOAT16) == [cu.SEND_LL, cu.RECV_LL]
    layout = cu.segment_layout(3, 4, 16, 1 << 20, cu.LL_MAX_BYTES)
    assert 0 < layout["ll_blocks"] < 16 and layout["ll_sub_slot_bytes"] % 256 == 0
    assert (
        layout["total_bytes"]
        == layout["ll_offset"] + layout["ll_blocks"] * 4 * 4 * layout["ll_sub_slot_bytes"]
    )
    assert cu.segment_layout(3, 4, 16, 1 << 20)["ll_blocks"] == 0


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 32])
def test_twoshot_shards_tile_the_message(size):
    """The two-shot's shards (device/plan.h, twoshot_shard): in rank order, contiguous, covering
    [0, count) exactly once, each starting at a multiple of 16 elements (kSliceAlign) unless
    empty at the end; only the last non-empty one shorter. Counts 0, 1, fewer than the ranks,
    not divisible by them, and large."""
    for count in (0, 1, size - 1, size + 1, 3 * size + 1, 16 * size, 5000, (1 << 20) + 3):
        shards = [cu.twoshot_shard(count, size, r) for r in range(size)]
        at = 0
        for lo, hi in shards:
            assert lo == at and lo <= hi <= count, (count, shards)
            assert lo % 16 == 0 or lo == count, (count, shards)
            at = hi
        assert at == count, (count, shards)
        sizes = [hi - lo for lo, hi in shards if hi > lo]
        assert all(s == sizes[0] for s in sizes[:-1]), (count, shards)
        # Every block of every rank gets the same grid: a function of count and layout.
        grid = cu.twoshot_grid(count, size, 4, 4096)
        assert grid == 1 if count <= 16 * size else 1 <= grid <= 4, (count, grid)
        if count == (1 << 20) + 3:
            assert grid == 4, grid


def test_kernel_args_fit_the_parameter_limit():
    # Every rank's registered input and output travel in the launch's arguments: 32 ranks'
    # pointers still leave them within CUDA's 4 KiB of kernel parameters.
    assert cu.kernel_args_bytes() <= 4096
