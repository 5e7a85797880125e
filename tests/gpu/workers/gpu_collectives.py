"""Every collective x dtype x op x root x count x in-place on cupy arrays, against numpy.

Usage: mpiexec -n N python gpu_collectives.py COLLECTIVE [small|default] [ALGO,ALGO,...]
`small` uses the smallest staging slots, so that 1000+ elements stream through many pieces.
The checks mirror workers/collectives.py and workers/new_collectives.py (COLLECTIVE also
all_to_all, gather, scatter, all_gather_v and reduce_scatter_v: per-rank counts and splits
with zeros and one long block); bfloat16 is covered by gpu_extras.py (torch).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The host path's worker, whose uneven counts these checks share, is in tests/ranks/workers.
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "ranks" / "workers"))

import cupy as cp
import numpy as np
from checks import OPS, check_close, digest, make_input, reference, run_main, valid
from gpu_common import use_local_device
from mpi4py import MPI
from new_collectives import uneven

from pycollectives.backends.cuda import CudaComm
from pycollectives.ops import algo_code, op_code

DTYPES = [np.dtype(d) for d in (np.int8, np.uint8, np.int32, np.int64)]
DTYPES += [np.dtype(d) for d in (np.float16, np.float32, np.float64)]
TREE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")
DIRECT_ONLY = ("all_to_all", "gather", "scatter")  # no ring schedule


class Checker:
    def __init__(self, comm: CudaComm, mpi, algorithm, staging):
        self.comm, self.mpi, self.algo = comm, mpi, algo_code(algorithm)
        self.rank, self.size = comm.rank, comm.size
        big = 5000 if staging == "small" else 700_000  # past one staging slot either way
        self.counts = [0, 1, 7, 1000, big]
        self.checks = 0

    def same_everywhere(self, a: np.ndarray, what: str):
        if len(set(self.mpi.allgather(digest(a)))) != 1:
            raise AssertionError(f"{what}: results differ bitwise between ranks")

    def all_reduce(self):
        for dt in DTYPES:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in self.counts:
                    inputs = [make_input(r, count, dt, op) for r in range(self.size)]
                    want = reference(inputs, op, dt)
                    for in_place in (False, True):
                        what = f"all_reduce {dt} {op} count={count} in_place={in_place}"
                        x = cp.asarray(inputs[self.rank])
                        out = None if in_place else cp.zeros_like(x)
                        res = self.comm.all_reduce(x, out, op_code(op), self.algo)
                        got = cp.asnumpy(res)
                        if not in_place:
                            assert np.array_equal(cp.asnumpy(x), inputs[self.rank]), what
                        check_close(got, want, dt, self.size, what, op)
                        self.same_everywhere(got, what)
                        self.checks += 1

    def reduce_scatter(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in self.counts:
                    inputs = [make_input(q, n * count, dt, op) for q in range(n)]
                    want = reference(inputs, op, dt)[r * count : (r + 1) * count]
                    for in_place in (False, True):
                        what = f"reduce_scatter {dt} {op} count={count} in_place={in_place}"
                        x = cp.asarray(inputs[r])
                        out = x[r * count : (r + 1) * count] if in_place else cp.zeros(count, dt)
                        self.comm.reduce_scatter(x, out, op_code(op), algorithm=self.algo)
                        check_close(cp.asnumpy(out), want, dt, n, what, op)
                        self.checks += 1

    def all_gather(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts:
                inputs = [make_input(q, count, dt, "sum") for q in range(n)]
                want = np.concatenate(inputs)
                for in_place in (False, True):
                    what = f"all_gather {dt} count={count} in_place={in_place}"
                    out = cp.zeros(n * count, dt)
                    if in_place:
                        x = out[r * count : (r + 1) * count]
                        x[...] = cp.asarray(inputs[r])
                    else:
                        x = cp.asarray(inputs[r])
                    self.comm.all_gather(x, out, algorithm=self.algo)
                    got = cp.asnumpy(out)
                    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), what
                    self.checks += 1

    def broadcast(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts:
                inputs = [make_input(q, count, dt, "sum") for q in range(n)]
                for root in range(n):
                    what = f"broadcast {dt} count={count} root={root}"
                    x = cp.asarray(inputs[r])
                    self.comm.broadcast(x, root, self.algo)
                    got = cp.asnumpy(x)
                    assert np.array_equal(got.view(np.uint8), inputs[root].view(np.uint8)), what
                    self.checks += 1

    def reduce(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in self.counts:
                    inputs = [make_input(q, count, dt, op) for q in range(n)]
                    want = reference(inputs, op, dt)
                    for root in range(n):
                        for in_place in (False, True):
                            what = f"reduce {dt} {op} count={count} root={root} in_place={in_place}"
                            x = cp.asarray(inputs[r])
                            sentinel = make_input(r + 100, count, dt, op)
                            out = None if in_place else cp.asarray(sentinel)
                            res = self.comm.reduce(x, out, root, op_code(op), self.algo)
                            if r == root:
                                check_close(cp.asnumpy(res), want, dt, n, what, op)
                            elif in_place:
                                assert np.array_equal(cp.asnumpy(x), inputs[r]), what
                            else:
                                assert np.array_equal(cp.asnumpy(out), sentinel), what
                            self.checks += 1

    def same_bits(self, got, want: np.ndarray, what: str):
        got = cp.asnumpy(got)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), what
        self.checks += 1

    def splits(self, seed: int) -> list[list[int]]:
        """A split matrix every rank derives alike: row q is what rank q sends to each rank."""
        n = self.size
        return [uneven(n, seed * n + q, self.counts[-1] if seed == 1 else 5) for q in range(n)]

    def all_to_all(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts:
                inputs = [make_input(q, n * count, dt, "sum") for q in range(n)]
                want = np.concatenate([inputs[q][r * count : (r + 1) * count] for q in range(n)])
                out = cp.zeros(n * count, dt)
                self.comm.all_to_all(cp.asarray(inputs[r]), out, None, None, self.algo)
                self.same_bits(out, want, f"all_to_all {dt} count={count}")
            for seed in range(3):
                m = self.splits(seed)
                send, recv = m[r], [m[q][r] for q in range(n)]
                inputs = [make_input(q, sum(m[q]), dt, "sum", salt=seed) for q in range(n)]
                want = np.concatenate(
                    [inputs[q][sum(m[q][:r]) : sum(m[q][: r + 1])] for q in range(n)]
                )
                out = cp.zeros(sum(recv), dt)
                x = cp.asarray(inputs[r])
                self.comm.all_to_all(x, out, send, recv, self.algo)
                self.same_bits(out, want, f"all_to_all {dt} splits {send} {recv}")

    def gather(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts:
                inputs = [make_input(q, count, dt, "sum") for q in range(n)]
                for root in range(n):
                    out = cp.zeros(n * count, dt) if r == root else None
                    x = cp.asarray(inputs[r])
                    self.comm.gather(x, out, root, self.algo)
                    if r == root:
                        what = f"gather {dt} count={count} root={root}"
                        self.same_bits(out, np.concatenate(inputs), what)

    def scatter(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts:
                for root in range(n):
                    full = make_input(root, n * count, dt, "sum", salt=1)
                    x = cp.asarray(full) if r == root else None
                    out = cp.zeros(count, dt)
                    self.comm.scatter(x, out, root, self.algo)
                    what = f"scatter {dt} count={count} root={root}"
                    self.same_bits(out, full[r * count : (r + 1) * count], what)

    def all_gather_v(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for seed in range(4):
                counts = uneven(n, seed, self.counts[-1])
                inputs = [make_input(q, counts[q], dt, "sum", salt=seed) for q in range(n)]
                out = cp.zeros(sum(counts), dt)
                x = cp.asarray(inputs[r])
                self.comm.all_gather(x, out, counts, self.algo)
                self.same_bits(out, np.concatenate(inputs), f"all_gather {dt} counts={counts}")

    def reduce_scatter_v(self):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for i, op in enumerate(OPS):
                if not valid(dt, op):
                    continue
                counts = uneven(n, i, self.counts[-1] if i % 2 else 7)
                total, start = sum(counts), sum(counts[:r])
                inputs = [make_input(q, total, dt, op) for q in range(n)]
                want = reference(inputs, op, dt)[start : start + counts[r]]
                out = cp.zeros(counts[r], dt)
                x = cp.asarray(inputs[r])
                self.comm.reduce_scatter(x, out, op_code(op), counts, self.algo)
                what = f"reduce_scatter {dt} {op} counts={counts}"
                check_close(cp.asnumpy(out), want, dt, n, what, op)
                self.checks += 1


def main():
    collective = sys.argv[1]
    staging = sys.argv[2] if len(sys.argv) > 2 else "default"
    algos = (sys.argv[3] if len(sys.argv) > 3 else "ring,tree,direct,auto").split(",")
    algos = [a for a in algos if a != "tree" or collective in TREE_COLLECTIVES]
    algos = [a for a in algos if a != "ring" or collective not in DIRECT_ONLY]
    mpi = MPI.COMM_WORLD
    use_local_device()
    comm = CudaComm(mpi, mpi.rank, mpi.size, timeout=60)
    try:
        for algo in algos:
            checker = Checker(comm, mpi, None if algo == "auto" else algo, staging)
            getattr(checker, collective)()
            comm.barrier()
            if comm.rank == 0:
                print(
                    f"{collective} {algo} ranks={comm.size} staging={staging} "
                    f"sync={comm.sync_mode} checks={checker.checks}"
                )
    finally:
        comm.close()


if __name__ == "__main__":
    run_main(main)
