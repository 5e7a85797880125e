"""Registered buffers on the emulated device (csrc/emu/emu_registry.h) and the collectives over
them (csrc/device/twoshot_kernel.h: the two-shot all-reduce, reduce-scatter, all-gather,
broadcast and reduce reading peers' buffers directly).

Usage: mpiexec -n N python emulated_registered.py MODE PART
  MODE: kernel or stepped (the host meets the peers before and after the launch).
  PART: back_to_back (calls in a row, ranks late at random), matrix (dtypes x ops x counts,
  in place and not, views at offsets, against numpy, bitwise equal across ranks and to numpy's
  rank-order reduction), others (reduce-scatter, all-gather, broadcast and reduce the same
  way), traffic and traffic_others COUNT (the bytes each moves; prints them), mismatch (ranks
  that disagree on the count, or on registering, raise CollectiveMismatch), dies_mid and
  stalls_mid (rank 1 dies or stalls in a two-shot call).
"""

from __future__ import annotations

import os
import sys
import time

import checks
import numpy as np
from checks import (
    check_close,
    digest,
    expect,
    is_bfloat16,
    is_float,
    make_input,
    reference,
    run_main,
    same_bytes,
)
from emulated import DRILL_TIMEOUT, EmulatedDevice, leave_with, raises_in_drill, say
from mpi4py import MPI

import pycollectives as pc


def dtypes() -> list:  # ml_dtypes is imported only by a process that runs these
    return [np.dtype(t) for t in (np.float32, np.float64, np.int32, np.float16)] + (
        [checks.BFLOAT16] if checks.BFLOAT16 is not None else []
    )


F32 = np.dtype(np.float32)
SLICE_ALIGN = 16  # kSliceAlign: shards start at multiples of it


def accumulates_in(dt):
    """The type the device accumulates `dt` in: float32 for the 16-bit floats."""
    return F32 if dt.kind == "f" and dt.itemsize == 2 or is_bfloat16(dt) else dt


def rank_order(inputs, op, dt):
    """numpy's reduction of every rank's input in rank order 0..n-1, accumulated as the device
    accumulates: what every rank's output must be, bit for bit."""
    acc_t = accumulates_in(dt)
    acc = inputs[0].astype(acc_t)
    for x in inputs[1:]:  # over ranks, each step a whole-array numpy operation
        acc = np.maximum(acc, x.astype(acc_t)) if op == "max" else acc + x.astype(acc_t)
    if op == "avg":
        acc = acc / acc_t.type(len(inputs))
    return acc.astype(dt)


def allocation_of(array):
    """The emulated device's allocation (_emu.EmuAllocation) that `array` is a view of."""
    while isinstance(array, np.ndarray):
        array = array.base
    return array.obj  # the memoryview over the allocation


