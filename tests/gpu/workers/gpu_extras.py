"""Streams, async work and torch tensors on the CUDA transport.

Usage: mpiexec -n N python gpu_extras.py
    stream|streams|async|torch|mismatch|graph|ll|registered|one_rank|free_while_waiting|shapes|
    event_probe|first_use|reproducible
streams reads PYCOLL_TEST_CALLS (30: calls) and PYCOLL_TEST_LATE_MS (0: rank k % N sleeps this
long before call k).
"""

from __future__ import annotations

import os
import sys
import time

import cupy as cp
import numpy as np
from checks import digest, expect, run_main
from gpu_common import use_local_device
from mpi4py import MPI

from pycollectives.backends.cuda import CudaComm
from pycollectives.errors import CollectiveError, CollectiveMismatch

SUM = 0


def check_stream(comm: CudaComm):
    # A kernel queued on a stream right before the collective is seen by it.
    n = comm.size
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(1 << 20, cp.float32)
    for it in range(5):
        with s:
            x.fill(comm.rank + it)
        comm.all_reduce(x, None, SUM, stream=s)
        with s:
            x *= 2  # queued after the collective on the same stream: sees its result
        s.synchronize()
        want = 2 * sum(r + it for r in range(n))
        assert float(x[0]) == want and float(x[-1]) == want, (it, float(x[0]), want)
    # The array library's current stream is used when none is given.
    with s:
        x.fill(1)
        comm.all_reduce(x, None, SUM)
        got = float(x.sum())
    assert got == n * x.size, got
    print(f"stream rank={comm.rank}")


