"""Soak test: many random collectives, each checked against a numpy reference.

    mpiexec -n 4 python -m pycollectives.soak [--iterations 2000] [--seed 0]

Every iteration draws, identically on every rank, a collective, an algorithm, a dtype, an op,
a root, a count (up to several staging buffers) and in-place or not; each rank regenerates
every rank's input, computes the expected result with numpy, and counts wrong elements.
All-reduce results are also compared bitwise across ranks. Prints the counts; exits 1 if
anything was wrong.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections import Counter

import numpy as np

import pycollectives as pc
from pycollectives import ops as _ops
from pycollectives.runtime import arrays

# Every collective of the core, and point-to-point exchanges.
COLLECTIVES = (*_ops.COLLECTIVES, "sendrecv")
ALGOS = {c: (None, *_ops.ALGORITHMS_FOR.get(c, ())) for c in COLLECTIVES}
OPS = ("sum", "prod", "min", "max", "avg")


def dtypes():
    out = [
        np.dtype(t) for t in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64")
    ]
    try:
        out.append(arrays.numpy_dtype("bfloat16"))
    except TypeError:  # no ml_dtypes
        pass
    return out


def is_float(dt):
    return dt.kind == "f" or dt.name == "bfloat16"


def make_input(seed, it, rank, count, dt, op):
    rng = np.random.default_rng([seed, it, rank])
    if is_float(dt):
        lo, hi = (0.5, 1.5) if op == "prod" else (-2.0, 2.0)
        return rng.uniform(lo, hi, count).astype(dt)
    lo, hi = ((0, 4) if dt.kind == "u" else (-3, 4)) if op == "prod" else (-100, 100)
    if dt.kind == "u":
        lo = max(lo, 0)
    return rng.integers(lo, hi, count).astype(dt)


def reduce_ref(inputs, op, dt):
    stack = np.stack([x.astype(np.float64) for x in inputs]) if is_float(dt) else np.stack(inputs)
    if op in ("sum", "avg"):
        r = np.sum(stack, axis=0, dtype=stack.dtype)
        return r / len(inputs) if op == "avg" else r
    if op == "prod":
        return np.prod(stack, axis=0, dtype=stack.dtype)
    return np.min(stack, axis=0) if op == "min" else np.max(stack, axis=0)


def count_wrong(got, want, dt, n, op):
    if got.size == 0:
        return 0
    if not is_float(dt):
        return int(np.count_nonzero(got != want))
    g = got.astype(np.float64)
    if op in ("min", "max"):
        return int(np.count_nonzero(g != want.astype(dt).astype(np.float64)))
    eps = 2.0**-8 if dt.name == "bfloat16" else float(np.finfo(dt).eps)
    scale = 2.0**n if op == "prod" else 4.0
    return int(np.count_nonzero(np.abs(g - want) > 4 * n * eps * (np.abs(want) + scale)))


def one(comm, mpi, seed, it, dts, max_count, stats):
    n, r = comm.size, comm.rank
    rng = np.random.default_rng([seed, it, 1 << 20])  # the same draw on every rank
    coll = COLLECTIVES[rng.integers(len(COLLECTIVES))]
    algo = ALGOS[coll][rng.integers(len(ALGOS[coll]))]
    dt = dts[rng.integers(len(dts))]
    op = OPS[rng.integers(len(OPS))]
    if op == "avg" and not is_float(dt):
        op = "sum"
    root = int(rng.integers(n))
    count = int(rng.integers(0, max_count + 1))
    in_place = bool(rng.integers(2))
    stats[coll] += 1
    m = count
    if coll in ("all_to_all", "gather", "scatter", "sendrecv") or (
        coll in ("all_gather", "reduce_scatter") and rng.integers(2)
    ):
        wrong = _uneven(comm, rng, seed, it, coll, algo, dt, op, root, max(1, count // n))
        stats["wrong elements"] += wrong
        return
    if coll in ("reduce_scatter",):
        inputs = [make_input(seed, it, q, n * m, dt, op) for q in range(n)]
    else:
        inputs = [make_input(seed, it, q, m, dt, op) for q in range(n)]
    x = inputs[r].copy()
    if coll == "all_reduce":
        out = x if in_place else np.empty_like(x)
        comm.all_reduce(x, None if in_place else out, op=op, algorithm=algo)
        wrong = count_wrong(out, reduce_ref(inputs, op, dt), dt, n, op)
        digests = mpi.allgather(hashlib.sha1(out.tobytes()).digest())
        if r == 0:
            stats["cross-rank differences"] += len(set(digests)) - 1
    elif coll == "reduce_scatter":
        out = x[r * m : (r + 1) * m] if in_place else np.empty(m, dt)
        comm.reduce_scatter(x, out, op=op, algorithm=algo)
        wrong = count_wrong(out, reduce_ref(inputs, op, dt)[r * m : (r + 1) * m], dt, n, op)
    elif coll == "all_gather":
        out = np.empty(n * m, dt)
        if in_place:
            out[r * m : (r + 1) * m] = x
            x = out[r * m : (r + 1) * m]
        comm.all_gather(x, out, algorithm=algo)
        want = np.concatenate(inputs) if m else out
        wrong = int(np.count_nonzero(out.view(np.uint8) != want.view(np.uint8)))
    elif coll == "broadcast":
        comm.broadcast(x, root=root, algorithm=algo)
        wrong = int(np.count_nonzero(x.view(np.uint8) != inputs[root].view(np.uint8)))
    else:
        out = None if in_place else np.empty_like(x)
        res = comm.reduce(x, out, root=root, op=op, algorithm=algo)
        wrong = count_wrong(res, reduce_ref(inputs, op, dt), dt, n, op) if r == root else 0
    stats["wrong elements"] += wrong


def _uneven(comm, rng, seed, it, coll, algo, dt, op, root, per):
    """The collectives that move blocks between ranks (some of them empty), and a shifted
    point-to-point exchange; returns the number of wrong elements on this rank."""
    n, r = comm.size, comm.rank
    sizes = rng.integers(0, per + 1, (n, n))  # sizes[i, j]: what i sends j
    if coll in ("gather", "scatter"):
        sizes[:] = sizes[0, 0]
    inputs = [make_input(seed, it, q, int(sizes[q].sum()), dt, op) for q in range(n)]
    blocks = [np.split(x, np.cumsum(sizes[q])[:-1]) for q, x in enumerate(inputs)]
    x = inputs[r].copy()
    if coll == "all_to_all":
        out = np.empty(int(sizes[:, r].sum()), dt)
        even = bool(rng.integers(2)) and len(set(sizes.ravel())) == 1
        splits = (None, None) if even else (sizes[r].tolist(), sizes[:, r].tolist())
        comm.all_to_all(x, out, *splits, algorithm=algo)
        want = np.concatenate([blocks[i][r] for i in range(n)])
    elif coll == "gather":
        mine = blocks[r][0]
        out = np.empty(n * mine.size, dt) if r == root else None
        comm.gather(mine.copy(), out, root=root, algorithm=algo)
        want = np.concatenate([blocks[i][0] for i in range(n)]) if r == root else None
    elif coll == "scatter":
        out = np.empty(blocks[root][r].size, dt)
        comm.scatter(x if r == root else None, out, root=root, algorithm=algo)
        want = blocks[root][r]
    elif coll == "all_gather":
        counts = [int(c) for c in sizes[:, 0]]
        mine = make_input(seed, it, r, counts[r], dt, op)
        out = np.empty(sum(counts), dt)
        comm.all_gather(mine, out, counts=counts, algorithm=algo)
        want = np.concatenate([make_input(seed, it, q, counts[q], dt, op) for q in range(n)])
    elif coll == "reduce_scatter":
        counts = [int(c) for c in sizes[:, 0]]
        full = [make_input(seed, it, q, sum(counts), dt, op) for q in range(n)]
        out = np.empty(counts[r], dt)
        comm.reduce_scatter(full[r].copy(), out, op=op, counts=counts, algorithm=algo)
        lo = sum(counts[:r])
        return count_wrong(out, reduce_ref(full, op, dt)[lo : lo + counts[r]], dt, n, op)
    else:  # sendrecv: to the rank k ahead, from the rank k behind, on a random tag
        if n == 1:
            return 0
        k, tag = int(rng.integers(1, n)), int(rng.integers(0, 4))
        dst, src = (r + k) % n, (r - k) % n
        out = np.empty(blocks[src][r].size, dt)
        comm.batch_p2p(
            [pc.P2POp("send", blocks[r][dst].copy(), dst, tag), pc.P2POp("recv", out, src, tag)]
        )
        want = blocks[src][r]
    if want is None:
        return 0
    return int(np.count_nonzero(out.view(np.uint8) != want.view(np.uint8)))


def main(argv=None):
    ap = argparse.ArgumentParser(description="random collectives checked against numpy")
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--staging-bytes",
        type=int,
        default=4096,
        help="staging slot size; counts go up to several slots",
    )
    ap.add_argument("--max-slots", type=int, default=4, help="largest count, in staging slots")
    args = ap.parse_args(argv)
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    comm = pc.Communicator(mpi, staging_bytes=args.staging_bytes)
    dts = dtypes()
    max_count = args.max_slots * args.staging_bytes // 4
    stats = Counter()
    t0 = time.perf_counter()
    for it in range(args.iterations):
        one(comm, mpi, args.seed, it, dts, max_count, stats)
        if comm.rank == 0 and sys.stderr.isatty() and it % 100 == 0:
            sys.stderr.write(f"\r{it}/{args.iterations}")
    elapsed = time.perf_counter() - t0
    keys = (*COLLECTIVES, "wrong elements", "cross-rank differences")  # same on every rank
    total = Counter({k: mpi.allreduce(stats[k]) for k in keys})
    wrong = total["wrong elements"] + total["cross-rank differences"]
    if comm.rank == 0:
        calls = sum(total[c] for c in COLLECTIVES) // comm.size
        per = ", ".join(f"{c} {total[c] // comm.size}" for c in COLLECTIVES)
        print(f"soak: {calls} collectives on {comm.size} ranks in {elapsed:.1f} s ({per})")
        print(
            f"wrong elements: {total['wrong elements']}, "
            f"cross-rank differences: {total['cross-rank differences']}"
        )
    comm.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