def shard(count, n, r):
    """Rank r's shard of a two-shot message: [lo, hi) (device/plan.h, twoshot_shard)."""
    per = -(-count // n)
    per = -(-per // SLICE_ALIGN) * SLICE_ALIGN
    lo = min(r * per, count)
    return lo, min(lo + per, count)


def matrix(mpi, mode):
    """Every case on registered buffers: the two-shot ran (count > 0), the result is numpy's
    within rounding, bitwise numpy's rank-order reduction, and bitwise
    the same on every rank. Inputs and outputs are views into one registered pool per dtype, at
    offsets that move with the case (16-byte aligned and not), so the same registration serves
    many calls at many offsets."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=3)
    c, n, r = dev.dev, mpi.size, mpi.rank
    counts = [0, 1, n - 1, 3 * n + 1, 5000]  # 5000: several blocks' slices of a 4 KiB slot
    cases = 0
    for dt in dtypes():
        ops = ["sum", "max"] + (["avg"] if is_float(dt) else [])
        pool_in, pool_out = dev.empty(2 * 5000 + 128, dt), dev.zeros(5000 + 64, dt)
        for op in ops:
            for count in counts:
                for in_place in (False, True):
                    at = cases % 7 * 3  # 0, 3, 6, ...: aligned and unaligned offsets
                    x = pool_in[at : at + count] if not in_place else pool_in[5064 + at :][:count]
                    out = x if in_place else pool_out[at : at + count]
                    inputs = [make_input(q, count, dt, op, salt=cases) for q in range(n)]
                    x[...] = inputs[r]
                    what = f"{dt.name} {op} count={count} in_place={in_place} at={at} (rank {r})"
                    before = c.twoshot_runs
                    dev.all_reduce(x, out, op=op)
                    ran = c.twoshot_runs - before
                    assert ran == (1 if count > 0 else 0), (what, ran)
                    check_close(out, reference(inputs, op, dt), dt, n, what, op)
                    same_bytes(out, rank_order(inputs, op, dt), what + " against rank order")
                    digests = mpi.allgather(digest(out))
                    assert all(d == digests[0] for d in digests), what + ": ranks differ"
                    cases += 1
    # A range registered on its own, at an offset of its allocation (not at its start), and a
    # plain numpy output: not registered, so the staged path (and every rank agrees on that).
    # The allocation's segment is named until it is registered (its name is its IPC handle),
    # then unlinked: no registered buffer outlives the job in /dev/shm.
    memory = dev.device_array(1000, np.float32)
    name = "/dev/shm" + allocation_of(memory).name
    assert os.path.exists(name), name
    x = dev.register(memory[37 : 37 + 300])
    assert not os.path.exists(name), f"{name} is still linked once registered"
    inputs = [make_input(q, 300, F32, "sum", salt=99) for q in range(n)]
    x[...] = inputs[r]
    before = c.twoshot_runs
    dev.all_reduce(x)
    assert c.twoshot_runs - before == 1
    same_bytes(x, rank_order(inputs, "sum", F32), "registered view")
    plain = np.zeros(300, np.float32)
    x[...] = inputs[r]
    before = c.twoshot_runs
    dev.all_reduce(x, plain)
    assert c.twoshot_runs == before, "a plain output took the two-shot"
    check_close(plain, reference(inputs, "sum", F32), F32, n, "plain", "sum")
    expect(ValueError, lambda: dev.register(np.zeros(4, np.float32)), "device memory")
    live = c.registrations
    del x, memory
    assert c.registrations == live - 1, "a registration outlived its array"
    mpi.Barrier()
    say(f"registered matrix {mode} ranks={n}: {cases} cases, {c.twoshot_runs} two-shot calls")


def others(mpi, mode):
    """Reduce-scatter, all-gather, broadcast and reduce on registered buffers: each reads its
    peers' buffers directly (run_registered ran it, once per call that moves data), every dtype,
    op, root and count from one element to several blocks' slices, in place and not, at aligned
    and unaligned offsets of one registered pool; results bitwise numpy's (rank-order
    reductions) and bitwise the same on every rank; a reduce leaves other ranks' outputs alone."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=3)
    c, n, r = dev.dev, mpi.size, mpi.rank
    counts = [1, n - 1 or 1, 3 * n + 1, 1300]
    cases = 0
    for dt in dtypes():
        ops = ["sum", "max"] + (["avg"] if is_float(dt) else [])
        size = n * 1300 + 64
        pool_in, pool_out = dev.empty(size, dt), dev.empty(size, dt)
        for count in counts:
            for in_place in (False, True):
                at = cases % 5 * 3  # 0, 3, 6, ...: aligned and unaligned offsets
                salt = cases
                inputs = [make_input(q, n * count, dt, "sum", salt=salt) for q in range(n)]
                what = f"{dt.name} count={count} in_place={in_place} at={at} (rank {r})"
                for op in ops:
                    x = pool_in[at : at + n * count]
                    x[...] = inputs[r]
                    out = x[r * count : (r + 1) * count] if in_place else pool_out[at:][:count]
                    before = c.twoshot_runs
                    dev.reduce_scatter(x, out, op=op)
                    assert c.twoshot_runs - before == 1, "reduce_scatter " + what
                    blocks = [inp[r * count : (r + 1) * count] for inp in inputs]
                    same_bytes(out, rank_order(blocks, op, dt), f"reduce_scatter {op} {what}")
                # all-gather: every rank's first `count` elements
                mine = [inp[:count] for inp in inputs]
                out = pool_out[at : at + n * count]
                x = out[r * count : (r + 1) * count] if in_place else pool_in[at:][:count]
                x[...] = mine[r]
                before = c.twoshot_runs
                dev.all_gather(x, out)
                assert c.twoshot_runs - before == 1, "all_gather " + what
                same_bytes(out, np.concatenate(mine), "all_gather " + what)
                for root in sorted({0, n - 1}):
                    x = pool_in[at : at + count]
                    x[...] = mine[r]
                    before = c.twoshot_runs
                    dev.broadcast(x, root)
                    assert c.twoshot_runs - before == 1, "broadcast " + what
                    same_bytes(x, mine[root], f"broadcast root={root} {what}")
                    for op in ops:
                        x[...] = mine[r]
                        out = x if in_place else pool_out[at : at + count]
                        if not in_place:
                            out[...] = 0
                        before = c.twoshot_runs
                        dev.reduce(x, out, root=root, op=op)
                        assert c.twoshot_runs - before == 1, "reduce " + what
                        if r == root:
                            want = rank_order(mine, op, dt)
                        else:  # untouched: the input in place, else the zeros written
                            want = mine[r] if in_place else np.zeros(count, dt)
                        same_bytes(out, want, f"reduce root={root} {op} {what}")
                cases += 1
    mpi.Barrier()
    say(f"registered others {mode} ranks={n}: {cases} cases, {c.twoshot_runs} registered calls")


def traffic_others(mpi, mode):
    """The bytes reduce-scatter, all-gather, broadcast (root 0) and reduce (root 0) of `count`
    float32 elements move on registered buffers, gathered to every rank; asserted in the test."""
    dev = EmulatedDevice(mpi, mode, "default", blocks=4, ll_max_bytes=0)
    c, n, r = dev.dev, mpi.size, mpi.rank
    count = int(sys.argv[3])
    big_in, big_out = dev.empty(n * count, F32), dev.empty(n * count, F32)
    calls = {
        "reduce_scatter": lambda: dev.reduce_scatter(big_in, big_out[:count]),
        "all_gather": lambda: dev.all_gather(big_in[:count], big_out),
        "broadcast": lambda: dev.broadcast(big_in[:count], 0),
        "reduce": lambda: dev.reduce(big_in[:count], big_out[:count], root=0),
    }
    rows = {}
    for name, call in calls.items():
        big_in[...] = r + 1
        mpi.Barrier()
        c.reset_traffic()
        before = c.twoshot_runs
        call()
        assert c.twoshot_runs - before == 1, name
        rows[name] = mpi.allgather(dict(c.traffic))
    say_traffic(mpi, rows)


def say_traffic(mpi, rows):
    """Rank 0 prints each algorithm's traffic on every rank: TRAFFIC name rank read_own
    read_peer write_own write_peer (the test parses these lines)."""
    if mpi.rank == 0:
        for name, per_rank in rows.items():
            for q, t in enumerate(per_rank):
                say(f"TRAFFIC {name} {q} {t['read_own']} {t['read_peer']} "
                    f"{t['write_own']} {t['write_peer']}")  # fmt: skip
    mpi.Barrier()


def back_to_back(mpi, mode):
    """Two-shot calls back to back, in place and not, new inputs written right after each call
    returns, one rank (drawn at random, the same draw everywhere) calling late: an early rank
    must not read a late rank's input before it is written (entry barrier), nor return and
    overwrite its input while a peer still reads it, or read its output before every peer has
    written its shard (exit barrier)."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=3)
    n, r = mpi.size, mpi.rank
    rng = np.random.default_rng(38)
    x, out = dev.empty(20000, F32), dev.empty(20000, F32)
    for i in range(60):
        late, pause = int(rng.integers(n)), float(rng.uniform(0.0, 0.002))
        count = int(rng.choice([20000, 9000, 333]))
        inputs = [make_input(q, count, F32, "sum", salt=i) for q in range(n)]
        if r == late:  # then writes its input: peers must wait for that (entry barrier)
            time.sleep(pause)
        a = x[:count]
        a[...] = inputs[r]
        b = a if i % 2 else out[:count]
        dev.all_reduce(a, b)
        same_bytes(b, rank_order(inputs, "sum", F32), f"call {i} count={count} (rank {r})")
    say(f"registered back_to_back {mode} ranks={n}")


def traffic(mpi, mode):
    """The bytes each all-reduce moves (emu Traffic: the device code's data loads and stores,
    not flags, call headers or LL words), gathered to every rank; asserted in the test."""
    dev = EmulatedDevice(mpi, mode, "default", blocks=4, ll_max_bytes=0)
    c, n, r = dev.dev, mpi.size, mpi.rank
    count = int(sys.argv[3])
    x = dev.empty(count, np.float32)
    out = dev.empty(count, np.float32)
    inputs = [make_input(q, count, F32, "sum", salt=5) for q in range(n)]
    rows = {}
    for name, algo in (("twoshot", None), ("ring", "ring"), ("direct", "direct")):
        a, b = (x, out) if name == "twoshot" else (inputs[r].copy(), np.zeros(count, np.float32))
        a[...] = inputs[r]
        mpi.Barrier()
        c.reset_traffic()
        before = c.twoshot_runs
        dev.all_reduce(a, b, algorithm=algo)
        assert (c.twoshot_runs - before == 1) == (name == "twoshot"), name
        check_close(b, reference(inputs, "sum", F32), F32, n, name, "sum")
        rows[name] = mpi.allgather(dict(c.traffic))
    say_traffic(mpi, rows)


def mismatch(mpi, mode):
    """Two ranks that disagree raise CollectiveMismatch, both of them, naming what differs: on
    the count (both registered), and on whether the buffers are registered (one rank passes a
    plain array). Each on a communicator of its own: a mismatch poisons the one it ran on."""
    r = mpi.rank
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=DRILL_TIMEOUT)
    x = dev.zeros(5000, np.float32)
    mine = x if r == 0 else x[: 5000 - 16]
    expect(pc.CollectiveMismatch, lambda: dev.all_reduce(mine), "count")
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=DRILL_TIMEOUT)
    x = dev.zeros(5000, np.float32)
    mine = x if r == 0 else np.zeros(5000, np.float32)
    expect(pc.CollectiveMismatch, lambda: dev.all_reduce(mine), "shared buffers")
    # Peers' inputs read where each rank's own lies: ranks whose reduce-scatter inputs lie at
    # different places, or one all-gather in place against one not, would read the wrong
    # memory. Both raise instead.
    n = mpi.size
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=DRILL_TIMEOUT)
    x, out = dev.zeros(n * 100 + 16, np.float32), dev.zeros(n * 100, np.float32)
    mine = x[16 * (r == 0) :][: n * 100]
    expect(pc.CollectiveMismatch, lambda: dev.reduce_scatter(mine, out[:100]), "placement")
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=DRILL_TIMEOUT)
    x, out = dev.zeros(100, np.float32), dev.zeros(n * 100, np.float32)
    mine = out[r * 100 : (r + 1) * 100] if r == 0 else x
    expect(pc.CollectiveMismatch, lambda: dev.all_gather(mine, out), "placement")
    mpi.Barrier()
    say(f"registered mismatch {mode} ranks={mpi.size}")


def faults(mpi, mode, what):
    """Rank 1 dies (or stalls past the timeout) at the start of its second two-shot call,
    running none of it: its peers wait for it (kernel mode: at the call comparison or the exit
    barrier, on the device; stepped mode: at the host's first meeting) and must give up."""
    fault = (2, 0, what == "dies_mid") if mpi.rank == 1 else None
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=DRILL_TIMEOUT, fault=fault)
    survivors = mpi.Split(MPI.UNDEFINED if mpi.rank == 1 else 0, mpi.rank)
    x = dev.zeros(5000, np.float32)
    dev.all_reduce(x)  # everyone arrives once
    raises_in_drill(lambda: dev.all_reduce(x), what)
    leave_with(survivors)


def main():
    mode, part = sys.argv[1], sys.argv[2]
    mpi = MPI.COMM_WORLD
    parts = {
        "matrix": matrix,
        "traffic": traffic,
        "mismatch": mismatch,
        "back_to_back": back_to_back,
        "others": others,
        "traffic_others": traffic_others,
    }
    parts.get(part, lambda m, md: faults(m, md, part))(mpi, mode)


if __name__ == "__main__":
    run_main(main)
