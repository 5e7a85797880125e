"""Every collective x dtype x op x root x count x in-place against numpy and MPI.

Usage: mpiexec -n N python collectives.py COLLECTIVE [small|default] [ALGO,ALGO,...]
`small` uses tiny staging slots so that even short vectors stream through many pieces.
ALGO: ring, tree, direct or auto (default: all of them that have the collective).
"""

from __future__ import annotations

import sys

import numpy as np
from checks import (
    DTYPES,
    OPS,
    check_close,
    digest,
    is_float,
    make_input,
    reference,
    run_main,
    valid,
)
from mpi4py import MPI

import pycollectives as pc

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}


class Checker:
    def __init__(self, comm: pc.Communicator, mpi: MPI.Comm, algorithm):
        self.comm, self.mpi, self.algorithm = comm, mpi, algorithm
        self.rank, self.size = comm.rank, comm.size
        self.checks = 0

    def counts(self, staging: str) -> list[int]:
        n = self.size
        big = 1000 if staging == "small" else 300_000
        return [0, 1, 7, 3 * n + 1, big]

    def mpi_ok(self, dt, op) -> bool:
        # MPI has no float16/bfloat16 and no avg; its own collectives are the second reference.
        return dt.kind in "iuf" and dt.itemsize >= 4 - 3 * (dt.kind != "f") and op in MPI_OPS

    def same_everywhere(self, a: np.ndarray, what: str):
        digests = self.mpi.allgather(digest(a))
        if len(set(digests)) != 1:
            raise AssertionError(f"{what}: results differ bitwise between ranks")

    # -- one function per collective ----------------------------------------------------------

    def all_reduce(self, staging):
        for dt in DTYPES:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in self.counts(staging):
                    inputs = [make_input(r, count, dt, op) for r in range(self.size)]
                    want = reference(inputs, op, dt)
                    for in_place in (False, True):
                        what = f"all_reduce {dt} {op} count={count} in_place={in_place}"
                        x = inputs[self.rank].copy()
                        if in_place:
                            out = self.comm.all_reduce(x, op=op, algorithm=self.algorithm)
                        else:
                            out = np.zeros_like(x)
                            self.comm.all_reduce(x, out, op=op, algorithm=self.algorithm)
                            assert np.array_equal(x, inputs[self.rank]), f"{what}: x modified"
                        check_close(out, want, dt, self.size, what, op)
                        self.same_everywhere(out, what)
                        self.checks += 1
                    if self.mpi_ok(dt, op) and count:
                        ref = np.empty_like(inputs[self.rank])
                        self.mpi.Allreduce(inputs[self.rank], ref, op=MPI_OPS[op])
                        check_close(
                            out,
                            ref.astype(np.float64) if is_float(dt) else ref,
                            dt,
                            self.size,
                            f"all_reduce vs MPI {dt} {op} {count}",
                            op,
                        )

    def reduce_scatter(self, staging):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in self.counts(staging):
                    # Rank q's input is n blocks, block k made on its own: this rank makes
                    # its whole input and every rank's block r, not every rank's whole input.
                    mine = np.concatenate(
                        [make_input(r, count, dt, op, salt=k + 1) for k in range(n)]
                    )
                    blocks_r = [make_input(q, count, dt, op, salt=r + 1) for q in range(n)]
                    want = reference(blocks_r, op, dt)
                    for in_place in (False, True):
                        what = f"reduce_scatter {dt} {op} count={count} in_place={in_place}"
                        x = mine.copy()
                        out = x[r * count : (r + 1) * count] if in_place else np.zeros(count, dt)
                        self.comm.reduce_scatter(x, out, op=op, algorithm=self.algorithm)
                        check_close(out, want, dt, n, what, op)
                        self.checks += 1
                    if self.mpi_ok(dt, op) and count:
                        ref = np.empty(count, dt)
                        self.mpi.Reduce_scatter_block(mine, ref, op=MPI_OPS[op])
                        check_close(
                            out,
                            ref.astype(np.float64) if is_float(dt) else ref,
                            dt,
                            n,
                            f"reduce_scatter vs MPI {dt} {op} {count}",
                            op,
                        )

    def all_gather(self, staging):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts(staging):
                inputs = [make_input(q, count, dt, "sum") for q in range(n)]
                want = np.concatenate(inputs) if count else np.zeros(0, dt)
                for in_place in (False, True):
                    what = f"all_gather {dt} count={count} in_place={in_place}"
                    out = np.zeros(n * count, dt)
                    if in_place:
                        x = out[r * count : (r + 1) * count]
                        x[...] = inputs[r]
                    else:
                        x = inputs[r].copy()
                    self.comm.all_gather(x, out, algorithm=self.algorithm)
                    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), what
                    self.checks += 1
                if count and dt.kind in "iuf" and dt.itemsize != 2:
                    ref = np.empty(n * count, dt)
                    self.mpi.Allgather(inputs[r], ref)
                    assert np.array_equal(out, ref), f"all_gather vs MPI {dt} {count}"

    def broadcast(self, staging):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for count in self.counts(staging):
                inputs = [make_input(q, count, dt, "sum") for q in range(n)]
                for root in range(n):
                    what = f"broadcast {dt} count={count} root={root}"
                    x = inputs[r].copy()
                    self.comm.broadcast(x, root=root, algorithm=self.algorithm)
                    assert np.array_equal(x.view(np.uint8), inputs[root].view(np.uint8)), what
                    self.checks += 1
                    if count and dt.kind in "iuf" and dt.itemsize != 2:
                        ref = inputs[r].copy()
                        self.mpi.Bcast(ref, root=root)
                        assert np.array_equal(x, ref), f"broadcast vs MPI: {what}"

    def reduce(self, staging):
        r, n = self.rank, self.size
        for dt in DTYPES:
            for op in OPS:
                if not valid(dt, op):
                    continue
                for count in self.counts(staging):
                    inputs = [make_input(q, count, dt, op) for q in range(n)]
                    want = reference(inputs, op, dt)
                    # Every root for short vectors; for the long one the first, a middle and
                    # the last (the one MPI checks): each root's schedule is the same code.
                    roots = range(n) if count < 100_000 else sorted({0, n // 2, n - 1})
                    sentinel = make_input(r + 100, count, dt, op)
                    for root in roots:
                        for in_place in (False, True):
                            what = f"reduce {dt} {op} count={count} root={root} in_place={in_place}"
                            x = inputs[r].copy()
                            out = None if in_place else sentinel.copy()
                            res = self.comm.reduce(
                                x, out, root=root, op=op, algorithm=self.algorithm
                            )
                            if r == root:
                                check_close(res, want, dt, n, what, op)
                            elif in_place:
                                assert np.array_equal(x, inputs[r]), f"{what}: non-root x changed"
                            else:
                                assert np.array_equal(out, sentinel), (
                                    f"{what}: non-root out written"
                                )
                            if not in_place:
                                assert np.array_equal(x, inputs[r]), f"{what}: x modified"
                            self.checks += 1
                        if self.mpi_ok(dt, op) and count and root == n - 1:
                            ref = np.empty_like(inputs[r])
                            self.mpi.Reduce(inputs[r], ref, op=MPI_OPS[op], root=root)
                            if r == root:
                                check_close(
                                    res,
                                    ref.astype(np.float64) if is_float(dt) else ref,
                                    dt,
                                    n,
                                    f"reduce vs MPI {dt} {op} {count}",
                                    op,
                                )


TREE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")


def main():
    collective = sys.argv[1]
    staging = sys.argv[2] if len(sys.argv) > 2 else "default"
    algos = (sys.argv[3] if len(sys.argv) > 3 else "ring,tree,direct,auto").split(",")
    algos = [a for a in algos if a != "tree" or collective in TREE_COLLECTIVES]
    kwargs = {"staging_bytes": 256, "staging_slots": 2} if staging == "small" else {}
    mpi = MPI.COMM_WORLD
    with pc.Communicator(mpi, **kwargs) as comm:
        for algo in algos:
            checker = Checker(comm, mpi, None if algo == "auto" else algo)
            getattr(checker, collective)(staging)
            comm.barrier()
            if comm.rank == 0:
                print(
                    f"PASS {collective} {algo} ranks={comm.size} staging={staging} "
                    f"checks={checker.checks}"
                )


if __name__ == "__main__":
    run_main(main)
