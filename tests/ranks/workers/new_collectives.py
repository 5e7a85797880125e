"""All-to-all, gather, scatter and uneven all-gather / reduce-scatter against MPI's own.

Usage: mpiexec -n N python new_collectives.py data|blocks|mismatch|args
                                              [--arrays LIB] [--big K] [--parts P,P...]
data:     every dtype, counts 0, 1, 7 and multi-piece, uneven splits with zeros, every root,
          in place where the collective has that form, async_op, against mpi4py's Alltoall,
          Alltoallv, Gather, Scatter, Allgatherv and Reduce_scatter.
blocks:   all-to-all, gather and scatter of data, run with a low PYCOLL_P2P_DIRECT_BYTES.
mismatch: ranks that disagree on splits, counts, sizes or root all raise CollectiveMismatch.
args:     bad arguments raise TypeError / ValueError on the calling rank before anything moves.
data runs through the Communicator's own methods, on arrays of LIB (harness/arrayimpl.py;
default numpy), its long blocks of K elements (default 1500), the parts P of Data (default
all: all_to_all, gather_scatter, all_gather_v, reduce_scatter_v); mismatch and args call the
native communicator (comm._host.c) with codes for ops and algorithms, to test its checks
directly.
"""

from __future__ import annotations

import os
import sys
import time

import checks
import numpy as np
from arrayimpl import Numpy, array_lib, pop_option
from checks import OPS, check_close, expect, is_float, make_input, reference, run_main
from mpi4py import MPI

import pycollectives as pc
from pycollectives.backends import Call

AUTO, RING, TREE, DIRECT = 0, 1, 2, 3
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
BIG = 1500  # elements: several 4096-byte staging slots for every dtype but int8/uint8 (3000)


