"""Calls that differ across nodes: every rank raises the same CollectiveMismatch, at once.

Usage: PYCOLL_RANKS_PER_NODE=k mpiexec -n N python mismatch_nodes.py [torch]
   or: an env:// launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with PYCOLL_HOST_ID per
       rank: gloo between the nodes.

For every collective and every field it has (count, dtype, op, root, per-rank counts,
algorithm, the collective itself), the odd rank takes every position in turn (each node, its
leader or not), then one rank of every node at once, with a smaller and a larger value where
the field has an order. Each case runs on a fresh communicator split from the world (a mismatch
leaves it unusable) and asserts, on every rank: CollectiveMismatch within a second, the same
message on every rank naming the odd ranks and the field, the arrays untouched, and the
communicator unusable after. With "torch", the same through torch.distributed's calls on the
"pycollectives" backend (a subset). With PYCOLL_TEST_ROTATE set, each case puts the odd rank in
one position, the next case in the next.
Prints "mismatch_nodes cases=N" from rank 0.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from checks import run_main

import pycollectives as pc

F32, F64, I32 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)


class Case:
    """One disagreement: `call(comm, odd)` makes the arrays and returns (fn, arrays); `field` is
    what the message must name."""

    def __init__(self, name, field, call):
        self.name, self.field, self.call = name, field, call


def _cases(n):
    m = 6  # elements per rank (block size); with 2 or 3 ranks per node, 5 and 6 pad alike

    def ar(count=m, dtype=F32, op="sum", algorithm=None):
        def call(comm, odd):
            x = np.arange(count, dtype=dtype) + comm.rank
            return (lambda: comm.all_reduce(x, op=op, algorithm=algorithm)), [x]

        return call

    def rs(block=m, dtype=F32, op="sum", counts=None):
        def call(comm, odd):
            size = sum(counts) if counts else block * n
            x = np.ones(size, dtype)
            out = np.full(counts[comm.rank] if counts else block, 7, dtype)
            return (lambda: comm.reduce_scatter(x, out, op=op, counts=counts)), [x, out]

        return call

    def ag(block=m, dtype=F32, counts=None):
        def call(comm, odd):
            x = np.ones(counts[comm.rank] if counts else block, dtype)
            out = np.full(sum(counts) if counts else block * n, 7, dtype)
            return (lambda: comm.all_gather(x, out, counts=counts)), [x, out]

        return call

    def bc(count=m, dtype=F32, root=0):
        def call(comm, odd):
            x = np.full(count, comm.rank, dtype)
            return (lambda: comm.broadcast(x, root=root)), [x]

        return call

    def red(count=m, dtype=F32, op="sum", root=0):
        def call(comm, odd):
            x, out = np.ones(count, dtype), np.full(count, 7, dtype)
            return (lambda: comm.reduce(x, out, root=root, op=op)), [x, out]

        return call

    def barrier():
        def call(comm, odd):
            return (lambda: comm.barrier()), []

        return call

    def gather(count=m, root=0):
        def call(comm, odd):
            x = np.ones(count, F32)
            out = np.full(count * n, 7, F32) if comm.rank == root else None
            return (lambda: comm.gather(x, out, root=root)), [x] + (
                [out] if out is not None else []
            )

        return call

    def scatter(count=m, root=0):
        def call(comm, odd):
            x = np.ones(count * n, F32) if comm.rank == root else None
            out = np.full(count, 7, F32)
            return (lambda: comm.scatter(x, out, root=root)), [out] + ([x] if x is not None else [])

        return call

    def a2a(block=m):
        def call(comm, odd):
            x, out = np.ones(block * n, F32), np.full(block * n, 7, F32)
            return (lambda: comm.all_to_all(x, out)), [x, out]

        return call

    even = [m] * n
    uneven = [m + 1] + [m] * (n - 2) + [m - 1]
    # (collective, field, the usual call, the odd rank's calls)
    table = [
        ("all_reduce", "count", ar(), [ar(m - 1), ar(m + 1)]),
        ("all_reduce", "dtype", ar(), [ar(dtype=I32), ar(dtype=F64)]),
        ("all_reduce", "op", ar(), [ar(op="max")]),
        ("all_reduce", "algorithm", ar(), [ar(algorithm="ring")]),
        ("all_reduce", "collective", ar(), [ag(), barrier()]),
        ("reduce_scatter", "count", rs(), [rs(m - 1), rs(m + 1)]),
        ("reduce_scatter", "dtype", rs(), [rs(dtype=I32)]),
        ("reduce_scatter", "op", rs(), [rs(op="max")]),
        ("reduce_scatter", "counts", rs(counts=even), [rs(counts=uneven)]),
        ("all_gather", "count", ag(), [ag(m - 1), ag(m + 1)]),
        ("all_gather", "dtype", ag(), [ag(dtype=I32)]),
        ("all_gather", "counts", ag(counts=even), [ag(counts=uneven)]),
        ("broadcast", "count", bc(), [bc(m - 1), bc(m + 1)]),
        ("broadcast", "dtype", bc(), [bc(dtype=F64)]),
        ("broadcast", "root", bc(), [bc(root=1), bc(root=n - 1)]),
        ("reduce", "count", red(), [red(m - 1), red(m + 1)]),
        ("reduce", "op", red(), [red(op="max")]),
        ("reduce", "root", red(), [red(root=n - 1)]),
        ("barrier", "collective", barrier(), [bc()]),
        ("gather", "count", gather(), [gather(m + 1)]),
        ("gather", "root", gather(), [gather(root=n - 1)]),
        ("scatter", "count", scatter(), [scatter(m - 1)]),
        ("scatter", "root", scatter(), [scatter(root=1)]),
        ("all_to_all", "count", a2a(), [a2a(m + 1)]),
    ]
    for collective, field, usual, odd_calls in table:
        for i, odd_call in enumerate(odd_calls):
            yield Case(f"{collective}/{field}/{i}", field, (usual, odd_call))


def _torch_cases(n):
    import torch
    import torch.distributed as dist

    def t(count, dtype=torch.float32):
        return torch.ones(count, dtype=dtype)

    def ar(count=6, dtype=torch.float32, op=None):
        def call(group, rank):
            x = t(count, dtype)
            o = dist.ReduceOp.SUM if op is None else op
            return (lambda: dist.all_reduce(x, op=o, group=group)), [x]

        return call

    def bc(count=6, src=0):
        def call(group, rank):
            x = t(count)
            return (lambda: dist.broadcast(x, src=src, group=group)), [x]

        return call

    def ag(count=6):
        def call(group, rank):
            x, out = t(count), torch.full((count * n,), 7.0)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return (lambda: gather(out, x, group=group)), [x, out]

        return call

    table = [
        ("all_reduce", "count", ar(), [ar(5), ar(7)]),
        ("all_reduce", "dtype", ar(), [ar(dtype=torch.float64)]),
        ("all_reduce", "op", ar(), [ar(op=dist.ReduceOp.MAX)]),
        ("broadcast", "root", bc(), [bc(src=n - 1)]),
        ("all_gather", "count", ag(), [ag(5)]),
        ("all_reduce", "collective", ar(), [ag()]),
    ]
    for collective, field, usual, odd_calls in table:
        for i, odd_call in enumerate(odd_calls):
            yield Case(f"torch {collective}/{field}/{i}", field, (usual, odd_call))


def _outcome(fn, arrays, timeout):
    """(kind, message, seconds, whether the arrays were left as they were)."""
    before = [np.array(a, copy=True) for a in arrays]
    t0 = time.monotonic()
    try:
        fn()
        kind, msg = "returned", ""
    except pc.CollectiveMismatch as e:
        kind, msg = "mismatch", str(e)
    except pc.CollectiveError as e:
        kind, msg = type(e).__name__, str(e)
    took = time.monotonic() - t0
    untouched = all(np.array_equal(np.asarray(a), b) for a, b in zip(arrays, before))
    return kind, msg, took, untouched


def _judge(world, case, odd_rank, result):
    """Every rank's result of one case, as every rank sees them: the first failure, or None."""
    every = world.all_gather_object(result)
    for r, (kind, msg, took, untouched) in enumerate(every):
        where = f"{case.name}, odd rank {odd_rank}: rank {r}"
        if kind != "mismatch":
            return f"{where}: {kind} ({msg[:300]})"
        if took > 1.0:
            return f"{where}: CollectiveMismatch after {took:.2f} s"
        if not untouched:
            return f"{where}: the arrays were written"
        if msg != every[0][1]:
            return f"{where}: message differs from rank 0's: {msg!r} vs {every[0][1]!r}"
        odd = sorted(odd_rank)
        who = f"rank {odd[0]} " if len(odd) == 1 else "ranks " + ", ".join(map(str, odd)) + " "
        if case.field not in msg or who not in msg:
            return f"{where}: the message names neither the field nor {who.strip()}: {msg}"
    return None


