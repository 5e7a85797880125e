"""All-reduce over buffers the ranks map (Communicator.empty, host/shared_buffers.h) against
numpy, run with PYCOLL_SHARED_BYTES=0 so that every size takes the path and
PYCOLL_STREAM_BYTES=8 MiB so that the large out-of-place calls stream their outputs.

Usage: mpiexec -n N python shared_buffers.py data|others|mixed|churn|mismatch
data:     every dtype and op, counts from 1 to past the streaming threshold, out of
          place, in place, views at odd offsets, async_op; outputs bitwise identical on every
          rank and inputs untouched; avg bit for bit the rank-order sum divided by the rank
          count (a power of two multiplies by its reciprocal, any other count divides).
others:   reduce-scatter, all-gather, broadcast (every root) and reduce (every root) on shared
          buffers, several dtypes and ops, small and past the streaming threshold, out of place
          and in place, against numpy; nothing written outside the outputs.
mixed:    one rank passes plain numpy arrays: every rank falls back to the staged schedule;
          then every rank passes shared ones (mapped, or refused under PYCOLL_P2P_CMA=fail).
churn:    buffers freed and allocated again, more of them than a rank keeps views of.
mismatch: Communicator.empty with different shapes raises on every rank; a rank that skipped
          it disagrees with its peers' next eligible all-reduce (CollectiveMismatch, not data
          read as descriptors).
"""

from __future__ import annotations

import sys

import numpy as np
from checks import (
    DTYPES,
    OPS,
    check_close,
    digest,
    expect,
    make_input,
    reference,
    run_main,
    run_mode,
    valid,
)

import pycollectives as pc


def check(mpi, c, got, dt, op, count, what, salt=0):
    inputs = [make_input(q, count, dt, op, salt) for q in range(mpi.size)]
    check_close(got, reference(inputs, op, dt), dt, mpi.size, what, op)
    digests = mpi.allgather(digest(got))
    assert len(set(digests)) == 1, f"{what}: outputs differ between ranks"


def data(mpi, c):
    r = mpi.rank
    counts = (1, 17, 4099, 70001)
    for dt in DTYPES:
        for op in OPS:
            if not valid(dt, op):
                continue
            for count in counts:
                what = f"{dt} {op} {count}"
                x = c.empty(count, dt)
                x[:] = make_input(r, count, dt, op)
                out = c.zeros(count, dt)
                c.all_reduce(x, out, op=op)
                check(mpi, c, out, dt, op, count, what + " oop")
                assert np.array_equal(x, make_input(r, count, dt, op)), what + ": input written"
                c.all_reduce(x, op=op)
                check(mpi, c, x, dt, op, count, what + " in place")
    # Past the streaming threshold (the fused two-output kernel on 2 ranks), views at odd
    # element offsets (not 16-byte aligned: the block path), async.
    for dt, op in ((np.dtype(np.float32), "sum"), (np.dtype(np.float16), "avg")):
        count = (9 << 20) // dt.itemsize + 7
        x = c.empty(count, dt)
        x[:] = make_input(r, count, dt, op)
        out = c.empty(count + 3, dt)
        out[:] = 0
        c.all_reduce(x, out[:count], op=op)
        check(mpi, c, out[:count], dt, op, count, f"{dt} {op} large")
        assert not out[count:].any(), "written past the output"
        c.all_reduce(x[1:], out[3 : count + 2], op=op, async_op=True).wait()
        inputs = [make_input(q, count, dt, op)[1:] for q in range(mpi.size)]
        want = reference(inputs, op, dt)
        check_close(out[3 : count + 2], want, dt, mpi.size, "odd offsets", op)
        c.all_reduce(x, op=op)
        check(mpi, c, x, dt, op, count, f"{dt} {op} large in place")
    exact_avg(mpi, c)


def exact_avg(mpi, c):
    """avg on the mapped path sums in rank order and divides: check it bit for bit, with values
    whose quotients round differently from a product with an inexact reciprocal (x * (1/3) is
    not x / 3), subnormals and the largest finite values."""
    n, r = mpi.size, mpi.rank
    for dt in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)):
        acc = np.float32 if dt.itemsize < 4 else dt.type
        fi = np.finfo(dt)
        rng = np.random.default_rng(7)
        special = np.array([fi.tiny / 3, fi.smallest_subnormal, fi.max, -fi.max / 2, 1, 3], dt)
        inputs = []
        for q in range(n):
            v = rng.standard_normal(40000).astype(dt)
            v[: special.size] = special * ((q + 1) / (n * n))  # no sum overflows
            inputs.append(v)
        x = c.empty(inputs[r].size, dt)
        x[:] = inputs[r]
        c.all_reduce(x, op="avg")
        total = inputs[0].astype(acc)
        for v in inputs[1:]:
            total = total + v.astype(acc)
        want = (total / acc(n)).astype(dt)
        assert np.array_equal(x.view(np.uint8), want.view(np.uint8)), f"avg {dt} not exact"