def mpi_view(a: np.ndarray) -> np.ndarray:
    """An array MPI can move bit for bit (MPI has no float16/bfloat16: their bits as uint16)."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 and a.dtype.kind != "i" else a


def same_bits(got: np.ndarray, want: np.ndarray, what: str):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: shape or dtype"
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{what}: wrong elements"


def uneven(n: int, seed: int, big: int) -> list[int]:
    """Per-rank counts every rank derives alike: zeros, small blocks and one long one."""
    rng = np.random.default_rng([n, seed])
    c = rng.integers(0, 9, n) * (rng.random(n) < 0.7)
    c[seed % n] = big if seed % 2 else c[seed % n]
    return [int(v) for v in c]


def wait_for(work):
    if work is not None:
        work.wait()


class Data:
    """The test bodies: inputs and references in numpy, the collectives' arrays of `lib`."""

    def __init__(self, comm: pc.Communicator, mpi: MPI.Comm, lib=None, big=BIG):
        self.c, self.mpi = comm, mpi
        self.rank, self.size = mpi.rank, mpi.size
        self.calls = 0
        self.lib, self.big = lib or Numpy(), big
        self.dtypes = [dt for dt in checks.DTYPES if self.lib.supports(dt)]

    def run(self, fn, *args, algos=(AUTO, DIRECT), **kw):
        """Calls fn with the next algorithm of `algos`; every third call is asynchronous."""
        self.calls += 1
        algo = algos[self.calls % len(algos)]
        name = None if algo == AUTO else pc.ops.ALGORITHMS[algo - 1]
        res = fn(*args, algorithm=name, async_op=self.calls % 3 == 0, **kw)
        wait_for(res if isinstance(res, pc.Work) else None)

    def all_to_all(self):
        n, r, lib = self.size, self.rank, self.lib
        for dt in self.dtypes:
            for k in (0, 1, 7, self.big):
                x = make_input(r, n * k, dt, "sum")
                out = lib.zeros(n * k, dt)
                self.run(self.c.all_to_all, lib.asarray(x), out, None, None)
                out = lib.numpy(out)
                ref = np.zeros_like(mpi_view(out))
                self.mpi.Alltoall(mpi_view(x), ref)
                same_bits(mpi_view(out), ref, f"all_to_all {dt} k={k}")
            for seed in range(3):
                big = self.big if seed == 1 else 5
                matrix = [uneven(n, seed * n + q, big) for q in range(n)]
                send = matrix[r]
                recv = [matrix[q][r] for q in range(n)]
                x = make_input(r, sum(send), dt, "sum", salt=seed)
                out = lib.zeros(sum(recv), dt)
                self.run(self.c.all_to_all, lib.asarray(x), out, send, recv)
                out = lib.numpy(out)
                ref = np.zeros_like(mpi_view(out))
                sdispl = np.concatenate([[0], np.cumsum(send)[:-1]]).tolist()
                rdispl = np.concatenate([[0], np.cumsum(recv)[:-1]]).tolist()
                self.mpi.Alltoallv([mpi_view(x), (send, sdispl)], [ref, (recv, rdispl)])
                same_bits(mpi_view(out), ref, f"all_to_all {dt} splits {send} {recv}")

    def gather_scatter(self):
        n, r, lib = self.size, self.rank, self.lib
        for dt in self.dtypes:
            for k in (0, 1, 7, self.big):
                x = make_input(r, k, dt, "sum")
                for root in range(n):
                    # gather: out on the root only; in place (x inside out) every other time
                    in_place = (root + k) % 2 == 1
                    out = lib.asarray(np.full(n * k, 3, dt)) if r == root else None
                    xs = lib.asarray(x)
                    if in_place and r == root:
                        xs = out[root * k : (root + 1) * k]
                        xs[...] = lib.asarray(x)
                    self.run(self.c.gather, xs, out, root)
                    ref = np.zeros_like(mpi_view(np.zeros(n * k, dt))) if r == root else None
                    self.mpi.Gather(mpi_view(x), ref, root=root)
                    if r == root:
                        got = mpi_view(lib.numpy(out))
                        same_bits(got, ref, f"gather {dt} k={k} root={root}")
                    # scatter: x on the root only
                    full = make_input(root, n * k, dt, "sum", salt=1)
                    out = lib.zeros(k, dt)
                    xs = lib.asarray(full) if r == root else None
                    if in_place and r == root:
                        out = xs[root * k : (root + 1) * k]
                    self.run(self.c.scatter, xs, out, root)
                    ref = np.zeros_like(mpi_view(np.zeros(k, dt)))
                    self.mpi.Scatter(mpi_view(full) if r == root else None, ref, root=root)
                    same_bits(mpi_view(lib.numpy(out)), ref, f"scatter {dt} k={k} root={root}")
                    if r == root:
                        kept = lib.numpy(xs)[: root * k]
                        same_bits(kept, full[: root * k], "scatter: x changed")

    def all_gather_v(self):
        n, r, lib = self.size, self.rank, self.lib
        for dt in self.dtypes:
            for seed in range(4):
                counts = uneven(n, seed, self.big)
                x = make_input(r, counts[r], dt, "sum", salt=seed)
                displ = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
                out = lib.zeros(sum(counts), dt)
                xs = lib.asarray(x)
                if seed % 2:  # in place: x is this rank's block of out
                    xs = out[displ[r] : displ[r] + counts[r]]
                    xs[...] = lib.asarray(x)
                self.run(self.c.all_gather, xs, out, counts=counts, algos=(AUTO, RING, DIRECT))
                out = lib.numpy(out)
                ref = np.zeros_like(mpi_view(out))
                self.mpi.Allgatherv(mpi_view(x), [ref, (counts, displ)])
                same_bits(mpi_view(out), ref, f"all_gather {dt} counts={counts}")

    def reduce_scatter_v(self):
        n, r, lib = self.size, self.rank, self.lib
        for dt in self.dtypes:
            for i, op in enumerate(OPS):
                if op == "avg" and not is_float(dt):
                    continue
                counts = uneven(n, i, self.big if i % 2 else 7)
                total = sum(counts)
                start = sum(counts[:r])
                x = make_input(r, total, dt, op)
                want = reference([make_input(q, total, dt, op) for q in range(n)], op, dt)
                want = want[start : start + counts[r]]
                out = lib.zeros(counts[r], dt)
                xs = lib.asarray(x)
                if i % 2:  # in place: out is this rank's block of x
                    out = xs[start : start + counts[r]]
                self.run(
                    self.c.reduce_scatter, xs, out, op, counts=counts, algos=(AUTO, RING, DIRECT)
                )
                out = lib.numpy(out)
                what = f"reduce_scatter {dt} {op} counts={counts}"
                check_close(out, want, dt, n, what, op)
                if op in MPI_OPS and mpi_view(x) is x and dt.itemsize >= 4 - 3 * (dt.kind != "f"):
                    ref = np.zeros(counts[r], dt)
                    self.mpi.Reduce_scatter(x, ref, counts, op=MPI_OPS[op])
                    want = ref.astype(np.float64) if is_float(dt) else ref
                    check_close(out, want, dt, n, f"{what} vs MPI", op)


PARTS = ("all_to_all", "gather_scatter", "all_gather_v", "reduce_scatter_v")


def data(mpi, lib=None, big=BIG, parts=PARTS):
    with pc.Communicator(mpi, staging_bytes=4096) as comm:
        d = Data(comm, mpi, lib, big)
        for part in parts:
            getattr(d, part)()
        comm.barrier()
    return f"calls={d.calls}"


