"""Registration on first use on the emulated device (csrc/device/first_use.h): collectives on
device arrays that no one registered (what cupy's pool and torch's caching allocator hand out)
run zero-copy over every rank's allocation once the ranks have traded where their buffers lie.

Usage: mpiexec -n N python emulated_first_use.py MODE PART [COUNT]
  MODE: kernel or stepped.
  PART: collectives (all-reduce, reduce-scatter, all-gather, broadcast and reduce on views at
  offsets that differ between ranks, every dtype, against numpy's rank-order reduction; each
  allocation sent once and mapped once per peer; below the size the staged path; one rank's
  plain host array sends every rank down the staged path), realloc (an allocation freed and
  made again at the same address: peers must map the new one), copy_engines (stepped mode's
  registered all-gathers and broadcasts as copies, back to back), traffic COUNT (the bytes a
  first-use all-reduce moves; printed), mismatch (ranks that disagree on the size from which
  calls register raise CollectiveMismatch).
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
from checks import expect, is_float, make_input, run_main, same_bytes
from emulated import DRILL_TIMEOUT, EmulatedDevice, say
from emulated_registered import F32, allocation_of, dtypes, rank_order, say_traffic
from mpi4py import MPI

import pycollectives as pc

FROM = 256  # bytes: calls of at least this many register on first use here


def device(mpi, mode, **opts):
    opts.setdefault("register_on_use_bytes", FROM)
    return EmulatedDevice(mpi, mode, "small", blocks=3, **opts)


def ran_first_use(c, what, fn, *args, want=1, **kw):
    """fn(*args, **kw), a call on the emulated communicator `c`; asserts it ran over first-use
    buffers (or, with want=0, not)."""
    before = c.first_use_runs, c.twoshot_runs
    fn(*args, **kw)
    ran = c.first_use_runs - before[0], c.twoshot_runs - before[1]
    assert ran == (want, want), (what, ran)


def collectives(mpi, mode):
    """Every rank's arrays lie at an offset of its own in two unregistered allocations (rank r
    at 5r + case elements: the offsets differ between ranks, unlike registered buffers), so the
    ranks must trade where each buffer lies at every call. Results bitwise numpy's rank-order
    reductions. Each allocation goes to the peers once and each peer maps it once, however
    many calls run over it."""
    dev = device(mpi, mode)
    c, n, r = dev.dev, mpi.size, mpi.rank
    cases = 0
    pools = []
    for dt in dtypes():
        count = max(FROM // dt.itemsize, 1) + 37  # above FROM, not a multiple of anything
        ops = ["sum", "max"] + (["avg"] if is_float(dt) else [])
        size = n * count + 64 + 5 * n
        pool_in, pool_out = dev.device_array(size, dt), dev.device_array(size, dt)
        pools += [pool_in, pool_out]
        for in_place in (False, True):
            at = 5 * r + cases % 3  # differs between ranks
            what = f"{dt.name} count={count} in_place={in_place} (rank {r})"
            inputs = [make_input(q, n * count, dt, "sum", salt=cases) for q in range(n)]
            for op in ops:
                x = pool_in[at : at + count]
                x[...] = inputs[r][:count]
                out = x if in_place else pool_out[at : at + count]
                ran_first_use(c, "all_reduce " + what, dev.all_reduce, x, out, op=op)
                same_bytes(out, rank_order([i[:count] for i in inputs], op, dt), what)
                x = pool_in[at : at + n * count]
                x[...] = inputs[r]
                out = x[r * count : (r + 1) * count] if in_place else pool_out[at:][:count]
                ran_first_use(c, "rs " + what, dev.reduce_scatter, x, out, op=op)
                blocks = [i[r * count : (r + 1) * count] for i in inputs]
                same_bytes(out, rank_order(blocks, op, dt), "reduce_scatter " + what)
            mine = [i[:count] for i in inputs]
            out = pool_out[at : at + n * count]
            x = out[r * count : (r + 1) * count] if in_place else pool_in[at:][:count]
            x[...] = mine[r]
            ran_first_use(c, "all_gather " + what, dev.all_gather, x, out)
            same_bytes(out, np.concatenate(mine), "all_gather " + what)
            root = cases % n
            x = pool_in[at : at + count]
            x[...] = mine[r]
            ran_first_use(c, "broadcast " + what, dev.broadcast, x, root)
            same_bytes(x, mine[root], f"broadcast root={root} {what}")
            x[...] = mine[r]
            out = x if in_place else pool_out[at : at + count]
            ran_first_use(c, "reduce " + what, dev.reduce, x, out, root=root, op="sum")
            if r == root:
                same_bytes(out, rank_order(mine, "sum", dt), f"reduce root={root} {what}")
            cases += 1
    # Two allocations per dtype, each sent once and mapped once by every peer.
    assert c.first_use_sent == len(pools), (c.first_use_sent, len(pools))
    assert c.first_use_opened == c.first_use_mapped == len(pools) * (n - 1), (
        c.first_use_opened,
        c.first_use_mapped,
    )
    # Once every peer has mapped an allocation (the next call's rows say so), its name goes:
    # nothing of it is left in /dev/shm if the job dies.
    for a in pools[:-2]:
        name = "/dev/shm" + allocation_of(a).name
        assert not os.path.exists(name), f"{name} is still linked"
    # Below the size: the staged path, and no trade.
    small = dev.device_array(8, np.float32)
    small[...] = r + 1
    ran_first_use(c, "below the size", dev.all_reduce, small, want=0)
    assert np.all(small == n * (n + 1) / 2), small
    # One rank's buffer is a plain host array, not device memory: every rank takes the staged
    # path (the same decision from the same rows), and the result is right everywhere.
    x = np.full(1000, r + 1, np.float32) if r == n - 1 else dev.device_array(1000, F32)
    x[...] = r + 1
    ran_first_use(c, "a host array on one rank", dev.all_reduce, x, want=0)
    assert np.all(x == n * (n + 1) / 2), x
    mpi.Barrier()
    say(f"first_use collectives {mode} ranks={n}: {cases} cases, {c.first_use_runs} calls")


def realloc(mpi, mode):
    """An allocation freed and made again at the same address (an allocator's segment released
    and reserved again): the peers must map the new one, not reuse the mapping of the old one
    (whose memory this rank no longer sees). Each round every rank frees its buffer and
    allocates a new one of the same size, which the kernel places where the old one was."""
    dev = device(mpi, mode)
    c, n, r = dev.dev, mpi.size, mpi.rank
    count = 4096
    x = dev.device_array(count, F32)
    reused = 0
    for i in range(6):
        inputs = [make_input(q, count, F32, "sum", salt=i) for q in range(n)]
        x[...] = inputs[r]
        ran_first_use(c, f"round {i}", dev.all_reduce, x)
        same_bytes(x, rank_order(inputs, "sum", F32), f"round {i} (rank {r})")
        old = x.__array_interface__["data"][0]
        del x
        gc.collect()
        x = dev.device_array(count, F32)
        reused += x.__array_interface__["data"][0] == old
    # Each round's allocation is new to the peers: mapped anew, the old mapping dropped.
    assert c.first_use_opened == 6 * (n - 1), c.first_use_opened
    assert c.first_use_mapped <= 2 * (n - 1), c.first_use_mapped
    reused = mpi.allreduce(reused)
    assert reused >= n, f"only {reused} allocations came back at the same address"
    say(f"first_use realloc {mode} ranks={n}: {reused} at a freed address")


def traffic(mpi, mode):
    """The bytes a first-use all-reduce moves (emu Traffic), gathered to every rank: those of
    the two-shot over registered buffers, whatever offsets the ranks' buffers lie at."""
    dev = EmulatedDevice(mpi, mode, "default", blocks=4, ll_max_bytes=0, register_on_use_bytes=FROM)
    c, n, r = dev.dev, mpi.size, mpi.rank
    count = int(sys.argv[3])
    pool = dev.device_array(count + 64, F32)
    x = pool[3 * r :][:count]
    inputs = [make_input(q, count, F32, "sum", salt=5) for q in range(n)]
    x[...] = inputs[r]
    mpi.Barrier()
    c.reset_traffic()
    ran_first_use(c, "traffic", dev.all_reduce, x)
    same_bytes(x, rank_order(inputs, "sum", F32), "traffic")
    say_traffic(mpi, {"first_use": mpi.allgather(dict(c.traffic))})


