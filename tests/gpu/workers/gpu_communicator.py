"""pc.Communicator with GPU arrays: cupy and torch arrays take the CUDA transport, numpy the
host path, on one communicator; streams, async work, DataParallel on cupy parameters.

Usage: mpiexec -n N python gpu_communicator.py
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from checks import run_main
from gpu_common import use_local_device
from mpi4py import MPI

import pycollectives as pc


def check_collectives(comm):
    r, n = comm.rank, comm.size
    x = cp.arange(1000, dtype=cp.float32) * (r + 1)
    comm.all_reduce(x)
    want = np.arange(1000, dtype=np.float32) * (n * (n + 1) // 2)
    assert np.array_equal(cp.asnumpy(x), want)
    h = np.full(3, r, np.int64)  # the host path, interleaved
    comm.all_reduce(h)
    assert (h == n * (n - 1) // 2).all()
    out = cp.empty(n * 5, cp.int32)
    comm.all_gather(cp.full(5, r, cp.int32), out)
    assert np.array_equal(cp.asnumpy(out), np.repeat(np.arange(n), 5))
    part = cp.empty(4, cp.float64)
    comm.reduce_scatter(cp.ones(4 * n, cp.float64), part, op=pc.AVG)
    assert np.array_equal(cp.asnumpy(part), np.ones(4))
    b = cp.full(7, r, cp.int8)
    comm.broadcast(b, root=n - 1)
    assert (cp.asnumpy(b) == n - 1).all()
    y = cp.full(9, r + 1, cp.float32)
    comm.reduce(y, root=0, op="max")
    if r == 0:
        assert (cp.asnumpy(y) == n).all()
    # Bad input is refused before anything moves; the communicator stays usable.
    try:
        comm.all_reduce(x, out=cp.empty(3, cp.float32))
    except ValueError as e:
        assert "elements" in str(e), e
    else:
        raise AssertionError("a wrong-sized out was accepted")
    try:
        comm.all_reduce(np.zeros(4, np.float32), out=cp.zeros(4, cp.float32))
    except TypeError as e:
        assert "host memory" in str(e), e
    else:
        raise AssertionError("a host x with a GPU out was accepted")


def check_streams_and_async(comm):
    n = comm.size
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(1 << 20, cp.float32)
    with s:
        x.fill(comm.rank + 1)  # queued right before the collective, on the same stream
    comm.all_reduce(x, stream=s)
    s.synchronize()
    assert float(x[-1]) == n * (n + 1) // 2
    works = [comm.all_reduce(cp.full(4096, i, cp.float64), async_op=True) for i in range(4)]
    assert all(isinstance(w, pc.Work) for w in works)
    for i, w in enumerate(works):
        assert float(w.result()[0]) == i * n
    seq = comm.seq
    comm.barrier()
    assert comm.seq > seq


def check_data_parallel(comm):
    rng = np.random.default_rng(comm.rank)
    params = [cp.asarray(rng.normal(size=(8, 4)).astype(np.float32)), cp.zeros(4, cp.float32)]
    dp = pc.DataParallel(comm, params, first_bucket_mb=1e-4, bucket_cap_mb=1e-4)
    first = comm_gather(comm, params[0])
    assert all(np.array_equal(first[0], p) for p in first), "broadcast of parameters"
    for step in range(3):
        g = dp.grads
        g[1][...] = comm.rank + step
        dp.mark_ready(1)
        g[0][...] = 2.0 * comm.rank
        dp.mark_ready(0)
        dp.synchronize()
        g = dp.grads
        assert float(g[1][0]) == (comm.size - 1) / 2 + step, float(g[1][0])
        assert float(g[0][3, 3]) == comm.size - 1, float(g[0][3, 3])


def check_send_recv(comm):
    """GPU send/recv (staged through host memory) against the values sent, every size class."""
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    for count in (0, 1, 1000, 70_000, 1 << 20):
        x = cp.arange(count, dtype=cp.float32) + r
        out = cp.full(count, -1, cp.float32)
        comm.batch_p2p([pc.P2POp("send", x, nxt, tag=3), pc.P2POp("recv", out, prv, tag=3)])
        cp.cuda.get_current_stream().synchronize()
        assert np.array_equal(cp.asnumpy(out), np.arange(count, dtype=np.float32) + prv), count
    # Asynchronous, tags received in the other order, on a stream of our own.
    s = cp.cuda.Stream(non_blocking=True)
    a, b = cp.full(5000, r, cp.int64), cp.full(3, r + 10, cp.int64)
    got_a, got_b = cp.zeros(5000, cp.int64), cp.zeros(3, cp.int64)
    sends = comm.batch_p2p([pc.P2POp("send", a, nxt, 1), pc.P2POp("send", b, nxt, 2)], True, s)
    w2 = comm.recv(got_b, prv, tag=2, async_op=True, stream=s)
    w1 = comm.recv(got_a, prv, tag=1, async_op=True, stream=s)
    for w in (w2, w1, sends):
        w.wait()
    s.synchronize()
    assert (cp.asnumpy(got_a) == prv).all() and (cp.asnumpy(got_b) == prv + 10).all()
    try:  # a size mismatch raises on both ends
        if r == 0:
            comm.send(cp.zeros(10, cp.float32), 1, tag=9)
        elif r == 1:
            comm.recv(cp.zeros(12, cp.float32), 0, tag=9)
    except pc.CollectiveMismatch:
        pass
    else:
        assert r > 1, "a mismatched GPU send/recv went through"


def comm_gather(comm, a):
    return MPI.COMM_WORLD.allgather(cp.asnumpy(a))


def main():
    use_local_device()
    with pc.Communicator(timeout=60) as comm:
        check_collectives(comm)
        check_streams_and_async(comm)
        check_data_parallel(comm)
        check_send_recv(comm)
        print(f"communicator rank={comm.rank}")


if __name__ == "__main__":
    run_main(main)