def blocks(mpi):
    """All-to-all, gather and scatter with blocks from PYCOLL_P2P_DIRECT_BYTES up (the test
    sets it low) moved point-to-point, small blocks of the same call through the schedule."""
    with pc.Communicator(mpi, staging_bytes=4096) as comm:
        d = Data(comm, mpi)
        d.all_to_all()
        d.gather_scatter()
        comm.barrier()
    return f"calls={d.calls}"


# A rank that only sends in these (gather's non-roots, scatter's root) does not wait for its
# peers to arrive: it may raise at its next call instead (docs/guide/communicator.md,
# "Mismatches").
SENDERS_MAY_DEFER = ("gather count", "scatter root")


def mismatch(mpi):
    n, r = mpi.size, mpi.rank
    last = r == n - 1
    m = [[1 + q + p for p in range(n)] for q in range(n)]
    col = [m[q][r] + (1 if last and q == 0 else 0) for q in range(n)]
    counts = list(range(1, n + 1))
    cases = {
        # name: (call on the Communicator, words every rank's message holds)
        "splits": (
            lambda c: c.all_to_all(
                np.ones(sum(m[r]), np.int32), np.ones(sum(col), np.int32), m[r], col, "direct"
            ),
            ["splits", f"rank 0 sends {m[0][n - 1]} elements to rank {n - 1}"],
        ),
        "even vs splits": (
            lambda c: c.all_to_all(
                np.ones(n, np.int32), np.ones(n, np.int32), *([[1] * n] * 2 if last else [None] * 2)
            ),
            ["splits"],
        ),
        "all_gather counts": (
            lambda c: c.all_gather(
                np.ones(counts[r] + last, np.float32),
                np.ones(sum(counts) + last, np.float32),
                counts=counts[:-1] + [counts[-1] + last],
            ),
            ["counts"],
        ),
        "reduce_scatter counts": (
            lambda c: c.reduce_scatter(
                np.ones(sum(counts) + last, np.float32),
                np.ones(counts[r] + last, np.float32),
                counts=counts[:-1] + [counts[-1] + last],
            ),
            ["counts"],
        ),
        "gather count": (
            lambda c: (
                c.gather(np.ones(3 + last, np.int8), np.ones(n * 3, np.int8), 0)
                if r == 0 or last
                else c.gather(np.ones(3, np.int8), None, 0)
            ),
            ["count"],
        ),
        "scatter root": (
            lambda c: c.scatter(np.ones(2 * n, np.float64), np.ones(2, np.float64), int(last)),
            ["root"],
        ),
    }
    across_nodes = "PYCOLL_RANKS_PER_NODE" in os.environ or "PYCOLL_TEST_NODES" in os.environ
    for name, (call, words) in cases.items():
        if across_nodes and name != "splits" and name != "even vs splits":
            continue  # between nodes only the splits are checked before data moves
        comm = pc.Communicator(mpi, timeout=30)
        comm.all_reduce(np.ones(3, np.int32))  # a matching call first

        def run(call=call, comm=comm, name=name):
            call(comm)
            if name in SENDERS_MAY_DEFER:  # its check comes here at the latest
                comm.all_reduce(np.ones(3, np.int32))

        t0 = time.monotonic()
        msg = expect(pc.CollectiveMismatch, run, *(words if not across_nodes else ["splits"]))
        assert time.monotonic() - t0 < 10, f"{name}: detected late"
        expect(pc.CollectiveError, lambda comm=comm: comm.barrier(), "earlier error")
        messages = mpi.allgather(msg)
        if name == "splits":  # everyone checked the same matrix: the same words everywhere
            assert len(set(messages)) == 1, messages
        comm.close()
    return f"cases={len(cases)}"


def native(c, collective, x, out, **fields):
    """`collective` on the host communicator `c` as the Communicator hands it over (a Call,
    with native codes), to test the native checks directly."""
    return c.run_call(Call(collective, x, out, **fields))


