"""Reproducible mode (PYCOLL_REPRODUCIBLE, Communicator(reproducible=True), a call's
reproducible=): every reduction's result is, bit for bit, its inputs folded in rank order,
((x0 op x1) op x2) ..., in the accumulation type (float32 for the 16-bit floats), an average
divided once at the end, whatever the algorithm asked for, the path (plain arrays, shared
buffers, the emulated device's staged, registered and first-use paths), the slot size, the
block count and the node placement.

Inputs are drawn so that the order of a sum shows in its bits: magnitudes from 1e-3 to 1e3,
signed zeros among them for min and max. A non-reproducible ring differs from the fold on
three ranks or more (checked where it runs), so a reduction that ran out of order fails here.

Usage: mpiexec -n N python reproducible.py PART [rotate]
  rotate: each case runs one algorithm, in turn, instead of all of them (across nodes, where
          every algorithm of a reduction is the same flat schedule in reproducible mode; on the
          emulated device). workers/nodes.py runs the matrix over gloo (its case reproducible).
  host:   every dtype and op, all-reduce (in place and not), reduce-scatter (even and uneven)
          and reduce (roots in turn), every algorithm and the automatic choice, plain arrays and
          Communicator.empty buffers, async calls, slots of 4 KiB and the default; then a call's
          reproducible= on a communicator without it, PYCOLL_REPRODUCIBLE, and ranks that
          disagree on a call's setting (CollectiveMismatch, not a silent difference). On one
          node, namespace or emulated nodes under mpiexec, or nodes over gloo (env:// launch).
  device: the emulated device in kernel and stepped mode, 1 and 3 blocks: staged, registered
          and first-use arrays, every algorithm, all-reduce, reduce-scatter and reduce.
"""

from __future__ import annotations

import sys

import numpy as np
from checks import BFLOAT16, DTYPES, OPS, expect, is_float, run_main, valid

import pycollectives as pc
from pycollectives.ops import ALGORITHMS_FOR

ALGOS = {c: (None, *ALGORITHMS_FOR[c]) for c in ("all_reduce", "reduce_scatter", "reduce")}
COUNTS = (1, 333, 20011)  # the last crosses 4 KiB slots many times, and the shared threshold


def acc_type(dt):
    return np.dtype(np.float32) if dt == BFLOAT16 or (dt.kind == "f" and dt.itemsize == 2) else dt


def inputs(n, count, dt, op, salt):
    """Every rank's input (rows), the same on every rank."""
    rng = np.random.default_rng([salt, count, OPS.index(op), dt.num])
    if not is_float(dt):
        lo, hi = (-3, 4) if op == "prod" else (-100, 100)
        if dt.kind == "u":
            lo = 0
        return rng.integers(lo, hi, (n, count)).astype(dt)
    if op == "prod":
        v = 1.0 + 0.05 * rng.standard_normal((n, count))
    else:
        v = rng.standard_normal((n, count)) * 10.0 ** rng.integers(-3, 4, (n, count))
        if op in ("min", "max"):
            v[:, ::5] = 0.0
            v[::2, ::10] = -0.0
    return v.astype(dt)


def fold(rows, op, dt):
    """rows folded in rank order, as reproducible mode promises."""
    t = acc_type(dt)
    f = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
    with np.errstate(over="ignore"):
        acc = rows[0].astype(t)
        for row in rows[1:]:
            acc = f[op](acc, row.astype(t))
        if op == "avg":
            acc = acc / t.type(len(rows))
        return acc.astype(dt)


def same(got, want, what):
    u = np.dtype(f"u{got.dtype.itemsize}")
    bad = np.flatnonzero(got.reshape(-1).view(u) != want.reshape(-1).view(u))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.size} of {want.size} elements differ from the rank-order fold, "
            f"first [{i}]: {got.reshape(-1)[i]!r} != {want.reshape(-1)[i]!r}"
        )


def reductions(c, arrays, n, r, dt, op, count, salt, algo, label="", **kw):
    """All-reduce, reduce-scatter (even, then uneven) and reduce of one case on communicator
    `c` (or the emulated device), each checked against the fold. `arrays(shape)` makes the
    arrays (plain, shared, device memory)."""
    rows = inputs(n, n * count, dt, op, salt)
    want = fold(rows, op, dt)
    x = arrays(n * count, dt)
    x[...] = rows[r]
    what = f"{dt.name} {op} count={count} algorithm={algo} {label} {kw or ''}"
    if algo in ALGOS["all_reduce"]:
        if salt % 2:
            c.all_reduce(x, op=op, algorithm=algo, **kw)
            same(x, want, "all_reduce in place " + what)
            x[...] = rows[r]
        else:
            out = arrays(n * count, dt)
            c.all_reduce(x, out, op=op, algorithm=algo, **kw)
            same(out, want, "all_reduce " + what)
    if algo in ALGOS["reduce_scatter"]:
        out = arrays(count, dt)
        c.reduce_scatter(x, out, op=op, algorithm=algo, **kw)
        same(out, want[r * count : (r + 1) * count], "reduce_scatter " + what)
        if count > 1:  # uneven blocks
            counts = [count - (q % 2) for q in range(n)]
            at = sum(counts[:r])
            out = np.empty(counts[r], dt)  # sizes differ by rank: not a collective allocation
            part = rows[:, : sum(counts)]
            y = arrays(sum(counts), dt)
            y[...] = part[r]
            c.reduce_scatter(y, out, op=op, counts=counts, algorithm=algo, **kw)
            same(out, fold(part, op, dt)[at : at + counts[r]], "uneven reduce_scatter " + what)
    if algo in ALGOS["reduce"]:
        root = salt % n
        out = arrays(n * count, dt)
        c.reduce(x, out, root=root, op=op, algorithm=algo, **kw)
        if r == root:
            same(out, want, f"reduce root={root} " + what)


