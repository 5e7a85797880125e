"""The CUDA transport's device code, run on the CPU: the emulated device (see csrc/emu/).

Every rank runs the step kernel compiled for the host over shared memory laid out as the GPU
segment, in kernel mode (a thread per block, waiting on its peers' flags) or stepped mode (one
launch per step, the host waiting between launches). The test bodies are those of the host
collectives (workers/collectives.py), run through an adapter with the Communicator's API.

Usage: mpiexec -n N python emulated.py MODE COLLECTIVE [STAGING] [ALGOS] [BLOCKS]
  MODE: kernel or stepped; STAGING: small (4 KiB slots: multi-piece messages) or default (64 KiB);
  ALGOS: comma-separated (default ring,tree,direct,auto); BLOCKS: blocks per launch (default 4).
  Special COLLECTIVE values: shapes (more than 256 distinct call shapes, back to back),
  replay (collectives captured once and replayed, as CUDA graphs are), grid (the blocks a
  launch runs: those its messages use),
  resize (sizes changing within the slot window), headers (calls whose fingerprints alternate,
  back to back), ll_sizes (sizes around the LL limit, every dtype), ll_race (LL calls back to
  back, ranks delayed at random), ll_wrap (LL flags of 4 bits, wrapping every 16 messages),
  gate (a mismatched call of several blocks moves nothing), stepped_scratch (stepped mode's
  all-reduces through scratch, in chunks), stepped_scratch_after_steps (each right after a call
  of steps that one rank finishes late), stepped_events on|off (stepped mode's fences, every
  rank's queue late in turn), launch_end (each call's end
  reported once every block has ended), previous_stream LATE_MS
  (every call queued as if on another stream than the call before, whose end is reported
  LATE_MS late), residency checked|unchecked (ranks sharing an emulated GPU's SMs, their
  blocks per launch from the residency check or not), the fault drills dead_peer, timeout,
  mismatch (between calls), dies_mid and stalls_mid (in the middle of a collective; a third
  argument `ll` runs the drills' calls on messages small enough for the LL format), and
  all_to_all, gather_scatter, all_gather_v, reduce_scatter_v (the test bodies of
  workers/new_collectives.py, against MPI's Alltoall(v), Gather, Scatter, Allgatherv and
  numpy) and split_mismatch (ranks disagreeing on splits, counts or root).
"""

from __future__ import annotations

import os
import sys
import time

import checks
import numpy as np
from checks import (
    check_close,
    expect,
    hard_exit,
    is_float,
    make_input,
    proc_stat,
    reference,
    run_main,
    same_bytes,
)
from collectives import Checker, algorithms
from mpi4py import MPI
from new_collectives import Data

import pycollectives as pc
from pycollectives import _emu
from pycollectives.backends import Call
from pycollectives.ops import algo_code, op_code

STAGING = {"small": 4096, "default": 64 * 1024}


