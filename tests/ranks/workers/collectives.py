"""Every collective x dtype x op x root x count x in-place against numpy and MPI.

Usage: mpiexec -n N python collectives.py COLLECTIVE[,COLLECTIVE...] [small|default]
                                           [ALGO,ALGO,...] [--arrays LIB] [--big K]
`small` uses tiny staging slots so that even short vectors stream through many pieces.
ALGO: ring, tree, direct or auto (default: all of them that have the collective).
LIB: the array library of the collectives' arrays (harness/arrayimpl.py: numpy, torch, cupy,
torch-cuda; default numpy); inputs and references are made in numpy either way. K: the
longest count (default 1000 with small slots, 300000 with default ones).
"""

from __future__ import annotations

import os
import sys

import checks
import numpy as np
from arrayimpl import Numpy, array_lib, pop_option
from checks import (
    OPS,
    check_close,
    digest,
    is_float,
    make_input,
    reference,
    run_main,
    same_bytes,
    valid,
)
from mpi4py import MPI

import pycollectives as pc

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}


class Checker:
    """The test bodies: for each dtype, op, count (and root), the inputs and references are made
    once and every algorithm in `algorithms` is checked against them."""

    def __init__(self, comm: pc.Communicator, mpi: MPI.Comm, algorithms, lib=None, big=None):
        self.comm, self.mpi, self.big = comm, mpi, big
        self.lib = lib or Numpy()  # the arrays' library (harness/arrayimpl.py)
        self.dtypes = [dt for dt in checks.DTYPES if self.lib.supports(dt)]
        # "auto" (None): the communicator's own choice
        self.algorithms = [None if a == "auto" else a for a in algorithms]
        self.rank, self.size = comm.rank, comm.size
        self.checks = 0
        # PYCOLL_TEST_COVER=rotate: each case (dtype, op, count, root) runs one of its variants
        # (algorithm, in place or not) in turn instead of all of them. The counts, innermost,
        # are 5, prime to every collective's number of variants (2-8): every variant meets
        # every count and op, and every dtype but in all-gather (5 cases a dtype, 6 variants).
        # The configurations a matrix runs in full cover the rest.
        self.rotate = os.environ.get("PYCOLL_TEST_COVER", "full") == "rotate"
        self.case = 0

    def variants(self, in_place=(False, True)) -> list[tuple]:
        """The (algorithm, in place) pairs the next case runs."""
        every = [(a, p) for a in self.algorithms for p in in_place]
        self.case += 1
        return every if not self.rotate else [every[(self.case - 1) % len(every)]]

    def counts(self, staging: str) -> list[int]:
        n = self.size
        big = self.big or (1000 if staging == "small" else 300_000)
        return [0, 1, 7, 3 * n + 1, big]

    def reducing_cases(self, staging: str):
        """(dtype, op, count) of every reducing case: each dtype with each op it has."""
        for dt in self.dtypes:
            for op in OPS:
                if valid(dt, op):
                    for count in self.counts(staging):
                        yield dt, op, count

    def copying_cases(self, staging: str):
        """(dtype, count, case name, every rank's input) of every case of a collective that
        copies (no op): each dtype with each count. MPI's own collective is a second reference
        where mpi_copies."""
        for dt in self.dtypes:
            for count in self.counts(staging):
                inputs = [make_input(q, count, dt, "sum") for q in range(self.size)]
                yield dt, count, f"{dt} count={count}", inputs

    @staticmethod
    def mpi_copies(dt, count: int) -> bool:
        # MPI has no float16/bfloat16.
        return bool(count) and dt.kind in "iuf" and dt.itemsize != 2

    def roots(self, dt, count: int) -> list[int]:
        """The roots of a rooted case. The root decides the schedule and the dtype only the
        arithmetic, so every root runs for one integer and one float dtype (short vectors);
        the others, and long vectors, take the first, a middle and the last root."""
        n = self.size
        if count < 100_000 and dt in (np.dtype(np.int32), np.dtype(np.float32)):
            return list(range(n))
        return sorted({0, n // 2, n - 1})

    def mpi_ok(self, dt, op) -> bool:
        # MPI has no float16/bfloat16 and no avg; its own collectives are the second reference.
        return dt.kind in "iuf" and dt.itemsize >= 4 - 3 * (dt.kind != "f") and op in MPI_OPS

    def same_everywhere(self, outputs: list[tuple[str, np.ndarray]]):
        """Each output (in numpy) is the same bits on every rank: one exchange of digests for
        a case's outputs (an MPI call per output cost more than the checks themselves on 5
        ranks)."""
        mine = [digest(a) for _, a in outputs]
        for theirs in self.mpi.allgather(mine):
            for (what, _), d, e in zip(outputs, mine, theirs):
                if d != e:
                    raise AssertionError(f"{what}: results differ bitwise between ranks")

    def against_mpi(self, got, ref, dt, what, op):
        check_close(got, ref.astype(np.float64) if is_float(dt) else ref, dt, self.size, what, op)

    # -- one function per collective ----------------------------------------------------------

    def all_reduce(self, staging):
        r, n, lib = self.rank, self.size, self.lib
        for i, (dt, op, count) in enumerate(self.reducing_cases(staging)):
            # One rank, a different one for each case, compares the outputs with numpy and MPI;
            # every other rank's outputs are the same bits as its (same_everywhere). Each rank
            # checking them all did the same work n times over: most of the case's time.
            checking = i % n == r
            mine = make_input(r, count, dt, op)
            want = None
            if checking:
                want = reference([make_input(q, count, dt, op) for q in range(n)], op, dt)
            ref = None
            if self.mpi_ok(dt, op) and count:
                ref = np.empty_like(mine)
                self.mpi.Allreduce(mine, ref, op=MPI_OPS[op])
            case, outputs = f"{dt} {op} count={count}", []
            for algo, in_place in self.variants():
                what = f"all_reduce {algo or 'auto'} {case} in_place={in_place}"
                x = lib.asarray(mine)
                if in_place:
                    out = lib.numpy(self.comm.all_reduce(x, op=op, algorithm=algo))
                else:
                    out = lib.zeros(count, dt)
                    self.comm.all_reduce(x, out, op=op, algorithm=algo)
                    out = lib.numpy(out)
                    assert np.array_equal(lib.numpy(x), mine), f"{what}: x modified"
                outputs.append((what, out))
                if checking:
                    check_close(out, want, dt, n, what, op)
                    if ref is not None:
                        self.against_mpi(out, ref, dt, what + " vs MPI", op)
                self.checks += 1
            self.same_everywhere(outputs)

    def reduce_scatter(self, staging):
        r, n, lib = self.rank, self.size, self.lib
        for dt, op, count in self.reducing_cases(staging):
            # Rank q's input is n blocks, block k made on its own: this rank makes
            # its whole input and every rank's block r, not every rank's whole input.
            mine = np.concatenate([make_input(r, count, dt, op, salt=k + 1) for k in range(n)])
            blocks_r = [make_input(q, count, dt, op, salt=r + 1) for q in range(n)]
            want = reference(blocks_r, op, dt)
            case, ref = f"{dt} {op} count={count}", None
            if self.mpi_ok(dt, op) and count:
                ref = np.empty(count, dt)
                self.mpi.Reduce_scatter_block(mine, ref, op=MPI_OPS[op])
            for algo, in_place in self.variants():
                what = f"reduce_scatter {algo or 'auto'} {case} in_place={in_place}"
                x = lib.asarray(mine)
                mine_r = x[r * count : (r + 1) * count]
                out = mine_r if in_place else lib.zeros(count, dt)
                self.comm.reduce_scatter(x, out, op=op, algorithm=algo)
                out = lib.numpy(out)
                check_close(out, want, dt, n, what, op)
                if ref is not None:
                    self.against_mpi(out, ref, dt, what + " vs MPI", op)
                self.checks += 1

    def all_gather(self, staging):
        r, n, lib = self.rank, self.size, self.lib
        for dt, count, case, inputs in self.copying_cases(staging):
            want = np.concatenate(inputs) if count else np.zeros(0, dt)
            if self.mpi_copies(dt, count):
                ref = np.empty(n * count, dt)
                self.mpi.Allgather(inputs[r], ref)
                assert np.array_equal(want, ref), f"all_gather: MPI gathers {dt} otherwise"
            for algo, in_place in self.variants():
                what = f"all_gather {algo or 'auto'} {case} in_place={in_place}"
                out = lib.zeros(n * count, dt)
                if in_place:
                    x = out[r * count : (r + 1) * count]
                    x[...] = lib.asarray(inputs[r])
                else:
                    x = lib.asarray(inputs[r])
                self.comm.all_gather(x, out, algorithm=algo)
                same_bytes(lib.numpy(out), want, what)
                self.checks += 1

    def broadcast(self, staging):
        r, lib = self.rank, self.lib
        for dt, count, case, inputs in self.copying_cases(staging):
            for root in self.roots(dt, count):
                if self.mpi_copies(dt, count):
                    ref = inputs[r].copy()
                    self.mpi.Bcast(ref, root=root)
                    assert np.array_equal(ref, inputs[root]), f"MPI broadcasts {dt} otherwise"
                for algo, _ in self.variants(in_place=(None,)):
                    what = f"broadcast {algo or 'auto'} {case} root={root}"
                    x = lib.asarray(inputs[r])
                    self.comm.broadcast(x, root=root, algorithm=algo)
                    same_bytes(lib.numpy(x), inputs[root], what)
                    self.checks += 1

    def reduce(self, staging):
        r, n, lib = self.rank, self.size, self.lib
        for dt, op, count in self.reducing_cases(staging):
            inputs = [make_input(q, count, dt, op) for q in range(n)]
            want = reference(inputs, op, dt)
            sentinel = make_input(r + 100, count, dt, op)
            case = f"{dt} {op} count={count}"
            for root in self.roots(dt, count):
                ref = None
                if self.mpi_ok(dt, op) and count and root == n - 1:
                    ref = np.empty_like(inputs[r])
                    self.mpi.Reduce(inputs[r], ref, op=MPI_OPS[op], root=root)
                for algo, in_place in self.variants():
                    what = f"reduce {algo or 'auto'} {case} root={root} in_place={in_place}"
                    x = lib.asarray(inputs[r])
                    out = None if in_place else lib.asarray(sentinel)
                    res = self.comm.reduce(x, out, root=root, op=op, algorithm=algo)
                    if r == root:
                        res = lib.numpy(res)
                        check_close(res, want, dt, n, what, op)
                        if ref is not None:
                            self.against_mpi(res, ref, dt, what + " vs MPI", op)
                    elif in_place:
                        same_bytes(lib.numpy(x), inputs[r], f"{what}: non-root x")
                    else:
                        same_bytes(lib.numpy(out), sentinel, f"{what}: non-root out")
                    if not in_place:
                        same_bytes(lib.numpy(x), inputs[r], f"{what}: x (an input)")
                    self.checks += 1


TREE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")


def algorithms(collective: str, names: str = "ring,tree,direct,auto") -> list[str]:
    """The algorithms named in `names` that have `collective`."""
    return [a for a in names.split(",") if a != "tree" or collective in TREE_COLLECTIVES]


def main():
    args = sys.argv[1:]
    lib = array_lib(pop_option(args, "--arrays", "numpy"))
    big = pop_option(args, "--big")
    big = None if big is None else int(big)
    collectives = args[0].split(",")
    staging = args[1] if len(args) > 1 else "default"
    kwargs = {"staging_bytes": 256, "staging_slots": 2} if staging == "small" else {}
    mpi = MPI.COMM_WORLD
    with pc.Communicator(mpi, **kwargs) as comm:
        for collective in collectives:
            algos = algorithms(collective, *args[2:3])
            checker = Checker(comm, mpi, algos, lib, big)
            getattr(checker, collective)(staging)
            comm.barrier()
            if comm.rank == 0:
                sync = f" sync={comm._cuda.sync_mode}" if comm._cuda is not None else ""
                print(
                    f"{collective} {','.join(algos)} ranks={comm.size} staging={staging} "
                    f"arrays={lib.name}{sync}: {checker.checks} checks"
                )


if __name__ == "__main__":
    run_main(main)
