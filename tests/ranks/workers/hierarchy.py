"""Communicators over several (emulated) nodes: topology, errors, asynchronous calls.

Usage: PYCOLL_RANKS_PER_NODE=k mpiexec -n N python hierarchy.py topology|skip|async
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


def skip():
    """Timeouts that tell the truth. The last rank never calls the second all-reduce: its node's
    other ranks are told it never started it; the ranks of other nodes, that it (or its node's
    rank of their column) did not reach the check across nodes. Then rank 1 stalls inside the
    check of the next all-reduce (after its node-local phase): rank 0, in the node-local phase
    after the check, is told rank 1 is still in an earlier phase of the call, not that it never
    started it. Every rank names ranks by their rank in the communicator."""
    comm = pc.Communicator(timeout=1.5)
    x = np.ones(4096, np.float64)
    comm.all_reduce(x)
    last, r = comm.size - 1, comm.rank
    node_of = comm.topology.node_of
    if r != last:
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
        except pc.CollectiveTimeout as e:
            msg, took = str(e), time.monotonic() - t0
            assert "all_reduce #2" in msg and took < 10, (msg, took)
            if node_of[r] == node_of[last]:  # its own node: it never started
                assert f"rank {last} did not arrive" in msg, msg
                assert f"never started it: {last}" in msg, msg
            else:
                assert "the check across nodes" in msg and "did not reach it" in msg, msg
                assert "never started" not in msg, msg
        else:
            raise AssertionError("no timeout")
    MPI.COMM_WORLD.Barrier()

    comm = pc.Communicator(timeout=1.5)
    comm.all_reduce(x)
    if r == 1:  # its node-local phase done, it stalls in the check across nodes
        comm._host.check = _Stalled(comm._host.check)
    try:  # rank 1, late, may yet find what the others left for it, and finish
        comm.all_reduce(x[:8])
    except pc.CollectiveError as e:
        msg = str(e)
        if r == 0:  # waits in its node's all-gather for rank 1, still in the check
            assert "all_reduce #2, in its node-local all_gather" in msg, msg
            assert "still in an earlier phase of it (waiting on another node): 1" in msg, msg
            assert "never started" not in msg, msg
    else:
        assert r == 1, f"rank {r}: no timeout"
    MPI.COMM_WORLD.Barrier()
    if r == 0:
        print("skip")


class _Stalled:
    """The check across nodes, later than the timeout."""

    def __init__(self, check):
        self.check = check

    def __getattr__(self, name):
        return getattr(self.check, name)

    def exchange_reduce(self, *args):
        time.sleep(2.0)
        return self.check.exchange_reduce(*args)


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
        "skip": skip,
        "async": asynchronous,
    }[sys.argv[1]]()


if __name__ == "__main__":
    run_main(main)