class EmulatedDevice:
    """The collectives of pc.Communicator over the emulated device. Its launches are
    synchronous: `async_op` is accepted (the shared test bodies pass it) and changes nothing."""

    def __init__(
        self, mpi, mode="kernel", staging="default", blocks=4, timeout=60.0, fault=None, **opts
    ):
        o = _emu.EmuOptions()
        o.slot_bytes = STAGING[staging]
        o.nslots = 2 if staging == "small" else 4
        o.nblocks = blocks
        o.kernel_mode = mode == "kernel"
        o.timeout = timeout
        o.oneshot_max_bytes = int(os.environ.get("PYCOLL_ONESHOT_BYTES", o.oneshot_max_bytes))
        o.lookahead = os.environ.get("PYCOLL_CUDA_LOOKAHEAD", "0") == "1"
        o.push = os.environ.get("PYCOLL_CUDA_PUSH", "0") == "1"
        if fault is not None:  # (collective number, step, exit?) of a drill on this rank
            o.fault_seq, o.fault_step, o.fault_exit = fault
        # Kernel mode: every rank on one emulated GPU (as under MPS) whose SMs hold exactly one
        # launch of every rank's, unless the test says otherwise: a protocol that needs more
        # blocks resident at once fails here (EmuOptions::sms).
        gpus = opts.pop("gpus", [0] * mpi.size if mode == "kernel" else [])
        o.sms = mpi.size * blocks if mode == "kernel" else 0
        for name, value in opts.items():  # e.g. ll_max_bytes, ll_flag_bits, nslots, sms
            setattr(o, name, value)
        self.mpi = mpi
        self.rank, self.size = mpi.rank, mpi.size
        self.dev = _emu.EmuComm(self.rank, self.size, o)
        names = mpi.allgather((self.dev.segment_name, self.dev.flags_name))
        self.dev.attach([s for s, _ in names], [f for _, f in names], gpus)
        mpi.Barrier()
        self.dev.unlink()

    def all_reduce(self, x, out=None, op="sum", algorithm=None):
        self.dev.run(Call("all_reduce", x, out, op_code(op), 0, algo_code(algorithm)))
        return x if out is None else out

    def reduce_scatter(self, x, out, op="sum", algorithm=None, counts=None, async_op=False):
        call = Call("reduce_scatter", x, out, op_code(op), 0, algo_code(algorithm), counts=counts)
        self.dev.run(call)
        return out

    def all_gather(self, x, out, algorithm=None, counts=None, async_op=False):
        self.dev.run(Call("all_gather", x, out, 0, 0, algo_code(algorithm), counts=counts))
        return out

    def broadcast(self, x, root=0, algorithm=None):
        self.dev.run(Call("broadcast", x, None, 0, root, algo_code(algorithm)))
        return x

    def reduce(self, x, out=None, root=0, op="sum", algorithm=None):
        self.dev.run(Call("reduce", x, out, op_code(op), root, algo_code(algorithm)))
        return x if out is None else out

    def all_to_all(self, x, out, in_splits=None, out_splits=None, algorithm=None, async_op=False):
        code = algo_code(algorithm)
        self.dev.run(
            Call("all_to_all", x, out, 0, 0, code, in_splits=in_splits, out_splits=out_splits)
        )
        return out

    def gather(self, x, out=None, root=0, algorithm=None, async_op=False):
        self.dev.run(Call("gather", x, out, 0, root, algo_code(algorithm)))
        return out

    def scatter(self, x, out, root=0, algorithm=None, async_op=False):
        self.dev.run(Call("scatter", x, out, 0, root, algo_code(algorithm)))
        return out

    def barrier(self):
        self.dev.barrier()

    # Registered buffers (csrc/emu/emu_registry.h), as CudaComm has them on a GPU.

    def device_array(self, shape, dtype):
        """Memory of the emulated device, not registered (what cupy.empty is to a GPU); the
        array keeps the allocation alive."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape))
        return np.frombuffer(self.dev.alloc(n * dt.itemsize), dt, count=n).reshape(shape)

    def register(self, array):
        """Registers `array` (device memory, any range of an allocation) on every rank:
        collective. The ranks trade where their arrays lie; a rank whose array is not device
        memory makes every rank raise ValueError."""
        ptr, nbytes = array.__array_interface__["data"][0], array.nbytes
        try:
            mine, err = self.dev.register_handle(ptr, nbytes), None
        except ValueError as e:
            mine, err = None, str(e)
        everyone = self.mpi.allgather(mine)
        bad = [q for q, h in enumerate(everyone) if h is None]
        if bad:
            raise ValueError(f"register: ranks {bad} passed no device memory ({err or 'see them'})")
        self.dev.register_add(ptr, nbytes, everyone)
        self.mpi.Barrier()  # every rank has mapped every allocation sent: their names can go
        self.dev.unlink_exchanged()
        return array

    def empty(self, shape, dtype):
        """A registered array (collective)."""
        return self.register(self.device_array(shape, dtype))

    def zeros(self, shape, dtype):
        a = self.empty(shape, dtype)
        a[...] = 0
        return a


class EmulatedChecker(Checker):
    def counts(self, staging):
        # 5000 elements: several pieces of a 4 KiB slot, several blocks' slices of each.
        return [0, 1, 7, 3 * self.size + 1, 5000]


def matrix(mpi, mode, collective, staging, algos, blocks):
    dev = EmulatedDevice(mpi, mode, staging, blocks)
    checker = EmulatedChecker(dev, mpi, algorithms(collective, ",".join(algos)))
    getattr(checker, collective)(staging)
    mpi.Barrier()
    if mpi.rank == 0:
        print(f"{collective} {','.join(algos)} {mode} ranks={mpi.size}: {checker.checks} checks")


def shapes(mpi, mode):
    """More distinct call shapes than the plan cache holds, and every one still right (host
    mode's all-reduces through scratch off: they have no plan)."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, stepped_twoshot=False)
    n = mpi.size
    for i in range(300):
        count = 1 + i * 7
        dt = np.dtype(np.float32 if i % 2 else np.int32)
        inputs = [make_input(q, count, dt, "sum", salt=i) for q in range(n)]
        out = dev.all_reduce(inputs[mpi.rank].copy(), algorithm="ring" if i % 3 else "direct")
        want = reference(inputs, "sum", dt)
        assert np.allclose(out.astype(np.float64), want, rtol=1e-5, atol=1e-4), f"shape {i}"
    assert dev.dev.plans_built > 256 and dev.dev.plans_cached <= 256, dev.dev.plans_cached
    if mpi.rank == 0:
        print(f"shapes {mode} built={dev.dev.plans_built} cached={dev.dev.plans_cached}")


def resize(mpi, mode):
    """Back-to-back calls whose sizes change while earlier messages still sit in the slots."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=3)
    n = mpi.size
    sizes = [5000, 3, 1200, 1, 777, 4096, 17, 2500, 0, 999]
    for rep in range(3):
        for j, count in enumerate(sizes):
            dt = np.dtype(np.float64 if j % 2 else np.float16)
            inputs = [make_input(q, count, dt, "sum", salt=rep * 100 + j) for q in range(n)]
            for algo in ("ring", "direct", "tree"):
                out = dev.all_reduce(inputs[mpi.rank].copy(), algorithm=algo)
                want = reference(inputs, "sum", dt)
                tol = 1e-2 if dt == np.float16 else 1e-9
                assert np.allclose(out.astype(np.float64), want, rtol=tol, atol=tol * 8), (
                    f"resize rep={rep} count={count} {algo}"
                )
            g = np.zeros(n * count, dt)
            dev.all_gather(inputs[mpi.rank].copy(), g, algorithm="ring")
            assert np.array_equal(g.view(np.uint8), np.concatenate(inputs).view(np.uint8))
    if mpi.rank == 0:
        print(f"resize {mode}")


def say(line):
    """One write per line: ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def leave_with(survivors):
    """A drill's surviving rank exits once every survivor has seen its error (a bounded wait
    on `survivors`, the MPI communicator without the failed rank), so none is killed early."""
    done, end = survivors.Ibarrier(), time.monotonic() + 10
    while not done.Test() and time.monotonic() < end:
        time.sleep(0.005)
    hard_exit(0)


def raises_in_drill(call, what):
    """Runs a drill's `call`, which must raise CollectiveError on this rank, and says so
    (RAISED, the error's type, the seconds until it came and its message); returns the error."""
    t0 = time.monotonic()
    try:
        call()
    except pc.CollectiveError as e:
        say(f"RAISED {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}")
        return e
    raise AssertionError(f"{what}: no error on rank {MPI.COMM_WORLD.rank} (pid {os.getpid()})")


# The drills' timeout: every wait in them is for a peer that never comes, so short is safe.
DRILL_TIMEOUT = 1.5


def until_gone(pids, limit):
    """Waits until none of the processes `pids` runs any more (gone, or a zombie that its
    launcher has not reaped yet), `limit` seconds at most."""

    def running(pid):
        try:
            return proc_stat(pid)[0] != "Z"
        except OSError:  # gone: before the open (ENOENT) or between it and the read (ESRCH)
            return False

    end = time.monotonic() + limit
    while any(map(running, pids)) and time.monotonic() < end:
        time.sleep(0.01)


def faults(mpi, mode, what, size="large"):
    # Drills in the middle of a collective: rank 1 runs 3 of its steps of call #2, then dies or
    # stalls, so its peers' waits happen inside the device code (device flags in kernel mode).
    # size "ll": the calls are small enough for the LL format (kernel mode), and rank 1 runs
    # none of its steps (one-shot has two: after its send, its peers would have all they need),
    # so its peers' LL polls are what must give up.
    ll, scratch = size == "ll", size == "scratch"
    step = 0 if ll else 1 if scratch else 3
    drill = {"dies_mid": (2, step, True), "stalls_mid": (2, step, False)}.get(what)
    fault = drill if mpi.rank == 1 else None
    dev = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=DRILL_TIMEOUT, fault=fault)
    pids = mpi.allgather(os.getpid())
    # The ranks that will raise (all but rank 1, unless every rank is healthy): none of them
    # leaves before all have raised. A survivor gone early is a dead peer to the others: a
    # kernel-mode launch watches every peer, and one still waiting out its own timeout then
    # reported "rank 2 is no longer running" instead of the timeout.
    faulty = what in ("dies_mid", "stalls_mid", "dead_peer", "timeout")
    survivors = mpi.Split(MPI.UNDEFINED if faulty and mpi.rank == 1 else 0, mpi.rank)
    # size "scratch" (stepped mode): an all-reduce through scratch of 3 chunks, rank 1 failing
    # after its first chunk's launch, so its peers' host meetings are what must give up.
    count = 64 if ll else 20000 if scratch else 5000
    algo = "direct" if ll else None if scratch else "ring"
    x = np.ones(count, np.float32)
    dev.all_reduce(x)  # everyone arrives once
    if what == "dead_peer":
        if mpi.rank == 1:
            os._exit(0)  # dies without a word, mid-job
        time.sleep(0.2)
    elif what == "timeout":
        if mpi.rank == 1:  # never arrives within the others' timeout; ends when they have
            time.sleep(DRILL_TIMEOUT)
            until_gone([p for q, p in enumerate(pids) if q != 1], 2.0)
            os._exit(0)
    elif what == "mismatch":
        x = np.ones(count if mpi.rank == 0 else count - 16, np.float32)
    ll_before, scratch_before = dev.dev.ll_steps_run, dev.dev.scratch_runs
    raises_in_drill(lambda: dev.all_reduce(x, algorithm=algo), what)
    if ll and mode == "kernel" and what in ("dies_mid", "stalls_mid"):
        assert dev.dev.ll_steps_run > ll_before, "the drill's call is not in the LL format"
    if scratch and what in ("dies_mid", "stalls_mid"):
        assert dev.dev.scratch_runs > scratch_before, "the drill's call is not through scratch"
    try:
        dev.all_reduce(x)
    except pc.CollectiveError as again:
        say(f"POISONED {again}")
    leave_with(survivors)


