"""How the benchmarks time a call: ranks start together after a barrier, and the slowest
rank's time counts (the same figure on every rank). Every benchmark in benchmarks/ and the
GPU benchmark's floors time through these."""

from __future__ import annotations

import time

import numpy as np


def max_over_ranks(mpi, seconds: float) -> float:
    """The largest of every rank's `seconds` (collective over `mpi`)."""
    from mpi4py import MPI

    return mpi.allreduce(float(seconds), op=MPI.MAX)


def _nothing():
    pass


def per_call(mpi, fn, calls: int, sync=None, warmup: int = 0) -> float:
    """Seconds per call of `calls` calls of `fn` back to back from a barrier, waited for once
    at the end (`sync`, for work queued on a device), the slowest rank's; after `warmup`
    untimed calls."""
    sync = sync or _nothing
    for _ in range(warmup):
        fn()
    sync()
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return max_over_ranks(mpi, (time.perf_counter() - t0) / calls)


def best_per_call(mpi, fns, calls: int, rounds: int, warmup: int, check=None) -> list:
    """Each of `fns`' best seconds per call (per_call) over `rounds` rounds in which they
    alternate, after `warmup` untimed calls of each (page faults, caches); where `check` is
    given, check() follows each function's untimed calls (that they wrote what they should)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
        if check is not None:
            check()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], per_call(mpi, fn, calls))
    return best


def calls_for(mpi, fn, sync, budget_s: float, most: int, least: int = 3) -> int:
    """How many calls of `fn` fit in `budget_s`, between `least` and `most`, from one
    synchronised call timed on every rank (the slowest counts: the same on every rank)."""
    return max(least, min(most, int(budget_s / max(per_call(mpi, fn, 1, sync), 1e-9))))


def time_synchronised(mpi, fn, sync, iters: int) -> float:
    """Seconds per call when the caller waits for each: ranks start together, each call is
    followed by `sync`; the slowest rank's median over `iters` calls."""
    samples = []
    for _ in range(iters):
        mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return max_over_ranks(mpi, float(np.median(samples)))


def time_back_to_back(mpi, fn, sync, calls: int, reps: int = 3) -> float:
    """Seconds per call when `calls` calls are queued one after another and waited for once:
    each repetition's slowest rank, the median over `reps` repetitions."""
    return float(np.median([per_call(mpi, fn, calls, sync) for _ in range(reps)]))
