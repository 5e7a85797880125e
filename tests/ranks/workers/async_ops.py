"""Asynchronous collectives: many in flight, waited in reverse order; blocking calls queue
behind them; the GIL is released while a collective waits."""

from __future__ import annotations

import threading
import time

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc


def many_in_flight(comm: pc.Communicator):
    r, n = comm.rank, comm.size
    works, arrays = [], []
    for i in range(32):
        algo = (None, "ring", "tree", "direct")[i % 4]
        count = 1 + 37 * i
        x = np.full(count, r + i, np.float64)
        arrays.append((i, x))
        works.append(comm.all_reduce(x, op=pc.SUM, algorithm=algo, async_op=True))
    # A few other collectives in between, also asynchronous.
    g = np.empty(3 * n, np.int32)
    wg = comm.all_gather(np.full(3, r, np.int32), g, async_op=True)
    b = np.full(5, r, np.int64)
    wb = comm.broadcast(b, root=n - 1, async_op=True)
    for w in reversed(works):
        assert w.wait() is True
        assert w.is_completed()
    for i, x in arrays:
        want = sum(q + i for q in range(n))
        assert np.all(x == want), (i, x[:3], want)
    wg.wait(timeout=30)
    assert np.array_equal(g, np.repeat(np.arange(n, dtype=np.int32), 3))
    wb.wait()
    assert np.all(b == n - 1)
    seqs = [w.seq for w in works]
    assert seqs == sorted(seqs) and len(set(seqs)) == 32


def blocking_after_async(comm: pc.Communicator):
    # A blocking call issued while asynchronous work is pending runs after it.
    r, n = comm.rank, comm.size
    x = np.full(100_000, r, np.float32)
    w = comm.all_reduce(x, async_op=True)
    y = np.full(4, 1, np.int32)
    comm.all_reduce(y)
    assert w.is_completed(), "blocking call overtook asynchronous work"
    assert np.all(x == sum(range(n))) and np.all(y == n)
    wb = comm.barrier(async_op=True)
    wb.wait()


def gil_released(comm: pc.Communicator):
    # Rank 0 enters an all-reduce that rank 1 joins 0.5 s later; meanwhile a Python thread on
    # rank 0 must keep running, which it can only do if the collective released the GIL.
    x = np.ones(16, np.float32)
    if comm.rank == 0:
        ticks = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)
        before = ticks[0]
        t0 = time.monotonic()
        comm.all_reduce(x)
        waited = time.monotonic() - t0
        stop.set()
        t.join()
        progressed = ticks[0] - before
        assert waited > 0.3, waited
        assert progressed > 50, f"thread made {progressed} steps in {waited:.2f} s"
    else:
        time.sleep(0.5)
        comm.all_reduce(x)
    assert np.all(x == comm.size)


def wait_timeout(comm: pc.Communicator):
    # Work.wait(timeout) gives up with CollectiveTimeout while the peer is late; the work still
    # completes once it arrives.
    x = np.ones(8, np.float32)
    if comm.rank == 0:
        w = comm.all_reduce(x, async_op=True)
        try:
            w.wait(timeout=0.05)
        except pc.CollectiveTimeout as e:
            assert "not complete" in str(e), str(e)
        else:
            raise AssertionError("wait(timeout) returned although the peer was late")
        MPI.COMM_WORLD.Barrier()
        w.wait()
    else:
        MPI.COMM_WORLD.Barrier()
        comm.all_reduce(x)
    assert np.all(x == comm.size)


def futures_and_errors(comm: pc.Communicator):
    # A Work's future completes with its output; a Work that ends in a mismatch raises it from
    # every wait, returns it from exception() and fails its future, on every rank.
    r, n = comm.rank, comm.size
    x = np.full(64, r, np.int64)
    fut = comm.all_reduce(x, async_op=True).get_future()
    assert fut.result(timeout=60) is x and np.all(x == sum(range(n)))
    with pc.Communicator() as bad:
        y = np.ones(65 if r == n - 1 else 64, np.float32)
        w = bad.all_reduce(y, async_op=True)
        f = w.get_future()
        try:
            w.wait(timeout=60)
        except pc.CollectiveMismatch as e:
            error = e
        else:
            raise AssertionError("a mismatched all-reduce completed")
        assert w.is_completed() and not w.is_success() and w.exception() is error
        assert f.exception(timeout=60) is error
        try:
            w.result()
        except pc.CollectiveMismatch as e:
            assert e is error
        else:
            raise AssertionError("result() of a failed Work returned")


def main():
    with pc.Communicator() as comm:
        many_in_flight(comm)
        blocking_after_async(comm)
        gil_released(comm)
        wait_timeout(comm)
        futures_and_errors(comm)
        if comm.rank == 0:
            print("async")


if __name__ == "__main__":
    run_main(main)