NEW_COLLECTIVES = ("all_to_all", "gather_scatter", "all_gather_v", "reduce_scatter_v")


def new_collectives(mpi, mode, part):
    """The host path's own test body for `part` (workers/new_collectives.py: every dtype,
    counts 0/1/7/multi-piece, uneven splits with zeros, every root), on the device code."""
    d = Data(EmulatedDevice(mpi, mode, "small", blocks=3), mpi)
    getattr(d, part)()
    mpi.Barrier()
    if mpi.rank == 0:
        print(f"{part} {mode} ranks={mpi.size} calls={d.calls}")


def split_mismatch(mpi, mode):
    """Ranks that disagree on splits, counts, sizes, root or collective: CollectiveMismatch on
    every rank, before anything moves, naming the field (for splits: the same words
    everywhere)."""
    n, r = mpi.size, mpi.rank
    last = r == n - 1
    m = [[1 + q + p for p in range(n)] for q in range(n)]
    col = [m[q][r] + (1 if last and q == 0 else 0) for q in range(n)]
    counts = [1 + q for q in range(n)]
    bad = counts[:-1] + [counts[-1] + last]
    i4, f4 = np.int32, np.float32
    cases = {
        "splits": (
            lambda d: d.all_to_all(np.ones(sum(m[r]), i4), np.ones(sum(col), i4), m[r], col),
            ["splits", f"rank 0 sends {m[0][n - 1]} elements to rank {n - 1}"],
        ),
        "even vs splits": (
            lambda d: d.all_to_all(
                np.ones(n, i4), np.ones(n, i4), *([[1] * n] * 2 if last else [])
            ),
            ["splits"],
        ),
        "all_gather counts": (
            lambda d: d.all_gather(np.ones(bad[r], f4), np.ones(sum(bad), f4), counts=bad),
            ["counts"],
        ),
        "reduce_scatter counts": (
            lambda d: d.reduce_scatter(np.ones(sum(bad), f4), np.ones(bad[r], f4), counts=bad),
            ["counts"],
        ),
        "gather count": (
            lambda d: d.gather(
                np.ones(3 + last, np.int8), np.ones(n * 3, np.int8) if r == 0 else None
            ),
            ["count"],
        ),
        # Found on the host by the ranks that meet there (all-to-all); the failure word they
        # leave in their device segments stops the device wait of the rank that does not.
        "all_to_all against all_reduce": (
            lambda d: (
                d.all_reduce(np.ones(n, i4))
                if last
                else d.all_to_all(np.ones(n, i4), np.ones(n, i4))
            ),
            ["disagree"],
        ),
        "scatter root": (
            lambda d: d.scatter(np.ones(2 * n, np.float64), np.ones(2, np.float64), int(last)),
            ["root"],
        ),
    }
    for name, (call, words) in cases.items():
        d = EmulatedDevice(mpi, mode, "small", blocks=2, timeout=30.0)
        d.all_reduce(np.ones(3, np.int32))  # a matching call first
        t0 = time.monotonic()
        try:
            call(d)
        except pc.CollectiveMismatch as e:
            msg = str(e)
        else:
            raise AssertionError(f"{name}: no CollectiveMismatch on rank {r}")
        assert time.monotonic() - t0 < 10, f"{name}: detected late"
        assert "#2" in msg and all(w in msg for w in words), f"{name}: {msg}"
        assert d.dev.poisoned, name
        if name == "splits":  # every rank checked the same matrix
            assert len(set(mpi.allgather(msg))) == 1, name
    if r == 0:
        print(f"split_mismatch {mode} ranks={n} cases={len(cases)}")


def replay(mpi, mode):
    """Collectives captured once and replayed, as CUDA graphs replay a kernel-mode launch: the
    same launch arguments every time, the flags advancing on the device, eager calls between
    replays, the plan cache flooded meanwhile (captured plans are pinned). Stepped mode refuses
    to capture, and so does kernel mode for a shape not run before."""
    from pycollectives.errors import CollectiveError

    dev = EmulatedDevice(mpi, mode, "small", blocks=3)
    c, r, n = dev.dev, mpi.rank, mpi.size
    total = op_code("sum")
    first = np.zeros(64, np.int64)
    if mode == "stepped":
        dev.all_reduce(first)
        expect(
            CollectiveError,
            lambda: c.capture(Call("all_reduce", first, None, total)),
            "stepped mode",
        )
        say(f"replay stepped ranks={n}: capture refused")
        return
    expect(CollectiveError, lambda: c.capture(Call("all_reduce", first, None, total)), "once")
    graphs = []  # (buffer, graph): in-place all-reduces, ring, direct and tree, several sizes
    for algo, count in (("ring", 5000), ("direct", 7), ("tree", 1200), ("auto", 3 * n + 11)):
        buf = np.zeros(count, np.int64)
        dev.all_reduce(buf, algorithm=algo)  # the plan is built here, outside the capture
        graphs.append((buf, c.capture(Call("all_reduce", buf, None, total, 0, algo_code(algo)))))
    xg, og = np.zeros(999, np.float32), np.zeros(999 * n, np.float32)
    dev.all_gather(xg, og)
    gather = c.capture(Call("all_gather", xg, og))
    assert c.plans_pinned == 5, c.plans_pinned

    def replay_all(k):
        for buf, g in graphs:
            idx = np.arange(buf.size)
            buf[:] = idx % 7 + r + k  # new inputs in the captured buffer, as a training step
            c.replay(g)
            want = sum(idx % 7 + q + k for q in range(n))
            assert np.array_equal(buf, want), f"replay {k}: {buf.size} elements wrong"
        xg[:] = np.arange(xg.size) + 1000 * r + k
        c.replay(gather)
        want = np.concatenate([np.arange(xg.size) + 1000 * q + k for q in range(n)])
        assert np.array_equal(og, want.astype(np.float32)), f"all-gather replay {k} wrong"

    for k in range(4):
        replay_all(k)
        inputs = [make_input(q, 777, np.dtype(np.float64), "sum", salt=k) for q in range(n)]
        out = dev.all_reduce(inputs[r].copy(), algorithm="ring")  # an eager call between
        assert np.allclose(out, reference(inputs, "sum", np.dtype(np.float64)))
    for i in range(260):  # more shapes than the cache holds: it is emptied at least once
        dev.all_reduce(np.ones(1 + i, np.int32), algorithm="direct")
    assert c.plans_cached <= 256 and c.plans_pinned == 5, (c.plans_cached, c.plans_pinned)
    replay_all(10)
    say(f"replay kernel ranks={n}: 5 graphs x 5 replays right, eager calls between")