def args(mpi):
    n, r = mpi.size, mpi.rank
    f4, f8 = np.float32, np.float64
    with pc.Communicator(mpi) as comm:
        c = comm._host.c
        x, out = np.ones(2 * n, f4), np.zeros(2 * n, f4)

        def a2a(**splits):  # an all_to_all of 2 elements per rank but for `splits`
            return native(
                c, "all_to_all", x, out, **{"in_splits": [2] * n, "out_splits": [2] * n, **splits}
            )

        bad = [
            (ValueError, lambda: a2a(out_splits=None), "both"),
            (ValueError, lambda: a2a(in_splits=[2] * (n + 1)), "in_splits"),
            (ValueError, lambda: a2a(in_splits=[-1] + [2] * n), "entries"),
            (ValueError, lambda: a2a(out_splits=[3] * n), "out_splits"),
            (ValueError, lambda: a2a(in_splits=[2] * (n - 1) + [-2]), "neg"),
            (TypeError, lambda: native(c, "all_to_all", x, out.astype(f8)), "dtype"),
            (ValueError, lambda: native(c, "all_to_all", x, x), "overlap"),
            (ValueError, lambda: native(c, "all_to_all", x, out, algorithm=RING), "not available"),
            (ValueError, lambda: native(c, "all_to_all", x, out[1:]), "out"),
            (ValueError, lambda: native(c, "gather", x, out, root=n), "root"),
            (ValueError, lambda: native(c, "gather", x, out, root=-1), "root"),
            (ValueError, lambda: native(c, "scatter", x, out, root=n, algorithm=TREE), "root"),
            (
                ValueError,
                lambda: native(c, "gather", x, np.zeros(2 * n * n, f4), algorithm=RING),
                "not available",
            ),
            (ValueError, lambda: native(c, "all_gather", x, out, counts=[1] * (n + 1)), "counts"),
            (ValueError, lambda: native(c, "all_gather", x, out, counts=[-1] * n), "negative"),
            (ValueError, lambda: native(c, "reduce_scatter", x, out, counts=[1] * n), "x has"),
            (
                ValueError,
                lambda: native(c, "reduce_scatter", x, out[:2], algorithm=TREE, counts=[2] * n),
                "tree",
            ),
            (
                ValueError,
                lambda: pc._C.check_args(Call("broadcast", x, counts=[1] * n), r, n),
                "counts",
            ),
            (
                ValueError,
                lambda: pc._C.check_args(Call("all_reduce", x, in_splits=[1] * n), r, n),
                "splits",
            ),
        ]
        if r == 0:
            bad += [
                (ValueError, lambda: native(c, "gather", x, np.zeros(2 * n + 1, f4)), "out has"),
                (TypeError, lambda: native(c, "gather", x, None), "numpy"),
                (TypeError, lambda: native(c, "gather", x, np.zeros(2 * n * n, f8)), "dtype"),
                (ValueError, lambda: native(c, "scatter", x, np.zeros(3, f4)), "x has"),
                (TypeError, lambda: native(c, "scatter", None, out), "numpy"),
                (ValueError, lambda: native(c, "all_gather", x, out, counts=[1] * n), "x has"),
            ]
        for i, (exc, fn, word) in enumerate(bad):
            try:
                expect(exc, fn, word)
            except AssertionError as e:
                raise AssertionError(f"bad argument case {i}: {e}") from None
        # The same checks for arrays described elsewhere (the CUDA transport's), and the even
        # forms.
        described_checks(x, out, r, n)
        gathered = Call("all_gather", x[: r + 1], np.zeros(n * (n + 1) // 2, f4))
        assert (
            pc._C.check_args(gathered._replace(counts=list(range(1, n + 1))), r, n)[0]
            == n * (n + 1) // 2
        )
        # Nothing moved and nothing is poisoned: a real call still works.
        native(c, "all_to_all", x, out)
        assert np.array_equal(out, np.ones(2 * n, f4))
    return f"checks={len(bad)}"


def described_checks(x, out, r, n):
    """The CUDA transport's checks of arrays described as (pointer, count, dtype code): those
    of the host path (skipped where pycollectives was built without CUDA)."""
    try:
        from pycollectives import _cuda
    except ImportError:
        return
    from pycollectives.backends import Call

    ptr = x.ctypes.data
    desc = (ptr, 2 * n, 6)
    a2a = Call("all_to_all", None)
    assert _cuda.check_args(a2a, desc, (out.ctypes.data, 2 * n, 6), r, n) == 2

    def scatter():
        return _cuda.check_args(Call("scatter", None), None, (ptr, 2, 6), r, n)

    if r == 0:
        expect(ValueError, scatter, "x is required")
    else:
        assert scatter() == 2


def main():
    mode, *opts = sys.argv[1:]
    mpi = MPI.COMM_WORLD
    kw = {}
    if "--arrays" in opts:
        kw["lib"] = array_lib(pop_option(opts, "--arrays"))
    if "--big" in opts:
        kw["big"] = int(pop_option(opts, "--big"))
    if "--parts" in opts:
        kw["parts"] = pop_option(opts, "--parts").split(",")
    summary = {"data": data, "blocks": blocks, "mismatch": mismatch, "args": args}[mode](mpi, **kw)
    if mpi.rank == 0:
        print(f"{mode} ranks={mpi.size} {summary}")


if __name__ == "__main__":
    run_main(main)
