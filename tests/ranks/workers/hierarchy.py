"""Communicators over several (emulated) nodes: topology, errors, asynchronous calls.

Usage: PYCOLL_RANKS_PER_NODE=k mpiexec -n N python hierarchy.py topology|uneven|mismatch|skip|async
"""

from __future__ import annotations

import sys
import time

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc


def topology():
    with pc.Communicator() as comm:
        k = int(sys.argv[2])
        n = comm.size
        want = [list(range(i, min(i + k, n))) for i in range(0, n, k)]
        assert comm.topology.nodes == want, (comm.topology.nodes, want)
        assert comm.algorithm_for("all_reduce", 1 << 20) == "hierarchical"
        if comm.rank == 0:
            print(f"topology {comm.topology.describe()}")


def uneven():
    try:
        pc.Communicator()
    except ValueError as e:
        msg = str(e)
        assert "same number of ranks on every node" in msg and "2, 1" in msg, msg
        print(f"uneven rank {MPI.COMM_WORLD.rank}")
    else:
        raise AssertionError("nodes of 2 and 1 ranks were accepted")


def mismatch():
    """Node 1 runs the all-reduce with a different count, then (a fresh communicator) with a
    different dtype of the same size in bytes: ranks get CollectiveMismatch (those that
    receive a mismatched message) or another CollectiveError (their peers), never a hang or a
    wrong result."""
    seen = []
    for differs in ("count", "dtype"):
        comm = pc.Communicator(timeout=5.0)
        node = comm.topology.node_of[comm.rank]
        if differs == "count":
            x = np.ones(1000 if node == 0 else 1002, np.float32)
        else:  # as many bytes, read as another type: only the fingerprint tells them apart
            x = np.ones(1000, np.float32 if node == 0 else np.int32)
        t0 = time.monotonic()
        kind = "none"
        try:
            comm.all_reduce(x)
        except pc.CollectiveMismatch as e:
            kind = "mismatch"
            assert "different collective" in str(e), str(e)
        except pc.CollectiveError:
            kind = "error"
        assert time.monotonic() - t0 < 15
        kinds = MPI.COMM_WORLD.allgather(kind)
        assert "none" not in kinds, (differs, kinds)
        assert "mismatch" in kinds, (differs, kinds)
        try:
            comm.all_reduce(x)
        except pc.CollectiveError as e:
            assert "earlier error" in str(e), str(e)
        else:
            raise AssertionError("poisoned communicator accepted a call")
        comm.close()
        seen.append(f"{differs}: {kinds}")
    if MPI.COMM_WORLD.rank == 0:
        print(f"mismatch {'; '.join(seen)}")


def skip():
    """The last node never calls the second all-reduce: every other rank times out in bounded
    time, naming a rank of that node or the collective."""
    comm = pc.Communicator(timeout=2.0)
    x = np.ones(4096, np.float64)
    comm.all_reduce(x)
    last = comm.topology.num_nodes - 1
    if comm.topology.node_of[comm.rank] != last:
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
        except pc.CollectiveError as e:
            took = time.monotonic() - t0
            assert "all_reduce" in str(e), str(e)
            assert took < 10, took
        else:
            raise AssertionError("no timeout")
    MPI.COMM_WORLD.Barrier()
    if comm.rank == 0:
        print("skip")


def asynchronous():
    with pc.Communicator() as comm:
        r, n = comm.rank, comm.size
        xs = [np.full(50_000 + i, r + i, np.float64) for i in range(6)]
        works = [comm.all_reduce(x, op="sum", async_op=True) for x in xs]
        gathered = np.empty(n * 3, np.int64)
        comm.all_gather(np.full(3, r, np.int64), gathered)  # blocking: runs after them
        for i, (w, x) in enumerate(zip(works, xs)):
            assert w.wait(timeout=60)
            assert w.is_completed()
            assert np.all(x == sum(q + i for q in range(n))), i
        assert np.array_equal(gathered, np.repeat(np.arange(n), 3))
        assert comm.barrier(async_op=True).wait()
        assert comm.seq == 8, comm.seq
        if r == 0:
            print("async")


def main():
    {
        "topology": topology,
        "uneven": uneven,
        "mismatch": mismatch,
        "skip": skip,
        "async": asynchronous,
    }[sys.argv[1]]()


if __name__ == "__main__":
    run_main(main)