def replay_order(mpi, late_ms=30):
    """A replay between eager calls: the eager call before it reports its end `late_ms` after it
    has run, as a launch still running on another stream would. The replay must wait for that
    end (the GPU's graph: an external event wait node on the eager launches' end event), or its
    blocks run beside the launch that uses the same per-block counters (the emulated device
    sees a block run before the call before had ended)."""
    dev = EmulatedDevice(mpi, "kernel", "small", blocks=3, previous_late_ms=late_ms)
    c, r, n = dev.dev, mpi.rank, mpi.size
    buf = np.zeros(3000, np.int64)
    dev.all_reduce(buf, algorithm="ring")  # the plan, outside the capture
    graph = c.capture(Call("all_reduce", buf, None, op_code("sum"), 0, algo_code("ring")))
    start = time.perf_counter()
    for k in range(4):
        inputs = [make_input(q, 900, np.dtype(np.float64), "sum", salt=k) for q in range(n)]
        out = dev.all_reduce(inputs[r].copy(), algorithm="direct")  # its end reported late
        assert np.allclose(out, reference(inputs, "sum", np.dtype(np.float64)))
        idx = np.arange(buf.size)
        buf[:] = idx % 5 + r + k
        c.replay(graph)
        assert np.array_equal(buf, sum(idx % 5 + q + k for q in range(n))), f"replay {k} wrong"
    took = time.perf_counter() - start
    assert took >= 4 * late_ms / 1000, took  # each replay waited for the eager call's report
    say(f"replay_order ranks={n}: 4 replays after late eager calls in {took:.3f} s")


def grid(mpi, mode):
    """A launch runs only the blocks its messages use: one for the smallest calls, every block
    for a message that spans them all, and the results right either way."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=4)
    c, n = dev.dev, mpi.size
    ran = []
    for count in (2, 5000, 2, 300, 5000):
        inputs = [make_input(q, count, np.dtype(np.float64), "sum", salt=count) for q in range(n)]
        before = c.blocks_run
        out = dev.all_reduce(inputs[mpi.rank].copy(), algorithm="ring")
        ran.append(c.blocks_run - before)
        assert np.allclose(out, reference(inputs, "sum", np.dtype(np.float64)))
    small, large = ran[0], ran[1]
    if mode == "kernel":
        # One launch per call, which compares the call with the peers' first (block 0; a call
        # that runs several blocks gates the others on that comparison).
        assert small == 1 and large == 4 and ran[2] == 1 and 1 <= ran[3] <= 4, ran
    else:  # one launch per step, each of the blocks that step's message uses
        assert small * 4 <= large and ran[2] == small, ran
    say(f"grid {mode} ranks={n}: blocks run per call {ran}")


def headers(mpi, mode):
    """Broadcasts back to back whose fingerprints alternate, the root never waiting for its
    peers' data: a root that runs ahead must not overwrite the call header (kernel mode
    compares every call on the device) that a peer has yet to read, or that peer sees the
    next call's and reports a mismatch that is not there."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=1)
    for i in range(400):
        x = np.full(1 + i % 2, i if mpi.rank == 0 else -1, np.int64)
        dev.broadcast(x, root=0)
        assert (x == i).all(), (i, x)
    say(f"headers {mode} ranks={mpi.size}")


LL_LIMIT = _emu.EmuOptions().ll_max_bytes


def wire_bytes(collective, dt):
    """Bytes per element on the wire: partial sums in the accumulation type (float32 for the
    16-bit floats), finished elements as they are."""
    partial = collective in ("all_reduce", "reduce_scatter")
    return 4 if partial and is_float(dt) and dt.itemsize == 2 else dt.itemsize


def run_checked(dev, mpi, collective, dt, count, algo, salt):
    """One call of `collective` on every rank's make_input, checked against numpy."""
    n, r = mpi.size, mpi.rank
    what = f"{collective} {dt.name} count={count} {algo or 'auto'} #{salt}"
    if collective == "all_reduce":
        inputs = [make_input(q, count, dt, "sum", salt) for q in range(n)]
        got = dev.all_reduce(inputs[r].copy(), algorithm=algo)
        check_close(got, reference(inputs, "sum", dt), dt, n, what, "sum")
    elif collective == "reduce_scatter":
        inputs = [make_input(q, n * count, dt, "sum", salt) for q in range(n)]
        out = np.zeros(count, dt)
        dev.reduce_scatter(inputs[r], out, algorithm=algo)
        want = reference(inputs, "sum", dt)[r * count : (r + 1) * count]
        check_close(out, want, dt, n, what, "sum")
    elif collective == "all_gather":
        inputs = [make_input(q, count, dt, "sum", salt) for q in range(n)]
        out = np.zeros(n * count, dt)
        dev.all_gather(inputs[r], out, algorithm=algo)
        same_bytes(out, np.concatenate(inputs), what)
    else:  # broadcast, from a root that moves with the salt
        root = salt % n
        x = make_input(root, count, dt, "sum", salt)
        got = dev.broadcast(x.copy() if r == root else np.zeros(count, dt), root, algorithm=algo)
        same_bytes(got, x, what)


LL_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def ll_sizes(mpi, mode):
    """Every dtype, and sizes around the LL limit (a message of exactly the limit, an element
    either side, a quarter of it, twice it), all-reduce, reduce-scatter, all-gather and
    broadcast, direct and auto, against numpy. Kernel mode runs one-element calls in the LL
    format and no direct call whose messages are all over the limit; stepped mode never uses it."""
    dev = EmulatedDevice(mpi, mode, "default", blocks=4)
    c = dev.dev
    calls = 0
    for dt in checks.DTYPES:
        for collective in LL_COLLECTIVES:
            edge = LL_LIMIT // wire_bytes(collective, dt)
            for count in sorted({1, 3, 7, edge // 4 + 1, edge // 2 - 1, edge - 1, edge, edge + 1,
                                 2 * edge}):  # fmt: skip
                for algo in ("direct", None):
                    before = c.ll_steps_run
                    run_checked(dev, mpi, collective, dt, count, algo, calls)
                    calls += 1
                    ran = c.ll_steps_run - before
                    what = f"{collective} {dt.name} count={count} {algo}: {ran} LL steps"
                    if mode == "stepped":
                        assert ran == 0, what
                    elif algo == "direct" and count == 1:
                        assert ran > 0, what
                    elif algo == "direct" and count > edge:
                        assert ran == 0, what
    say(f"ll_sizes {mode} ranks={mpi.size}: {calls} calls, {c.ll_steps_run} LL steps")