ROTATE = "rotate" in sys.argv[2:]


def cases(dtypes=DTYPES, ops=OPS, counts=COUNTS):
    salt = 0
    for dt in dtypes:
        for op in ops:
            if valid(dt, op):
                for count in counts:
                    salt += 1
                    yield dt, op, count, salt


def algorithms(salt, among=ALGOS["all_reduce"], rotate=ROTATE):
    """The algorithms a case runs: all of them, or one in turn."""
    return (among[salt % len(among)],) if rotate else among


def matrix(comm, dtypes=DTYPES, counts=COUNTS, rotate=ROTATE, **kw):
    """Every case's reductions on plain arrays, each algorithm (or one in turn), against the
    fold; `kw`: the calls' reproducible=."""
    for dt, op, count, salt in cases(dtypes, OPS, counts):
        for algo in algorithms(salt, rotate=rotate):
            reductions(comm, np.empty, comm.size, comm.rank, dt, op, count, salt, algo, **kw)


def host():
    comm = pc.Communicator(reproducible=True)
    n, r = comm.size, comm.rank
    chosen = comm.algorithm_for("all_reduce", 64 << 20)
    assert chosen == "direct", f"64 MiB all-reduces run {chosen}"
    plain = np.empty
    matrix(comm)
    # Shared buffers (the automatic choice maps them; an algorithm asked for stages them),
    # asynchronous calls, slots of 4 KiB.
    small = pc.Communicator(staging_bytes=4096, reproducible=True)
    f32 = [np.dtype(np.float32), np.dtype(np.float16)]
    for dt, op, count, salt in cases(f32, ("sum", "avg"), (20011,)):
        for algo in (None, "ring"):
            reductions(comm, comm.empty, n, r, dt, op, count, salt, algo)
            reductions(small, plain, n, r, dt, op, count, salt, algo)
        rows = inputs(n, count, dt, op, salt)
        x = rows[r].copy()
        comm.all_reduce(x, op=op, algorithm="tree", async_op=True).wait()
        same(x, fold(rows, op, dt), f"async all_reduce {dt.name} {op}")
    small.close()
    comm.close()
    per_call(f32)
    print(f"rank {r} ok host", flush=True)


def per_call(f32):
    """A call's own setting, on a communicator without it."""
    comm = pc.Communicator(reproducible=False)
    n, r = comm.size, comm.rank
    plain = np.empty
    for dt, op, count, salt in cases(f32, ("sum",), (20011,)):
        for algo in (None, "ring", "tree"):
            reductions(comm, plain, n, r, dt, op, count, salt, algo, reproducible=True)
        if n > 2 and dt.itemsize == 4:  # two ranks add in either order alike; from three the
            # order shows (in float32; float16's partial sums in float32 round it away)
            rows = inputs(n, count, dt, op, salt)
            x = rows[r].copy()
            comm.all_reduce(x, algorithm="ring", reproducible=False)
            u = np.dtype(f"u{dt.itemsize}")
            assert (x.view(u) != fold(rows, op, dt).view(u)).any(), "the ring summed in order"
    # Ranks that disagree on a call's setting raise instead of returning different bits.
    x = np.ones(1000, np.float32)
    expect(pc.CollectiveMismatch, lambda: comm.all_reduce(x, algorithm="ring",
           reproducible=r == 0), "algorithm")  # fmt: skip
    expect(TypeError, lambda: comm.all_reduce(x, reproducible="yes"), "reproducible")
    comm.close()


def device():
    from emulated import EmulatedDevice
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    dts = [np.dtype(np.float32), np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 else [])
    counts = (1, 333, 3001)  # LL, one-shot and staged sizes (small slots)
    for mode, blocks in (("kernel", 3), ("stepped", 1)):
        dev = EmulatedDevice(mpi, mode, "small", blocks=blocks, reproducible=True,
                             register_on_use_bytes=1 << 14)  # fmt: skip
        arrays = {"staged": np.empty, "registered": dev.empty, "first use": dev.device_array}
        zero_copy = {path: 0 for path in arrays}  # calls over peers' buffers, by path
        for dt, op, count, salt in cases(dts, ("sum", "avg", "max"), counts):
            for path, make in arrays.items():
                before = dev.dev.twoshot_runs
                for algo in algorithms(salt + len(path)):
                    reductions(dev, make, n, r, dt, op, count, salt, algo, path)
                zero_copy[path] += dev.dev.twoshot_runs - before
        # Each path ran as named: registered and first-use arrays zero-copy (the
        # reductions reproducible mode turns direct among them), plain arrays staged.
        assert zero_copy["staged"] == 0 and min(zero_copy.values()) == 0, zero_copy
        assert zero_copy["registered"] > 0 and zero_copy["first use"] > 0, zero_copy
        del dev, arrays
        mpi.Barrier()
    # A call's own setting on a device without it.
    from pycollectives.backends import Call
    from pycollectives.ops import algo_code

    dev = EmulatedDevice(mpi, "kernel", "small", blocks=2)
    rows = inputs(n, 3001, dts[0], "sum", 1)
    x = rows[r].copy()
    dev.dev.run(Call("all_reduce", x, None, 0, 0, algo_code("ring"), reproducible=True))
    same(x, fold(rows, "sum", dts[0]), "device all_reduce, ring, reproducible=True")
    print(f"rank {r} ok device", flush=True)


def main():
    part = sys.argv[1]
    {"host": host, "device": device}[part]()


if __name__ == "__main__":
    run_main(main)
