"""nccl-tests for pycollectives: sweep sizes, time each collective, compare, plot.

    mpiexec -n 2 python -m pycollectives.bench all_reduce -b 8 -e 64M -f 2 -c 1 --compare mpi
    mpiexec -n 2 python -m pycollectives.bench all_reduce --device cuda --compare nccl,mpi

Prints nccl-tests' table (out-of-place and in-place time, algbw, busbw, #wrong per size;
with -c 1 every one of -n further iterations is checked against numpy),
then, with --compare, each peer's time as a multiple of ours (>1: we are faster) and the
memory bound (see formulas.py). --json FILE writes the same rows; --plot FILE.png draws
busbw against size. Times are the slowest rank's mean per call: -w warm-up calls, then -n
calls back to back, timed from a barrier until this rank's stream is synchronised.

--device cuda runs on cupy arrays on each rank's GPU (local rank % device count, or
PYCOLL_DEVICE) through the CUDA transport; peers there are nccl (cupy.cuda.nccl, else
torch.distributed) and mpi (mpi4py through host memory: copy out, MPI, copy back), and the
bound is set by the GPU's device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from pycollectives.backends import P2POp
from pycollectives.bench import formulas as F
from pycollectives.ops import ALGORITHMS, ALGORITHMS_FOR, REDUCING

DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
OPS = ("sum", "prod", "min", "max", "avg")
MAX_ITERS = 100_000  # timed calls per size at most, whatever -T asks
# The peers --compare knows, and where each runs.
PEERS = {
    "mpi": "both devices",
    "gloo": "--device cpu",
    "oneccl": "--device cpu",
    "deepspeed": "--device cpu",
    "nccl": "--device cuda",
    # Our own algorithms, each forced (--algo's names): beside the automatic choice, with the
    # fastest of them, the automatic choice and the cost model's choice per size.
    "ring": "both devices",
    "tree": "both devices",
    "direct": "both devices",
}


def dtype_of(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def parse_args(argv=None):
    def size(text):
        try:
            return F.parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    ap = argparse.ArgumentParser(prog="pycoll-bench", description=__doc__.splitlines()[0])
    ap.add_argument("collective", nargs="?", default="all_reduce", choices=(*F.COLLECTIVES, "all"))
    ap.add_argument("-b", "--minbytes", type=size, default=8)
    ap.add_argument("-e", "--maxbytes", type=size, default=32 << 20)
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup_iters", type=int, default=5)
    ap.add_argument(
        "-T",
        "--time",
        type=float,
        default=0.0,
        help="time each size for at least this many seconds: where -n calls would take less, "
        f"run as many more as the warm-up's pace says fit (at most {MAX_ITERS}), so that sizes "
        "of a few microseconds are not a handful of samples",
    )
    ap.add_argument(
        "-c",
        "--check",
        type=int,
        default=0,
        choices=(0, 1),
        help="verify every iteration's result and count wrong elements",
    )
    ap.add_argument("-o", "--op", default="sum", choices=OPS)
    ap.add_argument("-d", "--datatype", default="float32", choices=DTYPES)
    ap.add_argument("-r", "--root", type=int, default=0)
    ap.add_argument(
        "--algo",
        default=None,
        choices=(*ALGORITHMS, "auto"),
        help="the algorithm (default: automatic); with 'all', the collectives that have it",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: numpy arrays (shared memory); cuda: cupy arrays on each rank's GPU",
    )
    ap.add_argument(
        "--compare",
        default="",
        help="comma-separated peers: " + ", ".join(f"{k} ({v})" for k, v in PEERS.items()),
    )
    ap.add_argument(
        "--contention",
        action="store_true",
        help="keep one busy process per core running beside the ranks (a training job's "
        "compute threads), for ours and every peer alike",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure ours and every peer this many times, one after another, and keep each "
        "size's best time for each (a machine whose speed drifts favours nobody); each peer's "
        "ratio is to ours timed right before it at the same size",
    )
    ap.add_argument(
        "--shared",
        action="store_true",
        help="allocate every buffer with Communicator.empty (memory the ranks can map: our "
        "all-reduce then runs over the mapped buffers); the peers get the same buffers",
    )
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--plot", help="draw busbw vs size to this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.minbytes > args.maxbytes:
        ap.error("-b must not exceed -e")
    if args.shared and args.device != "cpu":
        ap.error("--shared applies to --device cpu")
    if args.stepfactor <= 1:
        ap.error("-f must be greater than 1")
    if args.iters < 1 or args.warmup_iters < 0:
        ap.error("-n must be >= 1 and -w >= 0")
    if args.time < 0 or (args.time > 0 and args.warmup_iters < 1):
        ap.error("-T must be >= 0, and needs -w >= 1 (the warm-up sets the pace)")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.op == "avg" and dtype_of(args.datatype).kind not in "fV":
        ap.error("-o avg needs a floating -d")
    if args.algo == "auto":
        args.algo = None
    if args.algo is not None and args.collective != "all":
        have = ALGORITHMS_FOR.get(args.collective, ())
        if args.algo not in have:
            ap.error(
                f"--algo {args.algo}: {args.collective} has no {args.algo} algorithm "
                + (f"(it has {', '.join(have)})" if have else "(it takes no --algo)")
            )
    args.compare = [c for c in args.compare.split(",") if c]
    unknown = set(args.compare) - set(PEERS)
    if unknown:
        ap.error(
            f"--compare: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PEERS)})"
        )
    if args.device == "cpu" and "nccl" in args.compare:
        ap.error("--compare nccl needs --device cuda (NCCL runs on GPU arrays)")
    host_only = [p for p in args.compare if PEERS[p] == "--device cpu"]
    if args.device == "cuda" and host_only:
        ap.error(f"--compare {host_only[0]} runs on host arrays (--device cpu); on cuda: nccl, mpi")
    return args


# Collectives whose in-place form our API has not (their in-place columns stay empty).
NO_IN_PLACE = ("all_to_all", "gather", "scatter", "sendrecv")


def layout(coll, nbytes, dt, n):
    """(input elements, output elements, printed count) for a size, as nccl-tests sizes it:
    the gathered or scattered whole for all_gather, reduce_scatter, all_to_all, gather and
    scatter, one message for sendrecv; None if too small."""
    total = nbytes // dt.itemsize
    if coll == "sendrecv":
        return (total, total, total) if total and n > 1 else None
    if coll in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        per = total // n
        if per == 0:
            return None
        whole = per * n
        if coll in ("all_gather", "gather"):
            return per, whole, whole
        if coll == "all_to_all":
            return whole, whole, whole
        return whole, per, whole
    return (total, total, total) if total else None


def fill(x, rank, op):
    """Small integers, exact in every dtype and under every op for up to 8 ranks."""
    i = np.arange(x.size)
    v = 1 + (i + rank) % 2 if op == "prod" else (rank + 1) * (i % 5 + 1) % 16
    x[...] = v.astype(x.dtype)


def input_of(n, rank, op, dt) -> np.ndarray:
    """A rank's input of `n` elements (see fill), on the host."""
    x = np.empty(n, dt)
    fill(x, rank, op)
    return x