def ll_race(mpi, mode):
    """LL calls back to back, one rank (drawn at random, the same draw on every rank) calling
    late each time: its peers poll its slot first and find an earlier message's words there
    (2 slots per channel: the message before last), whose flags they must not take for this
    one's. Sizes and values change every call, so a stale word is a wrong element."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=3)
    c, n = dev.dev, mpi.size
    rng = np.random.default_rng(37)
    dtypes = [np.dtype(t) for t in (np.float32, np.int8, np.float16, np.int64, np.int32)]
    for i in range(240):
        late, pause = int(rng.integers(n)), float(rng.uniform(0.0, 0.003))
        collective = LL_COLLECTIVES[int(rng.integers(len(LL_COLLECTIVES)))]
        dt = dtypes[int(rng.integers(len(dtypes)))]
        count = int(rng.choice([1, 2, 5, 16, 33, 100, 150]))
        if mpi.rank == late:
            time.sleep(pause)
        run_checked(dev, mpi, collective, dt, count, "direct", i)
    assert (c.ll_steps_run > 0) == (mode == "kernel"), c.ll_steps_run
    say(f"ll_race {mode} ranks={n}: {c.ll_steps_run} LL steps")


def ll_wrap(mpi, mode):
    """LL flags of 4 bits: a flag equals that of the message 16 before it on the slot. Every
    16th call is long and its writer calls late, the calls between are short: without the
    sweep (plan.h, ll_sweeps), the long message's words past the short ones would still hold
    the flag of the long message 16 calls earlier, and an early reader would take them."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=1, ll_flag_bits=4)
    c, n = dev.dev, mpi.size
    dt = np.dtype(np.float32)
    for i in range(16 * 6):
        long = i % 16 == 0
        if long and mpi.rank == (i // 16) % n:
            time.sleep(0.005)
        run_checked(dev, mpi, "all_reduce", dt, 500 if long else 3, "direct", i)
    assert (c.ll_steps_run > 0) == (mode == "kernel"), c.ll_steps_run
    say(f"ll_wrap {mode} ranks={n}: {c.ll_steps_run} LL steps")


LL_TESTS = {"ll_sizes": ll_sizes, "ll_race": ll_race, "ll_wrap": ll_wrap}


def gate(mpi, mode):
    """A call of several blocks moves nothing before block 0 has compared it with every peer's
    (kernel mode: the other blocks wait at the gate; stepped mode: the host compares first). Rank 2
    calls all-gather with fewer elements, late: ranks 0 and 1 agree with each other, and
    without the gate their other blocks would trade their slices while block 0 waits for rank
    2's call. Every rank raises CollectiveMismatch, and no output element was written."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=4, timeout=10.0)
    n, r = mpi.size, mpi.rank
    if os.environ.get("FLIGHT_DIR"):  # the device's flight recorder writes its ring there
        dev.dev.set_flight_dump(f"{os.environ['FLIGHT_DIR']}/rank{r}.json", r, n, "gate")
    count = 5000 - 16 * (r == 2)
    x = np.full(count, r + 1, np.float32)
    out = np.full(n * count, -7, np.float32)
    if r == 2:
        time.sleep(0.1)
    expect(pc.CollectiveMismatch, lambda: dev.all_gather(x, out, algorithm="direct"), "count")
    assert (out == -7).all(), f"rank {r}: {int((out != -7).sum())} elements written"
    say(f"gate {mode} ranks={n}: nothing moved")


def stepped_scratch(mpi, mode):
    """Stepped mode's all-reduce through scratch (device/stepped.h): every rank's segment data
    area holds a chunk at a time (5120 float64 elements for n = 3: 2 slots on each of n + 1
    channels of 4 blocks, 1280 B each), the two-shot runs in place over them between two host
    meetings. Sizes of
    one element to five chunks, every dtype, sum, max and avg, in place and not, one rank late
    at random each call; against numpy, and bitwise alike on every rank. A call forced onto the
    ring still takes the steps. Then all-gathers and broadcasts (copies only) up to 3 chunks,
    reduces from every root and reduce-scatters (a chunk holds a piece of every block),
    uneven all-gathers and reduce-scatters (empty blocks, one block far longer than the rest),
    gathers, scatters and all-to-alls (with splits too)."""
    assert mode == "stepped", mode
    dev = EmulatedDevice(mpi, mode, "small", blocks=4)
    c, n, r = dev.dev, mpi.size, mpi.rank
    rng = np.random.default_rng(38)
    # 4 blocks x (n + 1) channels (one to each rank, one broadcast) x 2 slots x a block's share
    # of a 4 KiB slot (1024 B, 128 spare, rounded up to 256: 1280 B)
    assert c.segment_data_bytes == 4 * (n + 1) * 2 * 1280, c.segment_data_bytes
    calls = chunks = 0
    for dt in checks.DTYPES:
        cap = c.segment_data_bytes // dt.itemsize // 16 * 16
        ops = ["sum", "max", "avg"] if is_float(dt) else ["sum", "max"]
        for count in (1, 7, 16 * n + 5, cap, cap + 1, 5 * cap - 3):
            op = ops[calls % len(ops)]
            inputs = [make_input(q, count, dt, op, salt=calls) for q in range(n)]
            late = int(rng.integers(n))
            if r == late:
                time.sleep(float(rng.uniform(0, 0.003)))
            before = c.scratch_runs, c.scratch_chunks
            if calls % 2:
                got = dev.all_reduce(inputs[r].copy(), op=op)  # in place
            else:
                got = np.zeros(count, dt)
                dev.all_reduce(inputs[r], got, op=op)
            what = f"{dt.name} count={count} {op}"
            assert c.scratch_runs == before[0] + 1, what
            assert c.scratch_chunks == before[1] + -(-count // cap), (what, c.scratch_chunks)
            check_close(got, reference(inputs, op, dt), dt, n, what, op)
            digests = mpi.allgather(got.tobytes())
            assert all(d == digests[0] for d in digests), f"{what}: ranks differ"
            calls += 1
            chunks += -(-count // cap)
    ring = dev.all_reduce(np.ones(100, np.float32), algorithm="ring")
    assert c.scratch_runs == calls and (ring == n).all(), c.scratch_runs
    # All-gather (each rank's block a chunk at a time, every scratch copied out) and broadcast
    # (the root's scratch copied out), from every root, bitwise.
    for dt in (np.dtype(np.float64), np.dtype(np.int8), np.dtype(np.float16)):
        cap = c.segment_data_bytes // dt.itemsize // 16 * 16
        for count in (1, 16 * n + 5, cap + 1, 3 * cap - 3):
            before = c.scratch_chunks
            inputs = [make_input(q, count, dt, "sum", salt=calls) for q in range(n)]
            if r == int(rng.integers(n)):
                time.sleep(float(rng.uniform(0, 0.003)))
            out = np.zeros(n * count, dt)
            dev.all_gather(inputs[r], out)
            same_bytes(out, np.concatenate(inputs), f"all_gather {dt.name} count={count}")
            root = calls % n
            x = inputs[root].copy() if r == root else np.zeros(count, dt)
            dev.broadcast(x, root)
            same_bytes(x, inputs[root], f"broadcast {dt.name} count={count} root={root}")
            calls += 2
            assert c.scratch_runs == calls, c.scratch_runs
            assert c.scratch_chunks == before + 2 * -(-count // cap), c.scratch_chunks
    # Reduce (the two-shot, the root's sums copied out) from every root, and even
    # reduce-scatter (a chunk holds a piece of every rank's block: cap // n of each).
    for dt in (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.float16)):
        cap = c.segment_data_bytes // dt.itemsize // 16 * 16
        for count in (1, 16 * n + 5, cap // n + 1, 2 * cap + 7):
            before = c.scratch_chunks
            op = "avg" if is_float(dt) and count % 2 else "sum"
            what = f"{dt.name} count={count} {op}"
            if r == int(rng.integers(n)):
                time.sleep(float(rng.uniform(0, 0.003)))
            root = calls % n
            inputs = [make_input(q, count, dt, op, salt=calls) for q in range(n)]
            out = np.zeros(count, dt) if r == root else None
            dev.reduce(inputs[r], out, root=root, op=op)
            if r == root:
                check_close(out, reference(inputs, op, dt), dt, n, f"reduce {what}", op)
            inputs = [make_input(q, n * count, dt, op, salt=calls + 1) for q in range(n)]
            out = np.zeros(count, dt)
            dev.reduce_scatter(inputs[r], out, op=op)
            want = reference(inputs, op, dt)[r * count : (r + 1) * count]
            check_close(out, want, dt, n, f"reduce_scatter {what}", op)
            calls += 2
            assert c.scratch_runs == calls, c.scratch_runs
            rs_chunks = -(-count // (cap // n))
            assert c.scratch_chunks == before + -(-count // cap) + rs_chunks, c.scratch_chunks
    # Uneven all-gather and reduce-scatter (counts): chunk k holds what each block has from
    # offset k * cap; a block that has ended (or is empty) adds nothing to it.
    for dt in (np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.float16)):
        cap = c.segment_data_bytes // dt.itemsize // 16 * 16
        for counts in (
            [(3, 0, 5, 1)[q % 4] for q in range(n)],
            [cap + 1] + [16 * q + 1 for q in range(1, n)],
            [0] * (n - 1) + [2 * cap + 3],
        ):
            counts = [int(k) for k in counts]
            before = c.scratch_runs, c.scratch_chunks
            if r == int(rng.integers(n)):
                time.sleep(float(rng.uniform(0, 0.003)))
            inputs = [make_input(q, counts[q], dt, "sum", salt=calls) for q in range(n)]
            out = np.zeros(sum(counts), dt)
            dev.all_gather(inputs[r], out, counts=counts)
            same_bytes(out, np.concatenate(inputs), f"all_gather_v {dt.name} counts={counts}")
            op = "avg" if is_float(dt) else "sum"
            inputs = [make_input(q, sum(counts), dt, op, salt=calls + 1) for q in range(n)]
            out = np.zeros(counts[r], dt)
            dev.reduce_scatter(inputs[r], out, op=op, counts=counts)
            lo = sum(counts[:r])
            want = reference(inputs, op, dt)[lo : lo + counts[r]]
            check_close(out, want, dt, n, f"reduce_scatter_v {dt.name} counts={counts}", op)
            calls += 2
            assert c.scratch_runs == before[0] + 2, c.scratch_runs
            chunks = -(-max(counts) // cap) + -(-max(counts) // (cap // n))
            assert c.scratch_chunks == before[1] + chunks, (counts, c.scratch_chunks)
    # Gathers (the root copies every scratch out), scatters (the root's scratch holds a piece
    # for every rank) and even all-to-alls (every scratch a piece for every rank), from every
    # root, up to several chunks; an uneven all-to-all still takes the steps.
    for dt in (np.dtype(np.float32), np.dtype(np.int8)):
        cap = c.segment_data_bytes // dt.itemsize // 16 * 16
        for count in (1, 16 * n + 5, cap // n + 1, 2 * cap + 3):
            before = c.scratch_runs, c.scratch_chunks
            root = calls % n
            what = f"{dt.name} count={count} root={root}"
            if r == int(rng.integers(n)):
                time.sleep(float(rng.uniform(0, 0.003)))
            inputs = [make_input(q, count, dt, "sum", salt=calls) for q in range(n)]
            out = np.zeros(n * count, dt) if r == root else None
            dev.gather(inputs[r], out, root=root)
            if r == root:
                same_bytes(out, np.concatenate(inputs), f"gather {what}")
            blocks = make_input(root, n * count, dt, "sum", salt=calls + 1)
            out = np.zeros(count, dt)
            dev.scatter(blocks.copy() if r == root else None, out, root=root)
            same_bytes(out, blocks[r * count : (r + 1) * count], f"scatter {what}")
            rows = [make_input(q, n * count, dt, "sum", salt=calls + 2) for q in range(n)]
            out = np.zeros(n * count, dt)
            dev.all_to_all(rows[r], out)
            want = np.concatenate([rows[q][r * count : (r + 1) * count] for q in range(n)])
            same_bytes(out, want, f"all_to_all {what}")
            calls += 3
            assert c.scratch_runs == before[0] + 3, c.scratch_runs
            chunks_now = -(-count // cap) + 2 * -(-count // (cap // n))
            assert c.scratch_chunks == before[1] + chunks_now, (what, c.scratch_chunks)
    # All-to-alls with splits: chunks counted by the widest split of every rank's (the host has
    # read them all, checking the matrix), each block adding what it has from each offset;
    # blocks of nothing, and one several chunks long.
    cap = c.segment_data_bytes // 4 // 16 * 16
    for k in range(3):
        split = [[(7 * p + 3 * q + k) % 5 * (q + 1) for q in range(n)] for p in range(n)]
        split[(k + 1) % n][k % n] = (k + 1) * cap // n + 5  # several chunks of a block
        split[k % n][(k + 2) % n] = 0
        sends, gets = split[r], [split[p][r] for p in range(n)]
        rows = [make_input(p, sum(split[p]), np.dtype(np.float32), "sum", salt=k) for p in range(n)]
        at = [np.cumsum([0] + split[p]) for p in range(n)]
        want = np.concatenate([rows[p][at[p][r] : at[p][r + 1]] for p in range(n)])
        before = c.scratch_runs, c.scratch_chunks
        out = np.zeros(sum(gets), np.float32)
        dev.all_to_all(rows[r], out, in_splits=sends, out_splits=gets)
        same_bytes(out, want, f"all_to_all with splits {split}")
        widest = max(max(row) for row in split)
        assert c.scratch_runs == before[0] + 1, c.scratch_runs
        assert c.scratch_chunks == before[1] + -(-widest // (cap // n)), c.scratch_chunks
    say(f"stepped_scratch ranks={n}: {calls} calls, {chunks} all-reduce chunks")


def stepped_scratch_after_steps(mpi, mode):
    """An all-reduce through scratch right after a call of steps, whose last messages rank 1
    reads 3 ms late each: the scratch is the slots those messages are in, so no rank may copy
    into it before every rank has finished the call before. With the host's fingerprint
    checks on, their meeting sees to that; off, as here, a meeting of its own."""
    assert mode == "stepped", mode
    r, n = mpi.rank, mpi.size
    delay = 3 if r == 1 else 0
    dev = EmulatedDevice(mpi, mode, "small", blocks=4, step_delay_ms=delay, host_checks=False)
    f32 = np.dtype(np.float32)
    for i in range(6):
        inputs = [make_input(q, 3000, f32, "sum", salt=i) for q in range(n)]
        ring = dev.all_reduce(inputs[r].copy(), algorithm="ring")
        check_close(ring, reference(inputs, "sum", f32), f32, n, f"ring #{i}", "sum")
        scratch = dev.all_reduce(inputs[r].copy())
        check_close(scratch, reference(inputs, "sum", f32), f32, n, f"scratch #{i}", "sum")
    assert dev.dev.scratch_runs == 6, dev.dev.scratch_runs
    say(f"stepped_scratch_after_steps ranks={n}")


def stepped_events(mpi, mode, events):
    """Stepped mode's fences (cuda::event_fence): registered calls and calls through scratch go
    on each rank's queue, and in every call the queues of the even or of the odd ranks start
    each op 3 ms late, so that a queue that did not wait for a peer's fence would read a
    scratch before the peer copied into it, or copy into its own while a peer still reads it,
    or a host would return before a peer had written its output. All-reduces of three chunks,
    all-gathers, reduce-scatters and broadcasts through scratch, registered all-reduces,
    all-gathers and reduce-scatters, back to back and with new data each time; against numpy,
    bitwise alike on every rank. `events` "on": the fences on counters (cuda::counter_fence);
    "off": without (the host waits for its queue, then meets); "weak_events": see weak_events."""
    assert mode == "stepped", mode
    if events == "weak_events":
        return weak_events(mpi)
    dev = EmulatedDevice(
        mpi, mode, "small", blocks=2, stepped_events=events == "on", queue_delay_ms=3
    )
    c, n, r = dev.dev, mpi.size, mpi.rank
    f64, i32 = np.dtype(np.float64), np.dtype(np.int32)
    cap = c.segment_data_bytes // f64.itemsize // 16 * 16
    for i in range(4):  # both parities of late ranks, twice
        what = f"#{i}"
        inputs = [make_input(q, 3 * cap - 5, f64, "sum", salt=i) for q in range(n)]
        got = dev.all_reduce(inputs[r].copy())
        check_close(got, reference(inputs, "sum", f64), f64, n, f"all_reduce {what}", "sum")
        assert len({d for d in mpi.allgather(got.tobytes())}) == 1, what
        blocks = [make_input(q, 2 * cap + 3, i32, "sum", salt=i) for q in range(n)]
        out = np.zeros(n * blocks[0].size, i32)
        dev.all_gather(blocks[r], out)
        same_bytes(out, np.concatenate(blocks), f"all_gather {what}")
        whole = [make_input(q, n * (cap // n + 7), i32, "sum", salt=i) for q in range(n)]
        piece = np.zeros(cap // n + 7, i32)
        dev.reduce_scatter(whole[r], piece)
        want = np.split(np.sum(whole, axis=0, dtype=i32), n)[r]
        same_bytes(piece, want, f"reduce_scatter {what}")
        root = i % n
        x = blocks[root].copy() if r == root else np.zeros(blocks[0].size, i32)
        same_bytes(dev.broadcast(x, root), blocks[root], f"broadcast {what}")
    assert c.scratch_runs == 16, c.scratch_runs
    # Registered buffers: one launch between two fences.
    count = 4000
    x, y = dev.empty(count, f64), dev.empty(count, f64)
    g_in, g_out = dev.empty(count, i32), np.zeros(n * count, i32)
    for i in range(4):
        inputs = [make_input(q, count, f64, "sum", salt=10 + i) for q in range(n)]
        x[...] = inputs[r]
        dev.all_reduce(x, y)
        check_close(y, reference(inputs, "sum", f64), f64, n, f"registered all_reduce #{i}", "sum")
        blocks = [make_input(q, count, i32, "sum", salt=10 + i) for q in range(n)]
        g_in[...] = blocks[r]
        dev.all_gather(g_in, g_out)
        same_bytes(g_out, np.concatenate(blocks), f"registered all_gather #{i}")
        piece = np.zeros(count // n, i32)
        dev.reduce_scatter(g_in[: count // n * n], piece)
        whole = np.sum([b[: count // n * n] for b in blocks], axis=0, dtype=i32)
        same_bytes(piece, np.split(whole, n)[r], f"registered reduce_scatter #{i}")
    assert c.twoshot_runs == 12, c.twoshot_runs
    say(f"stepped_events {events} ranks={n}")


def launch_end(mpi, mode):
    """Kernel mode reports each call's end in the done word (step_kernel.h, finish_launch):
    the last of its blocks to end writes the call's number there, once every block has ended.
    Blocks end 4 ms apart here, so a block that wrote it on its own end, before the others',
    is seen by the emulated device (a block that has ended finds the number written while a
    block has yet to end). Calls of one block and of several, every result against numpy."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=4, finish_stagger_ms=4)
    c = dev.dev
    for i, (collective, count) in enumerate(
        [("all_reduce", 2), ("all_reduce", 5000), ("all_gather", 300), ("broadcast", 5000),
         ("reduce_scatter", 1200), ("all_reduce", 1)]
    ):  # fmt: skip
        run_checked(dev, mpi, collective, np.dtype(np.float32), count, None, i)
        assert c.completed == c.seq, (collective, count, c.completed, c.seq)
    say(f"launch_end {mode} ranks={mpi.size}: calls up to #{c.completed} reported")


def one_rank(mpi, mode):
    """A one-rank communicator in kernel mode: a call that moves nothing (a broadcast, a count-0
    call) has nothing to run and no peer to compare with, so it is not launched
    (cuda::runs_anything) and no end of it is ever reported. Every call is queued as if on
    another stream than the one before (its end reported 20 ms late): the call after a skipped
    one must wait for the launch before that, not for the skipped call's end, which would never
    come (the timeout, 1.5 s)."""
    assert mpi.size == 1, mpi.size
    dev = EmulatedDevice(mpi, mode, "small", blocks=3, previous_late_ms=20, timeout=1.5)
    c = dev.dev
    calls = [("all_gather", 5), ("broadcast", 7), ("all_gather", 0), ("reduce_scatter", 4),
             ("broadcast", 3), ("all_gather", 9), ("broadcast", 1)]  # fmt: skip
    start = time.perf_counter()
    for i, (collective, count) in enumerate(calls):
        run_checked(dev, mpi, collective, np.dtype(np.float32), count, None, i)
    took = time.perf_counter() - start
    time.sleep(0.1)  # the last launch's late report
    # The last call (a broadcast) was not launched: the done word holds the call before it.
    assert c.completed == c.seq - 1, (c.completed, c.seq)
    assert took < 1.0, took
    say(f"one_rank {mode}: {len(calls)} calls in {took:.3f} s, the last launch #{c.completed}")


def previous_stream(mpi, mode, late_ms):
    """A call queued on another stream than the call before starts only once that call has
    ended: its stream waits for an event recorded after that launch (DeviceComm::
    launch_kernel_mode), so no block of it holds an SM meanwhile. Here every call is queued so,
    and the call before reports its end `late_ms` after it has run: a block that ran before that
    report is seen by the emulated device. With a report later than the timeout, the wait
    gives up and names this rank's previous collective, on every rank."""
    timeout = 1.0 if late_ms > 1000 else 60.0
    dev = EmulatedDevice(mpi, mode, "small", blocks=3, previous_late_ms=late_ms, timeout=timeout)
    calls = [("all_reduce", 2), ("all_reduce", 5000), ("all_gather", 300), ("broadcast", 7),
             ("reduce_scatter", 900), ("all_reduce", 3)]  # fmt: skip
    if late_ms > 1000:
        run_checked(dev, mpi, "all_reduce", np.dtype(np.float64), 5, None, 0)
        expect(
            pc.CollectiveTimeout,
            lambda: run_checked(dev, mpi, "all_reduce", np.dtype(np.float64), 5, None, 1),
            "timed out waiting for this rank's previous collective to end",
        )
        say(f"previous_stream {mode} ranks={mpi.size}: timed out")
        return
    start = time.perf_counter()
    for i, (collective, count) in enumerate(calls):
        run_checked(dev, mpi, collective, np.dtype(np.float64), count, None, i)
    took = time.perf_counter() - start
    # Every call after the first waited for the report of the one before.
    assert took >= (len(calls) - 1) * late_ms / 1000, took
    say(f"previous_stream {mode} ranks={mpi.size}: {len(calls)} calls in {took:.3f} s")


def raised_everywhere(mpi, fn):
    """Runs `fn` on every rank: each rank's ("Type: message" of the CollectiveError it raised,
    or None; seconds it took), in rank order, on every rank."""
    start, said = time.perf_counter(), None
    try:
        fn()
    except pc.CollectiveError as e:
        said = f"{type(e).__name__}: {e}"
    return mpi.allgather((said, time.perf_counter() - start))


def weak_events(mpi):
    """Stepped mode's fences on interprocess events (cuda::event_fence) where a queued wait binds
    to the peer's record current when the queue reaches it, the weakest reading CUDA leaves
    open: a queue that lags its host by two fences waits for a record its peer makes only
    after waiting for this queue, and the queues wait for each other in a cycle. Every rank
    raises within the timeout (on a GPU nothing would end it); the fences on counters run the
    same calls right (stepped_events on)."""
    n, r = mpi.size, mpi.rank
    dev = EmulatedDevice(mpi, "stepped", "small", blocks=2, queue_delay_ms=3, fence_counters=False,
                         timeout=2.0)  # fmt: skip
    f64 = np.dtype(np.float64)
    cap = dev.dev.segment_data_bytes // f64.itemsize // 16 * 16

    def calls():
        for i in range(4):
            inputs = [make_input(q, 3 * cap - 5, f64, "sum", salt=i) for q in range(n)]
            got = dev.all_reduce(inputs[r].copy())
            check_close(got, reference(inputs, "sum", f64), f64, n, f"all_reduce #{i}", "sum")

    everyone = raised_everywhere(mpi, calls)
    if r == 0:
        assert all(s is not None and "CollectiveTimeout" in s for s, _ in everyone), everyone
        assert max(t for _, t in everyone) < 8, everyone
        say(f"stepped_events weak_events ranks={n}: every rank timed out, the last after "
            f"{max(t for _, t in everyone):.1f} s")  # fmt: skip


def residency(mpi, mode, checked):
    """Every rank shares one emulated GPU of 8 SMs (one block per SM: EmuOptions::sms) and asks
    for 4 blocks per launch. `checked` ("checked"): the blocks come from the residency check
    (backends/cuda/residency.py: 8 // ranks each), and calls of every kind run right, with a
    rank late in turn and every call queued as if on another stream than the one before.
    "unchecked": 4 blocks each, more than the GPU holds at once beside the other ranks'
    launches: on a GPU every rank hangs; here every rank raises within the (short) timeout, a
    block that could not become resident saying so."""
    from pycollectives.backends.cuda.residency import GpuShare, plan_residency

    n, r = mpi.size, mpi.rank
    chosen = plan_residency([GpuShare(bytes(16), 8, 1, 8)] * n, 4, "kernel")
    assert (chosen.mode, chosen.blocks) == ("kernel", 8 // n), chosen
    blocks = chosen.blocks if checked == "checked" else 4
    timeout = 30.0 if checked == "checked" else 1.5
    dev = EmulatedDevice(
        mpi, mode, "small", blocks=blocks, timeout=timeout, sms=8, gpus=[0] * n, previous_late_ms=2
    )
    calls = [("all_reduce", 5000), ("all_gather", 900), ("all_reduce", 3), ("broadcast", 4000),
             ("reduce_scatter", 1200), ("all_reduce", 700)] * 3  # fmt: skip
    if checked != "checked":
        everyone = raised_everywhere(
            mpi, lambda: run_checked(dev, mpi, "all_reduce", np.dtype(np.float32), 5000, None, 0)
        )
        if r == 0:
            assert all(s is not None for s, _ in everyone), everyone
            assert any("could not become resident" in s for s, _ in everyone), everyone
            assert max(t for _, t in everyone) < 4 * timeout, everyone
            say(f"residency unchecked ranks={n}: every rank raised, the last after "
                f"{max(t for _, t in everyone):.1f} s")  # fmt: skip
        return
    for i, (collective, count) in enumerate(calls):
        if i % n == r:
            time.sleep(0.005)  # this rank late
        run_checked(dev, mpi, collective, np.dtype(np.float32), count, None, i)
    if r == 0:
        say(f"residency checked ranks={n}: {len(calls)} calls, {blocks} blocks each")


def barrier(mpi, mode):
    """The device's barrier (CudaComm's: a launch that only compares the call in kernel mode, a
    meeting on the host flags in stepped mode): no rank leaves before the last has arrived, calls
    between barriers are right, and a barrier against another rank's collective raises
    CollectiveMismatch on every rank, bounded."""
    dev = EmulatedDevice(mpi, mode, "small", blocks=3, timeout=5.0)
    r, n = mpi.rank, mpi.size
    for i in range(3):
        time.sleep(0.1 * ((r + i) % n))
        arrived = time.monotonic()
        dev.barrier()
        left = time.monotonic()
        times = mpi.allgather((arrived, left))
        assert min(t for _, t in times) >= max(a for a, _ in times), times
        run_checked(dev, mpi, "all_reduce", np.dtype(np.float32), 1000 * (i + 1), None, i)
    bad = EmulatedDevice(mpi, mode, "small", blocks=3, timeout=5.0)
    x = np.ones(64, np.float32)
    everyone = raised_everywhere(mpi, lambda: bad.barrier() if r == 0 else bad.all_reduce(x))
    assert all(s is not None and s.startswith("CollectiveMismatch") for s, _ in everyone), everyone
    assert all("barrier" in s for s, _ in everyone), everyone
    say(f"barrier {mode} ranks={n}: 3 barriers right, a mismatch raised everywhere in "
        f"{max(t for _, t in everyone):.2f} s")  # fmt: skip


# The special COLLECTIVE values: each runs as fn(mpi, mode, collective, staging).
SPECIAL = {
    "one_rank": lambda mpi, mode, _c, _s: one_rank(mpi, mode),
    "barrier": lambda mpi, mode, _c, _s: barrier(mpi, mode),
    "shapes": lambda mpi, mode, _c, _s: shapes(mpi, mode),
    "replay": lambda mpi, mode, _c, _s: replay(mpi, mode),
    "grid": lambda mpi, mode, _c, _s: grid(mpi, mode),
    "replay_order": lambda mpi, _m, _c, _s: replay_order(mpi),
    "resize": lambda mpi, mode, _c, _s: resize(mpi, mode),
    "headers": lambda mpi, mode, _c, _s: headers(mpi, mode),
    "split_mismatch": lambda mpi, mode, _c, _s: split_mismatch(mpi, mode),
    "gate": lambda mpi, mode, _c, _s: gate(mpi, mode),
    "stepped_scratch": lambda mpi, mode, _c, _s: stepped_scratch(mpi, mode),
    "stepped_scratch_after_steps": lambda mpi, mode, _c, _s: stepped_scratch_after_steps(mpi, mode),
    "launch_end": lambda mpi, mode, _c, _s: launch_end(mpi, mode),
    "stepped_events": lambda mpi, mode, _c, events: stepped_events(mpi, mode, events),
    "previous_stream": lambda mpi, mode, _c, staging: previous_stream(mpi, mode, int(staging)),
    "residency": lambda mpi, mode, _c, checked: residency(mpi, mode, checked),
    **{c: (lambda mpi, mode, c, _s: new_collectives(mpi, mode, c)) for c in NEW_COLLECTIVES},
    **{c: faults for c in ("dead_peer", "timeout", "mismatch", "dies_mid", "stalls_mid")},
    **{c: (lambda mpi, mode, c, _s: LL_TESTS[c](mpi, mode)) for c in LL_TESTS},
}


def main():
    mode, collective = sys.argv[1], sys.argv[2]
    staging = sys.argv[3] if len(sys.argv) > 3 else "default"
    algos = (sys.argv[4] if len(sys.argv) > 4 else "ring,tree,direct,auto").split(",")
    blocks = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    mpi = MPI.COMM_WORLD
    if collective in SPECIAL:
        SPECIAL[collective](mpi, mode, collective, staging)
    else:
        matrix(mpi, mode, collective, staging, algos, blocks)


if __name__ == "__main__":
    run_main(main)