def _positions(world, index):
    """The odd ranks for case #`index`: every rank alone in turn, then every column (the ranks
    with one local rank, one per node: every node then has the same disagreement, and the same
    status; a node without that local rank gives its last); with PYCOLL_TEST_ROTATE set (over
    gloo, where a communicator costs 50-100 ms to make and close), one per case, the cases
    taking every position in turn."""
    nodes = world.topology.nodes
    every = [(r,) for r in range(world.size)]
    widest = max(len(node) for node in nodes)  # nodes of different sizes: their last rank
    every += [tuple(node[min(j, len(node) - 1)] for node in nodes) for j in range(widest)]
    if os.environ.get("PYCOLL_TEST_ROTATE"):
        return [every[index % len(every)]]
    return every


def run_numpy(world):
    count = 0
    for index, case in enumerate(_cases(world.size)):
        usual, odd_call = case.call
        for odd_rank in _positions(world, index):
            comm = world.split(0, timeout=10)
            fn, arrays = (odd_call if comm.rank in odd_rank else usual)(comm, odd_rank)
            result = _outcome(fn, arrays, 10)
            unusable = False
            try:
                comm.all_reduce(np.ones(2, np.float32))
            except pc.CollectiveError as e:
                unusable = "earlier error" in str(e) or "unusable" in str(e)
            comm.close()
            failure = _judge(world, case, odd_rank, result)
            assert failure is None, failure
            assert unusable, f"{case.name}: a communicator that saw a mismatch kept working"
            count += 1
    return count


def run_torch(world):
    import torch.distributed as dist

    import pycollectives.torch as pct

    pct.init_process_group(timeout=30)  # under mpiexec too
    count = 0
    try:
        for index, case in enumerate(_torch_cases(world.size)):
            usual, odd_call = case.call
            for odd_rank in _positions(world, index):
                group = dist.new_group(backend="pycollectives")
                fn, arrays = (odd_call if world.rank in odd_rank else usual)(group, odd_rank)
                result = _outcome(fn, arrays, 10)
                failure = _judge(world, case, odd_rank, result)
                dist.destroy_process_group(group)
                assert failure is None, failure
                count += 1
    finally:
        dist.destroy_process_group()
    return count


def main():
    with pc.Communicator(timeout=30) as world:
        assert world.topology.num_nodes > 1, world.topology.describe()
        t0 = time.monotonic()
        count = run_torch(world) if sys.argv[1:] == ["torch"] else run_numpy(world)
        if world.rank == 0:
            print(f"mismatch_nodes cases={count} in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    run_main(main)