def mismatch(mpi, mode):
    """Ranks that disagree on the size from which calls register on first use (rank 0 does not
    trade rows, the others do) raise CollectiveMismatch, all of them, and nothing moves: a
    rank that trades names the field that differs."""
    r = mpi.rank
    dev = device(mpi, mode, timeout=DRILL_TIMEOUT, register_on_use_bytes=FROM if r else 0)
    x = dev.device_array(5000, F32)
    x[...] = r + 1
    expect(pc.CollectiveMismatch, lambda: dev.all_reduce(x), *(["shared buffers"] if r else []))
    assert np.all(x == r + 1), "a mismatched call moved data"
    mpi.Barrier()
    say(f"first_use mismatch {mode} ranks={mpi.size}")


def copy_engines(mpi, mode):
    """Stepped mode with copy engines (copy_engines): registered all-gathers and broadcasts, and
    on arrays registered on first use, are copies between the call's two fences, no launch (no
    device code runs: its traffic stays 0), each block copied once into this rank's output
    ((n-1) blocks of the peers' in place, n not; a broadcast's buffer on every rank but the
    root). Calls back to back, inputs rewritten as soon as a call returns, every rank's queue
    late in turn (queue_delay_ms): a rank must not return, and rewrite its input, before its
    peers' copies of it have run (the second fence)."""
    dev = device(mpi, mode, copy_engines=True, queue_delay_ms=2)
    c, n, r = dev.dev, mpi.size, mpi.rank
    count = 3000
    block = 4 * count
    registered = dev.empty(n * count, F32), dev.empty(n * count, F32)
    plain = (
        dev.device_array(n * count + 5 * n, F32)[5 * r :][: n * count],
        dev.device_array(n * count, F32),
    )
    for i in range(24):
        src, out = registered if i % 2 else plain
        mine = [make_input(q, count, F32, "sum", salt=i) for q in range(n)]
        in_place = i % 4 >= 2
        x = out[r * count : (r + 1) * count] if in_place else src[:count]
        x[...] = mine[r]
        c.reset_traffic()
        before = c.copy_engine_runs
        dev.all_gather(x, out)
        assert c.copy_engine_runs - before == 1, ("all_gather", i)
        assert sum(dict(c.traffic).values()) == 0, dict(c.traffic)
        assert c.copied == (n - in_place) * block, (c.copied, i)
        same_bytes(out, np.concatenate(mine), f"all_gather {i} (rank {r})")
        out[...] = -1  # at once: a peer still copying from this rank would copy -1
        root = i % n
        y = src[:count]
        y[...] = mine[r]
        c.reset_traffic()
        dev.broadcast(y, root)
        assert c.copied == (0 if r == root else block), (c.copied, i)
        same_bytes(y, mine[root], f"broadcast {i} root={root} (rank {r})")
        y[...] = -1
    mpi.Barrier()
    say(f"first_use copy_engines {mode} ranks={n}: {c.copy_engine_runs} calls by copies")


def main():
    mode, part = sys.argv[1], sys.argv[2]
    parts = {"collectives": collectives, "realloc": realloc, "traffic": traffic,
             "mismatch": mismatch, "copy_engines": copy_engines}  # fmt: skip
    parts[part](MPI.COMM_WORLD, mode)


if __name__ == "__main__":
    run_main(main)