def check_streams(comm: CudaComm):
    """Blocking calls on three streams in turn, and now and then an async one: in kernel mode
    a blocking call is one launch on its caller's stream, and one queued on another stream
    than the call before waits for that call's end (an event the host queued), so the calls
    still run one at a time, in issue order. Sizes of one block and of several; every result checked
    after the streams are synchronised."""
    r, n = comm.rank, comm.size
    calls = int(os.environ.get("PYCOLL_TEST_CALLS", "30"))
    late = float(os.environ.get("PYCOLL_TEST_LATE_MS", "0")) / 1000
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    pending = []
    for k in range(calls):
        s = streams[(k * 7 + k // 3) % 3]
        count = (1, 5000, 1 << 20)[k % 3]
        with s:
            x = cp.full(count, r + k, cp.float32)
        if late and k % n == r:
            time.sleep(late)
        if k % 5 == 4:
            comm.all_reduce(x, None, SUM, stream=s, async_op=True).wait()
        else:
            comm.all_reduce(x, None, SUM, stream=s)
        pending.append((k, x))
    for s in streams:
        s.synchronize()
    for k, x in pending:
        want = sum(q + k for q in range(n))
        assert float(x.min()) == want == float(x.max()), (k, x.size, float(x.min()), want)
    blocks = comm.residency.blocks
    print(f"streams rank={r} sync={comm.sync_mode} calls={calls} blocks={blocks}")


def check_async(comm: CudaComm):
    x = cp.full(1 << 18, comm.rank + 1, cp.float64)
    out = cp.empty_like(x)
    work = comm.all_reduce(x, out, SUM, async_op=True)
    work.wait()  # later work on the current stream waits for the collective
    total = float(out.sum())
    assert total == x.size * sum(range(1, comm.size + 1)), total
    assert work.is_completed()
    bufs = [cp.full(100, comm.rank, cp.int32) for _ in range(4)]
    works = [comm.broadcast(b, 0, async_op=True) for b in bufs]
    for w in works:
        w.wait()
    cp.cuda.get_current_stream().synchronize()
    assert all(w.is_completed() for w in works)
    assert all(int(w.result()[7]) == 0 for w in works)
    print(f"async rank={comm.rank}")


def check_torch(comm: CudaComm):
    import torch

    dev = torch.device("cuda", comm.device)
    base = torch.arange(3000) % 100
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        x = (base * (comm.rank + 1)).to(dt).to(dev)
        want = sum((base * (r + 1)).to(dt).double() for r in range(comm.size))
        comm.all_reduce(x, None, SUM)
        got = x.double().cpu().numpy()
        tol = 0.02 if dt in (torch.bfloat16, torch.float16) else 1e-6
        assert np.allclose(got, want.numpy(), rtol=tol, atol=tol), dt
        digests = MPI.COMM_WORLD.allgather(x.cpu().view(torch.uint8).numpy().tobytes())
        assert len(set(digests)) == 1, f"{dt}: ranks differ"
    # A non-default torch stream, given explicitly.
    s = torch.cuda.Stream(device=dev)
    y = torch.empty(1 << 16, device=dev)
    with torch.cuda.stream(s):
        y.fill_(comm.rank)
    comm.all_reduce(y, None, SUM, stream=s)
    s.synchronize()
    assert float(y[0]) == sum(range(comm.size))
    print(f"torch rank={comm.rank}")


def check_mismatch(comm: CudaComm):
    """Ranks that disagree: CollectiveMismatch on every rank, naming what differs. Stepped mode
    finds it on the host before any launch. Kernel mode finds it on the device, in the launch,
    and the call returns once queued: the next call on the communicator (here the barrier)
    raises it. A rank that finds it on the host (all-to-all, whose splits meet there) leaves a
    failure word in its GPU segment that stops the device wait of a peer that did not."""
    r, n = comm.rank, comm.size
    cases = {
        "count": (lambda c: c.all_reduce(cp.zeros(10 + r, cp.float32)), ["count"]),
        # A barrier against a collective is a mismatch too.
        "barrier": (
            lambda c: c.barrier() if r == 0 else c.broadcast(cp.zeros(4, cp.int32), 0),
            ["barrier", "collective"],
        ),
        "all_to_all against all_reduce": (
            lambda c: (
                c.all_to_all(cp.zeros(n, cp.int32), cp.zeros(n, cp.int32))
                if r == 0
                else c.all_reduce(cp.zeros(n, cp.int32))
            ),
            ["disagree"],
        ),
    }
    for name, (call, words) in cases.items():
        c = CudaComm(MPI.COMM_WORLD, r, n, timeout=30)
        t0 = time.monotonic()
        try:
            call(c)
            c.barrier()
        except CollectiveMismatch as e:
            assert all(w in str(e) for w in words), f"{name}: {e}"
        else:
            raise AssertionError(f"{name}: not detected on rank {r} (sync={c.sync_mode})")
        finally:
            c.close()  # poisoned: frees without a barrier
        assert time.monotonic() - t0 < 10, f"{name}: detected late"
    print(f"mismatch rank={r} sync={comm.sync_mode}")


def capture(stream, fn):
    """`fn()` captured on `stream` into a CUDA graph; the capture ended (invalidated or not)
    whatever `fn` raised."""
    stream.begin_capture()
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph


def check_graph(comm: CudaComm):
    """Collectives captured into a CUDA graph and replayed: right every time, with eager calls
    between launches; refused in stepped mode and for a shape never run before."""
    r, n = comm.rank, comm.size
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(5000, cp.float32)
    small = cp.zeros(2, cp.float32)
    if comm.sync_mode == "stepped":
        comm.all_reduce(x, None, SUM, stream=s)
        captured = lambda: comm.all_reduce(x, None, SUM, stream=s)  # noqa: E731
        expect(CollectiveError, lambda: capture(s, captured), "stepped mode")
        print(f"graph rank={r} sync=stepped refused")
        return
    never_run = lambda: comm.all_reduce(small, None, SUM, stream=s)  # noqa: E731
    expect(CollectiveError, lambda: capture(s, never_run), "once")
    for buf in (x, small):
        comm.all_reduce(buf, None, SUM, stream=s)  # the plan is built outside the capture
    out = cp.empty(4 * n, cp.int32)
    part = cp.zeros(4, cp.int32)
    comm.all_gather(part, out, stream=s)

    def body():
        comm.all_reduce(x, None, SUM, stream=s)
        comm.all_reduce(small, None, SUM, stream=s)
        comm.all_gather(part, out, stream=s)

    graph = capture(s, body)
    for k in range(5):
        with s:
            x[:] = cp.arange(x.size, dtype=cp.float32) % 7 + r + k
            small.fill(r + k)
            part.fill(10 * r + k)
        graph.launch(stream=s)
        s.synchronize()
        want = sum(np.arange(x.size) % 7 + q + k for q in range(n)).astype(np.float32)
        assert np.array_equal(cp.asnumpy(x), want), f"launch {k}: the captured all-reduce"
        assert np.all(cp.asnumpy(small) == sum(q + k for q in range(n))), f"launch {k}"
        want_g = np.repeat([10 * q + k for q in range(n)], 4).astype(np.int32)
        assert np.array_equal(cp.asnumpy(out), want_g), f"launch {k}: the captured all-gather"
        y = cp.full(333, r + 1, cp.float64)
        comm.all_reduce(y, None, SUM, stream=s)  # an eager call between launches
        s.synchronize()
        assert float(y[0]) == n * (n + 1) / 2, float(y[0])
    print(f"graph rank={r} sync=kernel replays=5")


def check_shapes(comm: CudaComm):
    """More call shapes than the plan cache holds (their steps in chunks that are freed once
    nothing is in flight: csrc/cuda/plan_arena.h), and a graph captured before them replayed
    between them on another stream than theirs, with no host wait in between: each replay
    waits for the eager launch before it, and the eager launch after it for the replay (both
    use the same per-block counters: DeviceComm::launch_kernel_mode). Every result right."""
    r, n = comm.rank, comm.size
    s, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(4099, cp.float32)
    comm.all_reduce(x, None, SUM, stream=s)  # the plan, built outside the capture
    graph = capture(s, lambda: comm.all_reduce(x, None, SUM, stream=s))
    replays = 0
    for i in range(300):
        y = cp.full(1 + i, r + 1, cp.int32)
        comm.all_reduce(y, None, SUM, stream=other)
        replay = i % 50 == 0
        if replay:
            with s:
                x.fill(r + i)
            graph.launch(stream=s)
            replays += 1
        other.synchronize()
        assert int(y[-1]) == n * (n + 1) // 2, (i, int(y[-1]))
        if replay:
            s.synchronize()
            assert float(x[-1]) == sum(q + i for q in range(n)), (i, float(x[-1]))
    print(f"shapes rank={r} sync={comm.sync_mode} shapes=300 replays={replays}")


SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
"""


def check_event_probe(comm: CudaComm):
    """How this GPU binds a stream's wait on a peer's interprocess event that the peer records
    again before the GPU reaches the wait: to the record current when the wait was queued (as
    cudaStreamWaitEvent documents within a process; stepped mode's event fences assume it), or to
    the one current when the GPU reaches it (then those fences could form a cycle; the fence
    counters are right either way). Rank 0 records its event after a short spin, rank 1 queues
    a longer spin and then the wait, rank 0 records again after a 3 s spin: rank 1's wait ends
    well before that spin if it took the first record. A measurement, bounded, reported."""
    r = comm.rank
    spin = cp.RawKernel(SPIN, "spin")
    rate_khz = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"]

    def spin_ms(stream, ms):
        spin((1,), (1,), (np.int64(ms * rate_khz),), stream=stream)

    s = cp.cuda.Stream(non_blocking=True)
    flags = cp.cuda.runtime.eventDisableTiming | cp.cuda.runtime.eventInterprocess
    mine = cp.cuda.runtime.eventCreateWithFlags(flags) if r == 0 else None
    handle = MPI.COMM_WORLD.bcast(cp.cuda.runtime.ipcGetEventHandle(mine) if r == 0 else None)
    if r == 0:
        spin_ms(s, 200)
        cp.cuda.runtime.eventRecord(mine, s.ptr)  # record 1
        MPI.COMM_WORLD.Barrier()  # rank 1 queues its wait now
        MPI.COMM_WORLD.Barrier()
        spin_ms(s, 3000)
        cp.cuda.runtime.eventRecord(mine, s.ptr)  # record 2, before rank 1's GPU reaches the wait
        s.synchronize()
        MPI.COMM_WORLD.Barrier()
        cp.cuda.runtime.eventDestroy(mine)
        print("event_probe rank=0 recorded twice")
        return
    theirs = cp.cuda.runtime.ipcOpenEventHandle(handle)
    done = cp.cuda.Event(disable_timing=True)
    MPI.COMM_WORLD.Barrier()
    start = time.monotonic()
    spin_ms(s, 300)
    cp.cuda.runtime.streamWaitEvent(s.ptr, theirs, 0)
    done.record(s)
    MPI.COMM_WORLD.Barrier()
    while not done.done:
        assert time.monotonic() - start < 30, "the wait on the peer's event never ended"
        time.sleep(0.005)
    took = time.monotonic() - start
    MPI.COMM_WORLD.Barrier()
    cp.cuda.runtime.eventDestroy(theirs)
    binds = "queued" if took < 2.0 else "reached"
    print(f"event_probe rank=1 binds={binds} (the wait ended {took:.2f} s after it was queued)")


def check_ll(comm: CudaComm):
    """Small all-reduces in the LL format (kernel mode; device/plan.h, ll_message), sizes
    around the limit in several dtypes, back to back on one stream, one rank (drawn at random,
    the same draw everywhere) queueing late: its peers' threads poll its words before they are
    written, and find the previous message's there. Checked against numpy on the host."""
    import pycollectives._cuda as cu

    r, n = comm.rank, comm.size
    assert comm.sync_mode == "kernel", comm.sync_mode
    limit = cu.LL_MAX_BYTES
    # The rule marks the smallest of these LL, and the largest not (as plan_call does).
    ll_bits = [
        f & (cu.RECV_LL | cu.SEND_LL)
        for count in (1, limit // 2)
        for _, f, *_ in cu.plan(0, 3, r, n, count, 0, 6, 1 << 20, ll_max_bytes=limit)["steps"]
    ]
    assert ll_bits == [cu.SEND_LL, cu.RECV_LL, 0, 0], ll_bits
    rng = np.random.default_rng(11)
    s = cp.cuda.Stream(non_blocking=True)
    calls = 0
    for dt in (np.float32, np.float16, np.int8, np.int64, np.float64):
        wire = 4 if dt == np.float16 else np.dtype(dt).itemsize
        edge = limit // wire
        for count in (1, 2, 7, 64, 1000, edge - 1, edge, edge + 1):
            pending = []
            for k in range(6):  # queued back to back, checked after one synchronisation
                late = int(rng.integers(n))
                host = ((np.arange(count) * 7 + k) % 5 + r).astype(dt)
                x = cp.asarray(host)
                if r == late:
                    time.sleep(float(rng.uniform(0, 0.002)))
                comm.all_reduce(x, None, SUM, stream=s)
                pending.append((x, sum(((np.arange(count) * 7 + k) % 5 + q) for q in range(n))))
                calls += 1
            s.synchronize()
            for k, (x, want) in enumerate(pending):
                got = cp.asnumpy(x).astype(np.float64)
                assert np.array_equal(got, np.asarray(want, np.float64)), (dt, count, k)
    print(f"ll rank={r} sync=kernel calls={calls}")


def check_registered(comm: CudaComm):
    """Registered buffers (comm.empty / zeros / register) and the two-shot all-reduce over them
    (kernel mode: one launch; stepped mode: between two host meetings): dtypes x ops x counts 0,
    1, < n, uneven, 4 MiB, in place and not, views at offsets, against numpy's rank-order
    reduction bit for bit and equal on every rank; reduce-scatter, all-gather, broadcast and
    reduce over them against numpy; a cupy array registered at an offset of its
    allocation; a rank that registers and one that does not raise CollectiveMismatch."""
    from pycollectives.backends.cuda.comm import CudaComm as Comm

    r, n, mpi = comm.rank, comm.size, MPI.COMM_WORLD
    c = comm._native_comm()
    rng = np.random.default_rng(38)
    big = 1 << 20
    cases = 0
    for dt in (np.float32, np.float64, np.int32, np.float16):
        acc = np.float32 if dt == np.float16 else dt
        pool_in, pool_out = comm.empty(2 * big + 64, dt), comm.zeros(big + 64, dt)
        for op, code in (("sum", 0), ("max", 3), ("avg", 4)):
            if op == "avg" and dt == np.int32:
                continue
            for count in (0, 1, n - 1, 3 * n + 1, 5000, big):
                for in_place in (False, True):
                    at = cases % 5 * 3
                    x = pool_in[at : at + count] if not in_place else pool_in[big + 64 :][:count]
                    out = x if in_place else pool_out[at : at + count]
                    inputs = [(rng.standard_normal(count) * 4).astype(dt) for _ in range(n)]
                    x[...] = cp.asarray(inputs[r])
                    before = c.twoshot_runs
                    comm.all_reduce(x, out, code)
                    cp.cuda.get_current_stream().synchronize()
                    assert c.twoshot_runs - before == (count > 0), (dt, op, count)
                    want = inputs[0].astype(acc)
                    for q in range(1, n):
                        want = np.maximum(want, inputs[q]) if op == "max" else want + inputs[q]
                    if op == "avg":
                        want = want / acc(n)
                    got = cp.asnumpy(out)
                    what = (np.dtype(dt).name, op, count, in_place, at)
                    assert np.array_equal(got.view(np.uint8), want.astype(dt).view(np.uint8)), what
                    sums = mpi.allgather(digest(got))
                    assert len(set(sums)) == 1, what
                    cases += 1
    # Reduce-scatter, all-gather, broadcast and reduce read peers' registered buffers too
    # (small integers: every order of summing them is exact).
    a, b = comm.empty(n * big, np.float32), comm.empty(n * big, np.float32)
    for count in (1, 3 * n + 1, big // 4):
        ins = [rng.integers(-8, 8, n * count).astype(np.float32) for _ in range(n)]
        before = c.twoshot_runs
        x = a[: n * count]
        x[...] = cp.asarray(ins[r])
        comm.reduce_scatter(x, b[:count], op=0)
        want = sum(i[r * count : (r + 1) * count] for i in ins)
        assert np.array_equal(cp.asnumpy(b[:count]), want), ("reduce_scatter", count)
        x = a[:count]
        x[...] = cp.asarray(ins[r][:count])
        comm.all_gather(x, b[: n * count])
        want = np.concatenate([i[:count] for i in ins])
        assert np.array_equal(cp.asnumpy(b[: n * count]), want), ("all_gather", count)
        comm.broadcast(x, root=n - 1)
        assert np.array_equal(cp.asnumpy(x), ins[n - 1][:count]), ("broadcast", count)
        x[...] = cp.asarray(ins[r][:count])
        comm.reduce(x, root=0, op=0)
        if r == 0:
            want = sum(i[:count] for i in ins)
            assert np.array_equal(cp.asnumpy(x), want), ("reduce", count)
        assert c.twoshot_runs - before == 4, ("registered calls", count)
        cases += 4
    memory = cp.zeros(1000, cp.float32)  # cupy's allocation: registered at an offset of it
    view = comm.register(memory[37:337])
    view[...] = r + 1
    comm.all_reduce(view, None, 0)
    assert float(view[0].get()) == n * (n + 1) / 2
    # Kernel mode finds it on the device (the call returns once queued, the barrier after it
    # raises), stepped mode on the host.
    fresh = Comm(mpi, r, n, timeout=10)
    mine = fresh.zeros(4096, np.float32) if r == 0 else cp.zeros(4096, cp.float32)

    def call():
        fresh.all_reduce(mine, None, 0)
        fresh.barrier()

    try:
        expect(CollectiveMismatch, call, "shared buffers")
    finally:
        fresh.close()
    print(f"registered rank={r} sync={comm.sync_mode} cases={cases} twoshot={c.twoshot_runs}")


def check_first_use(comm: CudaComm):
    """Registration on first use (PYCOLL_CUDA_REGISTER_BYTES, set by the test): all-reduces,
    reduce-scatters and all-gathers on cupy arrays from cupy's pool, at offsets that differ
    between ranks, and on torch tensors from torch's caching allocator, run zero-copy
    (first_use_runs counts them) and right (small integers: exact in any order); each
    allocation is opened once per peer however many calls run over it; below the size, the
    staged path."""
    r, n, mpi = comm.rank, comm.size, MPI.COMM_WORLD
    c = comm._native_comm()
    rng = np.random.default_rng(62)
    pool = cp.zeros(n * (1 << 20) + 64, cp.float32)  # one allocation of cupy's pool
    cases = 0
    for count in (1 << 10, 1 << 18, 1 << 20):
        ins = [rng.integers(-8, 8, n * count).astype(np.float32) for _ in range(n)]
        at = 3 * r + cases % 5  # differs between ranks
        before = c.first_use_runs
        x = pool[at : at + count]
        x[...] = cp.asarray(ins[r][:count])
        comm.all_reduce(x, None, 0)
        assert np.array_equal(cp.asnumpy(x), sum(i[:count] for i in ins)), ("all_reduce", count)
        x = pool[at : at + n * count]
        x[...] = cp.asarray(ins[r])
        out = cp.empty(count, cp.float32)
        comm.reduce_scatter(x, out, op=0)
        want = sum(i[r * count : (r + 1) * count] for i in ins)
        assert np.array_equal(cp.asnumpy(out), want), ("reduce_scatter", count)
        gathered = cp.empty(n * count, cp.float32)
        comm.all_gather(out, gathered)
        mine = mpi.allgather(cp.asnumpy(out))
        assert np.array_equal(cp.asnumpy(gathered), np.concatenate(mine)), ("all_gather", count)
        assert c.first_use_runs - before == 3, ("first-use calls", count, c.first_use_runs)
        cases += 3
    opened = c.first_use_opened
    small = cp.full(16, r + 1, cp.float32)
    before = c.first_use_runs
    comm.all_reduce(small, None, 0)
    assert c.first_use_runs == before and float(small[0].get()) == n * (n + 1) / 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.full((1 << 20,), float(r + 1), device=f"cuda:{comm.device}")
        for _ in range(3):
            before = c.first_use_runs
            comm.all_reduce(t, None, 0)
            assert c.first_use_runs - before == 1, "torch tensor"
        torch.cuda.synchronize()
        assert float(t[0]) == (n * (n + 1) / 2) * n**2, float(t[0])
        cases += 3
    cp.cuda.get_current_stream().synchronize()
    print(
        f"first_use rank={r} sync={comm.sync_mode} cases={cases} runs={c.first_use_runs} "
        f"opened={c.first_use_opened} (pool {opened})"
    )


def check_free_while_waiting(comm: CudaComm):
    """A registered array freed while a collective of this rank waits on the device for a peer
    that waits for this host: the free is put off (cudaFree would wait for that collective, and
    it for the peer: until the timeout), made once nothing is in flight."""
    import gc

    from pycollectives import _cuda

    r, mpi = comm.rank, MPI.COMM_WORLD
    x = comm.empty(1 << 20, "float32")
    x.fill(1)
    comm.all_reduce(x, None, SUM)
    cp.cuda.get_current_stream().synchronize()
    y = cp.ones(4, cp.float32)
    took = 0.0
    if r == 0:
        comm.all_reduce(y, None, SUM)  # waits on the device for rank 1
        start = time.perf_counter()
        del x
        gc.collect()
        took = time.perf_counter() - start
        put_off = _cuda.frees_deferred()
        mpi.Barrier()  # rank 1 calls only after this
    else:
        del x
        mpi.Barrier()
        comm.all_reduce(y, None, SUM)
    cp.cuda.get_current_stream().synchronize()
    assert float(y[0]) == comm.size, float(y[0])
    assert took < 1.0, f"freeing a registered array took {took:.1f} s"
    assert r != 0 or put_off >= 1, put_off
    comm.barrier()
    assert _cuda.frees_deferred() == 0, _cuda.frees_deferred()
    print(f"free_while_waiting rank={r} sync={comm.sync_mode} took={took:.3f}")


def check_one_rank(comm: CudaComm):
    """One rank in kernel mode: calls with nothing to launch (a broadcast, a count-0 call, the
    barrier) between calls that launch, on two streams; then close() at once, not after the
    timeout waiting for an end that a skipped launch never reports."""
    assert comm.size == 1, comm.size
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.arange(5, dtype=cp.float32)
    for k, s in enumerate((s1, s2, s1, s2)):
        comm.broadcast(x, 0, stream=s)
        comm.all_reduce(x[:0], None, SUM, stream=s)
        comm.all_reduce(x, None, SUM, stream=s)
        if k % 2:
            comm.barrier()
    s1.synchronize()
    s2.synchronize()
    assert (x.get() == np.arange(5)).all(), x
    start = time.perf_counter()
    comm.close()
    took = time.perf_counter() - start
    assert took < 1.0, took
    print(f"one_rank sync={comm.sync_mode} closed in {took:.3f} s")


def check_reproducible(comm: CudaComm):
    """Reproducible mode (PYCOLL_REPRODUCIBLE=1, set by the test): all-reduces and
    reduce-scatters of cupy's pool's arrays and of registered ones, LL, one-shot and staged
    sizes, every algorithm asked for, bit for bit the inputs folded in rank order (float32
    accumulation for float16), as the emulated device shows (workers/reproducible.py)."""
    n, r = comm.size, comm.rank
    cases = 0
    for dt in (np.dtype(np.float32), np.dtype(np.float16)):
        for count in (1000, 12345, 1 << 20):
            rng = np.random.default_rng([count, dt.num])
            rows = rng.standard_normal((n, n * count)) * 10.0 ** rng.integers(-3, 4, (n, n * count))
            rows = rows.astype(dt)
            acc = rows[0].astype(np.float32 if dt.itemsize == 2 else dt)
            for q in range(1, n):
                acc = acc + rows[q].astype(acc.dtype)
            want = acc.astype(dt)
            for make in (cp.empty, comm.empty):
                for algo in (None, "ring", "tree", "direct"):
                    x = make(n * count, dt)
                    x[...] = cp.asarray(rows[r])
                    comm.all_reduce(x, None, SUM, algo)
                    got = cp.asnumpy(x)
                    bad = int((got.view(f"u{dt.itemsize}") != want.view(f"u{dt.itemsize}")).sum())
                    assert bad == 0, f"all_reduce {dt} {count} {algo} {make}: {bad} differ"
                    if algo != "tree":
                        x[...] = cp.asarray(rows[r])
                        out = make(count, dt)
                        comm.reduce_scatter(x, out, SUM, algorithm=algo)
                        got = cp.asnumpy(out)
                        mine = want[r * count : (r + 1) * count]
                        bad = int(
                            (got.view(f"u{dt.itemsize}") != mine.view(f"u{dt.itemsize}")).sum()
                        )
                        assert bad == 0, f"reduce_scatter {dt} {count} {algo} {make}: {bad} differ"
                    cases += 1
    print(f"reproducible rank={r} cases={cases}", flush=True)


def main():
    what = sys.argv[1]
    use_local_device()
    timeout = float(os.environ.get("PYCOLL_TEST_TIMEOUT", "60"))
    comm = CudaComm(MPI.COMM_WORLD, MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, timeout=timeout)
    checks = {"stream": check_stream, "async": check_async, "torch": check_torch}
    checks["streams"] = check_streams
    checks["mismatch"], checks["graph"], checks["ll"] = check_mismatch, check_graph, check_ll
    checks["registered"], checks["one_rank"] = check_registered, check_one_rank
    checks["free_while_waiting"] = check_free_while_waiting
    checks["first_use"], checks["reproducible"] = check_first_use, check_reproducible
    checks["shapes"], checks["event_probe"] = check_shapes, check_event_probe
    try:
        checks[what](comm)
    finally:
        comm.close()


if __name__ == "__main__":
    run_main(main)