def expected(coll, op, root, n, rank, n_in, dt):
    ins = [input_of(n_in, q, op, dt).astype(np.float64) for q in range(n)]
    if coll in ("all_gather", "gather"):
        return np.concatenate(ins)
    if coll == "broadcast":
        return ins[root]
    if coll == "sendrecv":
        return ins[(rank - 1) % n]
    if coll == "scatter":
        return np.split(ins[root], n)[rank]
    if coll == "all_to_all":
        return np.concatenate([np.split(x, n)[rank] for x in ins])
    stack = np.stack(ins)
    red = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](
        stack, 0
    )
    if op == "avg":
        red = red / n
    if coll == "reduce_scatter":
        per = n_in // n
        return red[rank * per : (rank + 1) * per]
    return red


def count_wrong(got, want, dt):
    g = got.astype(np.float64)
    w = want.astype(dt).astype(np.float64)  # the reference rounded as the dtype would round it
    return int(np.count_nonzero(np.abs(g - w) > 1e-2 * np.abs(w) + 1e-6))


class HostArrays:
    """Where Sweep's buffers live: numpy arrays in host memory (--device cpu). gpu.Device is
    the cupy counterpart, with the same five methods."""

    def empty(self, n, dt):
        return np.empty(n, dt)

    def put(self, dst, src):
        """Copies the host array `src` into `dst`."""
        dst[...] = src

    def host(self, a):
        """`a` readable on the host (after the work queued on it)."""
        return a

    def sync(self):
        """Waits until the collectives this rank has queued have finished."""

    def release(self):
        """Gives cached memory back between sizes."""