def others(mpi, c):
    n, r = mpi.size, mpi.rank
    cases = [(np.dtype(np.float32), "sum", 4099), (np.dtype(np.int64), "max", 17)]
    cases += [(np.dtype(np.float16), "avg", 1), (np.dtype(np.float32), "sum", (9 << 20) // 4 + 3)]
    for dt, op, count in cases:
        what = f"{dt} {op} {count}"
        inputs = [make_input(q, n * count, dt, op) for q in range(n)]
        want = reference(inputs, op, dt)
        # reduce-scatter: block r of the reduction, out of place and in place
        x = c.empty(n * count, dt)
        x[:] = inputs[r]
        out = c.zeros(count + 1, dt)
        c.reduce_scatter(x, out[:count], op=op)
        mine = slice(r * count, (r + 1) * count)
        check_close(out[:count], want[mine], dt, n, what + " reduce_scatter", op)
        assert not out[count:].any(), what + ": reduce_scatter wrote past its output"
        c.reduce_scatter(x, x[mine], op=op)
        check_close(x[mine], want[mine], dt, n, what + " reduce_scatter in place", op)
        # all-gather: every rank's block
        blocks = c.empty(count, dt)
        blocks[:] = inputs[r][:count]
        gathered = c.zeros(n * count, dt)
        c.all_gather(blocks, gathered)
        expected = np.concatenate([inputs[q][:count] for q in range(n)])
        assert np.array_equal(gathered, expected), what + " all_gather"
        gathered[:] = 0
        gathered[mine] = inputs[r][:count]
        c.all_gather(gathered[mine], gathered)
        assert np.array_equal(gathered, expected), what + " all_gather in place"
        for root in range(n):
            # broadcast: the root's buffer everywhere
            b = c.empty(count, dt)
            b[:] = inputs[r][:count]
            c.broadcast(b, root=root)
            assert np.array_equal(b, inputs[root][:count]), f"{what} broadcast from {root}"
            # reduce: the whole reduction at the root, out of place then in place
            x = c.empty(count, dt)
            x[:] = inputs[r][:count]
            red = c.zeros(count, dt)
            c.reduce(x, red, root=root, op=op)
            small = reference([v[:count] for v in inputs], op, dt)
            if r == root:
                check_close(red, small, dt, n, f"{what} reduce to {root}", op)
            else:
                assert not red.any(), f"{what}: reduce wrote a non-root's output"
            assert np.array_equal(x, inputs[r][:count]), f"{what}: reduce wrote an input"
            c.reduce(x, root=root, op=op)
            if r == root:
                check_close(x, small, dt, n, f"{what} reduce in place to {root}", op)
            else:
                assert np.array_equal(x, inputs[r][:count]), f"{what}: reduce wrote a non-root"


def mixed(mpi, c):
    r, count = mpi.rank, 50000
    x = c.empty(count, np.float32)  # collective: every rank allocates
    if r == 0:
        x = np.empty(count, np.float32)
    x[:] = make_input(r, count, np.dtype(np.float32), "sum")
    out = c.empty(count, np.float32)
    c.all_reduce(x, out)
    check(mpi, c, out, np.dtype(np.float32), "sum", count, "mixed")
    print(f"rank {r}: now all shared", file=sys.stderr, flush=True)
    x = c.empty(count, np.float32)
    x[:] = make_input(r, count, np.dtype(np.float32), "sum")
    c.all_reduce(x, out)
    check(mpi, c, out, np.dtype(np.float32), "sum", count, "all shared")


def churn(mpi, c):
    r, dt = mpi.rank, np.dtype(np.int32)
    for i in range(90):
        count = 1000 + 37 * (i % 11)
        x = c.empty(count, dt)
        x[:] = make_input(r, count, dt, "sum", salt=i)
        out = c.empty(count, dt)
        c.all_reduce(x, out)
        check(mpi, c, out, dt, "sum", count, f"buffer {i}", salt=i)
        if i % 3:
            del x, out  # freed: peers drop their views of it
    kept = [c.empty(500, dt) for _ in range(80)]  # more than the views a rank keeps
    for i, b in enumerate(kept):
        b[:] = r + i
        c.all_reduce(b)
        assert (b == sum(q + i for q in range(mpi.size))).all(), i


def mismatch(mpi, c):
    r = mpi.rank
    expect(ValueError, lambda: c.empty(100 + r, np.float32), "different buffers")
    if r == 0:
        x = c.empty(1 << 16, np.float32)
    else:  # the agreement Communicator.empty runs, but not Communicator.empty itself
        nbytes, num = 4 << 16, np.dtype(np.float32).num
        c.all_reduce(np.array([nbytes, -nbytes, num, -num], np.int64), op="max")
        x = np.zeros(1 << 16, np.float32)
    expect(pc.CollectiveMismatch, lambda: c.all_reduce(x), "shared buffers")


def main():
    run_mode({"data": data, "others": others, "mixed": mixed, "churn": churn, "mismatch": mismatch})


if __name__ == "__main__":
    run_main(main)