class SharedArrays(HostArrays):
    """--shared: numpy arrays from Communicator.empty (every rank allocates alike)."""

    def __init__(self, comm):
        self.comm = comm

    def empty(self, n, dt):
        return self.comm.empty(n, dt)


class Sweep:
    def __init__(self, args, comm, mpi, arrays=None):
        self.args, self.comm, self.mpi = args, comm, mpi
        self.arrays = HostArrays() if arrays is None else arrays
        self.n, self.rank = comm.size, comm.rank
        self.dt = dtype_of(args.datatype)
        self.corrupt = os.environ.get("PYCOLL_BENCH_CORRUPT") == "1"  # test hook for -c

    def ours(self, coll, algorithm=None):
        """Our `coll` as a run(x, out, in_place); `algorithm`: forced (default --algo's)."""
        c, a = self.comm, self.args
        algo = a.algo if algorithm is None else algorithm

        def run(x, out, in_place):
            if coll == "all_reduce":
                c.all_reduce(x, None if in_place else out, op=a.op, algorithm=algo)
            elif coll == "all_gather":
                c.all_gather(
                    out[self.rank * x.size : (self.rank + 1) * x.size] if in_place else x,
                    out,
                    algorithm=algo,
                )
            elif coll == "reduce_scatter":
                c.reduce_scatter(
                    x,
                    x[self.rank * out.size : (self.rank + 1) * out.size] if in_place else out,
                    op=a.op,
                    algorithm=algo,
                )
            elif coll == "broadcast":
                c.broadcast(x, root=a.root, algorithm=algo)
            elif coll == "all_to_all":
                c.all_to_all(x, out, algorithm=algo)
            elif coll == "gather":
                c.gather(x, out if self.rank == a.root else None, root=a.root, algorithm=algo)
            elif coll == "scatter":
                c.scatter(x if self.rank == a.root else None, out, root=a.root, algorithm=algo)
            elif coll == "sendrecv":
                n, r = self.n, self.rank
                c.batch_p2p([P2POp("send", x, (r + 1) % n), P2POp("recv", out, (r - 1) % n)])
            else:
                c.reduce(x, None if in_place else out, root=a.root, op=a.op, algorithm=algo)

        return run

    def result_of(self, coll, x, out, in_place):
        if coll == "broadcast" or (in_place and coll in ("all_reduce", "reduce")):
            return x
        if coll == "reduce_scatter" and in_place:
            return x[self.rank * out.size : (self.rank + 1) * out.size]
        return out

    def time_one(self, run, coll, n_in, n_out, in_place, check, sync=None):
        """(seconds per call, wrong elements, timed calls), nccl-tests' way: -w warm-up
        calls, then -n calls (more with -T: ``iterations``) back to back from a barrier until
        this rank's queued work is done (`sync`, default the arrays' stream), the slowest rank's
        mean; the checked calls come after."""
        a, op, mem = self.args, self.args.op, self.arrays
        sync = mem.sync if sync is None else sync
        x, out = mem.empty(n_in, self.dt), mem.empty(n_out, self.dt)
        x_in = input_of(n_in, self.rank, op, self.dt)

        def reset():
            mem.put(x, x_in)
            if coll == "all_gather" and in_place:
                out[self.rank * n_in : (self.rank + 1) * n_in] = x

        reset()
        warm = []
        for _ in range(a.warmup_iters):
            t0 = time.perf_counter()
            run(x, out, in_place)
            sync()
            warm.append(time.perf_counter() - t0)
        iters = self.iterations(sorted(warm)[len(warm) // 2] if warm else 0.0)
        rooted = coll in ("reduce", "gather") and self.rank != a.root
        wrong, checks_here = 0, check and not rooted
        want = expected(coll, op, a.root, self.n, self.rank, n_in, self.dt) if check else None
        self.mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            run(x, out, in_place)
        sync()
        elapsed = time.perf_counter() - t0
        # Checked iterations run apart from the timed ones: each starts from a fresh input
        # (in-place runs overwrite it) and its result, copied to the host, is compared with
        # the reference.
        for it in range(a.iters if check else 0):
            reset()
            run(x, out, in_place)
            res = mem.host(self.result_of(coll, x, out, in_place))
            if self.corrupt and it == 0 and self.rank == 0 and res.size:
                res.flat[0] = res.flat[0] + 3
            if checks_here:
                wrong += count_wrong(res, want, self.dt)
        sync()
        t = self.mpi.allreduce(elapsed / iters, op=_max())
        return t, self.mpi.allreduce(wrong), iters

    def iterations(self, pace):
        """Timed calls: -n, or with -T as many as fit in -T seconds at the pace of the warm-up
        (`pace`: this rank's median warm-up call, so that one call that lost the core for a
        time slice does not set it; the slowest rank's pace counts)."""
        a = self.args
        if a.time <= 0:
            return a.iters
        pace = self.mpi.allreduce(pace, op=_max())
        fit = a.time / pace if pace > 0 else MAX_ITERS
        return max(a.iters, min(MAX_ITERS, int(fit)))

    def row(self, coll, nbytes):
        shape = layout(coll, nbytes, self.dt, self.n)
        if shape is None:
            return None
        n_in, n_out, count = shape
        size = count * self.dt.itemsize
        row = {
            "collective": coll,
            "size": size,
            "count": count,
            "type": self.dt.name,
            "redop": self.args.op if coll in REDUCING else "none",
            "root": self.args.root if coll in ("broadcast", "reduce", "gather", "scatter") else -1,
        }
        check = bool(self.args.check)
        nan = float("nan")
        row["ip"] = {"time_us": nan, "algbw": nan, "busbw": nan, "wrong": 0}
        for key, in_place in (("oop", False), ("ip", True)):
            if in_place and coll in NO_IN_PLACE:
                continue
            t, wrong, iters = self.time_one(self.ours(coll), coll, n_in, n_out, in_place, check)
            row[key] = {
                "time_us": t * 1e6,
                "algbw": F.algbw(size, t),
                "busbw": F.busbw(coll, self.n, size, t),
                "wrong": wrong,
                "iters": iters,
            }
        row["compare"] = {}
        self.arrays.release()
        return row

    def compare(self, row, name, run):
        """Times a peer (out of place) on the row's size, and with -c 1 checks its results as
        ours are checked. Peers run after all of our sizes: some leave threads polling for a
        while (gloo), which would slow whatever runs next.

        The ratio is taken against ours timed again (out of place, unchecked) right before
        the peer, at the same size and with the peer open: a machine whose speed changes
        from one minute to the next (a VM whose host moves its vCPUs) then times both alike,
        where our row's time may come from another minute. ``ours_us`` keeps that time."""
        if isinstance(run, str):
            row["compare"][name] = {"skipped": run}
            return
        coll, size = row["collective"], row["size"]
        n_in, n_out, _ = layout(coll, size, self.dt, self.n)
        check = bool(self.args.check)
        ours, _, _ = self.time_one(self.ours(coll), coll, n_in, n_out, False, False)
        t, wrong, iters = self.time_one(
            run, coll, n_in, n_out, False, check, getattr(run, "sync", None)
        )
        self.arrays.release()
        row["compare"][name] = {
            "time_us": t * 1e6,
            "busbw": F.busbw(coll, self.n, size, t),
            "ours_us": ours * 1e6,
            "ratio": t / ours,
            "wrong": wrong,
            "iters": iters,
        }


def _max():
    from mpi4py import MPI

    return MPI.MAX
