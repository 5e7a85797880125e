"""``--device cuda``: cupy arrays on each rank's GPU, the GPU memory bound, and the GPU peers
(NCCL; MPI through host memory, as an mpi4py user would write it).

Every rank uses device ``local_rank % device_count``, or ``PYCOLL_DEVICE``, the device
pycollectives' CUDA transport picks for it. ``open_device`` checks on every rank that CUDA,
cupy and the dtype can be used, and raises ``Unusable`` with one line saying why not (the same
on every rank). ``benchmarks/gpu_bench.py`` shares ``hbm_copy_bandwidth``, ``staged_runner``
and ``torch_nccl``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from pycollectives.backends.cuda import choose_device
from pycollectives.backends.cuda.env import cuda_status
from pycollectives.bench import peers
from pycollectives.bench.timing import max_over_ranks, time_back_to_back, time_synchronised
from pycollectives.runtime.bootstrap import MpiGroup

REDUCING = ("all_reduce", "reduce_scatter", "reduce")
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}  # ncclRedOp_t
NCCL_TYPES = {  # ncclDataType_t
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "int64": 4,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
NCCL_2_10 = 21000  # the first NCCL with avg and bfloat16 (NCCL_VERSION_CODE)


class Unusable(Exception):
    """--device cuda cannot run here; the message is one line saying why."""


@dataclass
class Device:
    """This rank's GPU, as the benchmark uses it."""

    cp: object  # the cupy module
    index: int
    name: str
    devices: list = field(default_factory=list)  # every rank's device index

    # Sweep's array backend (see cli.HostArrays): cupy arrays on this rank's current device.
    def empty(self, n: int, dt: np.dtype):
        return self.cp.empty(n, dt)

    def put(self, dst, src: np.ndarray):
        dst.set(np.ascontiguousarray(src))

    def host(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)  # waits for the work queued on the current stream

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def release(self):
        self.cp.get_default_memory_pool().free_all_blocks()


def local_rank(mpi) -> int:
    """This rank's index among the ranks of its machine (collective)."""
    return MpiGroup(mpi, dup=False).local()[0]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def open_device(mpi, dt: np.dtype) -> Device:
    """Makes this rank's GPU cupy's current device, after checking on every rank that CUDA,
    cupy and `dt` can be used there. Collective; raises Unusable on every rank if any rank
    cannot, naming the ranks and why."""
    local = local_rank(mpi)
    error, dev = None, None
    try:
        state, why = cuda_status()
        if state != "ok":
            raise Unusable(why)
        try:
            import cupy as cp
        except ImportError as e:
            raise Unusable(f"cupy is not installed ({e}); pip install cupy-cuda12x") from None
        index = choose_device(None, local, cp.cuda.runtime.getDeviceCount())
        cp.cuda.Device(index).use()
        try:
            cp.empty(1, dt)
        except (TypeError, ValueError):
            raise Unusable(f"cupy {cp.__version__} cannot make {dt.name} arrays") from None
        props = cp.cuda.runtime.getDeviceProperties(index)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        dev = Device(cp, index, name)
    except Unusable as e:
        error = str(e)
    except Exception as e:  # a broken cupy, a bad PYCOLL_DEVICE, ...: every rank hears of it
        error = _first_line(e)
    errors = mpi.allgather(error)
    if any(errors):
        by_msg: dict = {}
        for r, msg in enumerate(errors):
            if msg:
                by_msg.setdefault(msg, []).append(r)
        raise Unusable("; ".join(f"{_ranks(rs)}: {msg}" for msg, rs in by_msg.items()))
    dev.devices = mpi.allgather(dev.index)
    return dev


def hbm_copy_bandwidth(cp, nbytes: int = 1 << 30, repeats: int = 5, mpi=None) -> float:
    """Bytes per second moved through GPU memory (read + write) by `repeats` device-to-device
    copies of `nbytes` on the current device. With `mpi`, every rank starts at once and the
    slowest rank's time counts (ranks sharing a GPU then share its bandwidth)."""
    a, b = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    b.data.copy_from_device(a.data, nbytes)
    cp.cuda.runtime.deviceSynchronize()
    if mpi is not None:
        mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        b.data.copy_from_device(a.data, nbytes)
    cp.cuda.runtime.deviceSynchronize()
    elapsed = time.perf_counter() - t0
    if mpi is not None:
        elapsed = mpi.allreduce(elapsed, op=_mpi_op("MAX"))
    return 2 * nbytes * repeats / elapsed


def copy_bandwidth(mpi, dev: Device, tries: int = 3) -> float:
    """GB/s of a device-to-device copy one rank gets while every rank copies at once: the B of
    formulas.bound_time on the GPU (ranks that share a GPU share its memory bandwidth)."""
    cp = dev.cp
    share = dev.devices.count(dev.index)
    free = mpi.allreduce(int(cp.cuda.runtime.memGetInfo()[0]), op=_mpi_op("MIN"))
    nbytes = max(1 << 20, min(1 << 30, free // (4 * share)) >> 20 << 20)
    best = max(hbm_copy_bandwidth(cp, nbytes, 5, mpi) for _ in range(tries))
    dev.release()
    return best / 2 / 1e9  # a copy of B bytes/s moves 2B bytes/s of traffic


def staged_runner(mpi, coll: str, op: str, root: int, dt: np.dtype):
    """What an mpi4py user writes for GPU arrays: copy to host, MPI's collective, copy the
    result back (where the collective defines one). A callable like peers.mpi_runner's (on
    cupy arrays), or the reason it cannot run."""
    host = peers.mpi_runner(mpi, coll, op, root, dt)
    if isinstance(host, str):
        return host
    bufs: dict = {}

    def buf(name, a):
        b = bufs.get(name)
        if b is None or b.size != a.size:
            b = bufs[name] = np.empty(a.size, dt)
        return b

    has_result = coll not in ("reduce", "gather") or mpi.rank == root

    def run(x, out, in_place):
        hx, ho = buf("x", x), buf("out", out)
        x.get(out=hx)
        if in_place and coll == "all_gather":
            out.get(out=ho)  # this rank's block is already in place
        host(hx, ho, in_place)
        if coll == "broadcast" or (in_place and coll in ("all_reduce", "reduce")):
            if has_result:
                x.set(hx)
        elif has_result:
            out.set(ho)

    return run


def nccl_version(code: int) -> str:
    """The version "2.21.5" from NCCL_VERSION_CODE 22105 (before 2.9: 2708 for 2.7.8)."""
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def torch_nccl(mpi, device: int, timeout: float = 60.0):
    """A torch.distributed NCCL group over the ranks of `mpi` on `device`, checked with one
    all-reduce: ((torch, dist), "NCCL x.y.z (torch)") or (None, why not), alike on every rank.
    """
    os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    error = None
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        error = "torch is not installed"
    else:
        if not torch.cuda.is_available():
            error = f"torch {torch.__version__} cannot use CUDA"
        elif not dist.is_nccl_available():
            error = f"torch {torch.__version__} was built without NCCL"
    errors = [e for e in mpi.allgather(error) if e]
    if errors:
        return None, errors[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000 if mpi.rank == 0 else 0))
    os.environ["MASTER_PORT"] = mpi.bcast(os.environ["MASTER_PORT"])
    try:
        import datetime

        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            rank=mpi.rank,
            world_size=mpi.size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    except Exception as e:  # NCCL refuses ranks that share a GPU in many versions
        error = _first_line(e)
    errors = [e for e in mpi.allgather(error) if e]
    if errors:
        if dist.is_initialized():  # the group exists even where NCCL refused its first call
            dist.destroy_process_group()
        return None, errors[0]
    v = torch.cuda.nccl.version()
    v = ".".join(map(str, v)) if isinstance(v, tuple) else nccl_version(int(v))
    return (torch, dist), f"NCCL {v} (torch {torch.__version__})"


class Nccl:
    """NCCL on the same ranks, GPUs and cupy buffers: cupy.cuda.nccl, or torch.distributed's
    nccl backend where cupy has no NCCL. ``runner`` gives a callable like peers.mpi_runner's,
    or why NCCL cannot run it; ``what`` says which NCCL (or why none). Collective."""

    def __init__(self, mpi, dev: Device, timeout: float = 60.0):
        # NCCL reads it when a communicator is made: several ranks may share one GPU.
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        self.mpi, self.dev, self.cp = mpi, dev, dev.cp
        self.comm, self.torch, self.reason, self.what = None, None, None, ""
        nccl, why = _cupy_nccl(self.cp)
        missing = [w for w in mpi.allgather(why) if w]
        if not missing:
            self.nccl = nccl
            self.reason = self._open(timeout)
            self.what = self.reason or f"NCCL {nccl_version(nccl.get_version())} (cupy)"
            return
        got, what = torch_nccl(mpi, dev.index, timeout)
        if got is None:
            self.reason = self.what = f"{missing[0]}; torch.distributed: {what}"
            return
        self.torch, self.what = got, what
        self.version = tuple(int(p) for p in what.split()[1].split(".")[:2])

    def _open(self, timeout: float) -> str | None:
        """Makes the NCCL communicator and runs a 1-element all-reduce, bounded by `timeout`;
        None, or why it failed (on any rank)."""
        cp, nccl, mpi = self.cp, self.nccl, self.mpi
        uid, error, comm = None, None, None
        if mpi.rank == 0:
            try:
                uid = nccl.get_unique_id()
            except Exception as e:
                error = _first_line(e)
        uid, error = mpi.bcast((uid, error))
        if error:
            return f"NCCL: {error}"
        try:
            comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
            x = cp.ones(1, cp.float32)
            stream = cp.cuda.get_current_stream()
            comm.allReduce(x.data.ptr, x.data.ptr, 1, NCCL_TYPES["float32"], 0, stream.ptr)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
            deadline = time.monotonic() + timeout
            while not done.done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a 1-element all-reduce did not finish in {timeout:.0f} s")
                time.sleep(0.001)
            if float(x[0]) != mpi.size:
                raise RuntimeError(f"a 1-element all-reduce gave {float(x[0])}, not {mpi.size}")
        except Exception as e:
            error = _first_line(e)
        errors = [e for e in mpi.allgather(error) if e]
        if errors:
            if comm is not None:
                try:
                    comm.abort()  # unblocks kernels still waiting for a peer
                except Exception:
                    comm.destroy()
            return f"NCCL: {errors[0]}"
        self.comm = comm
        return None

    def _refusal(self, coll, op, dt, newer: bool) -> str | None:
        if coll in REDUCING and op == "avg" and not newer:
            return f"{self.what} has no avg (NCCL 2.10+)"
        if dt.name == "bfloat16" and not newer:
            return f"{self.what} has no bfloat16 (NCCL 2.10+)"
        if dt.name not in NCCL_TYPES:
            return f"NCCL has no {dt.name}"
        return None

    def runner(self, coll: str, op: str, root: int, dt: np.dtype):
        if self.reason:
            return self.reason
        if self.torch is not None:
            return self._torch_runner(coll, op, root, dt)
        why = self._refusal(coll, op, dt, self.nccl.get_version() >= NCCL_2_10)
        if why:
            return why
        c, rank, size = self.comm, self.mpi.rank, dt.itemsize
        ndt, nop = NCCL_TYPES[dt.name], NCCL_OPS.get(op, 0)
        s = self.cp.cuda.get_current_stream().ptr  # where Sweep synchronises

        def run(x, out, in_place):
            xp, op_ = x.data.ptr, out.data.ptr
            if coll == "all_reduce":
                c.allReduce(xp, xp if in_place else op_, x.size, ndt, nop, s)
            elif coll == "all_gather":
                send = op_ + rank * x.size * size if in_place else xp
                c.allGather(send, op_, x.size, ndt, s)
            elif coll == "reduce_scatter":
                recv = xp + rank * out.size * size if in_place else op_
                c.reduceScatter(xp, recv, out.size, ndt, nop, s)
            elif coll == "broadcast":
                c.broadcast(xp, xp, x.size, ndt, root, s)
            else:
                c.reduce(xp, xp if in_place else op_, x.size, ndt, nop, root, s)

        return run

    def _torch_runner(self, coll, op, root, dt):
        torch, dist = self.torch
        why = self._refusal(coll, op, dt, self.version >= (2, 10))
        if why:
            return why
        rop = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
            "avg": getattr(dist.ReduceOp, "AVG", None),
        }[op]
        if rop is None and coll in REDUCING:
            return f"torch {torch.__version__} has no ReduceOp.AVG"
        where = f"cuda:{self.dev.index}"
        last: list = [None, None, None, None]  # x, out and their tensors (Sweep reuses them)

        def tensors(x, out):
            if last[0] is not x or last[1] is not out:  # zero-copy views of the cupy arrays
                tx, tout = torch.as_tensor(x, device=where), torch.as_tensor(out, device=where)
                last[:] = [x, out, tx, tout]
            return last[2], last[3]

        def run(x, out, in_place):
            tx, tout = tensors(x, out)
            if coll == "all_reduce":
                if not in_place:
                    tout.copy_(tx)  # torch's all_reduce is in place only
                dist.all_reduce(tx if in_place else tout, op=rop)
            elif coll == "all_gather":
                n = tx.numel()
                send = tout[self.mpi.rank * n : (self.mpi.rank + 1) * n] if in_place else tx
                dist.all_gather_into_tensor(tout, send)
            elif coll == "reduce_scatter":
                dist.reduce_scatter_tensor(tout, tx, op=rop)
            elif coll == "broadcast":
                dist.broadcast(tx, src=root)
            else:
                if not in_place:
                    tout.copy_(tx)
                dist.reduce(tx if in_place else tout, dst=root, op=rop)

        run.sync = torch.cuda.synchronize  # torch's NCCL runs on streams of its own
        return run

    def close(self):
        if self.comm is not None:
            self.dev.sync()
            self.comm.destroy()
            self.comm = None
        if self.torch is not None:
            self.torch[1].destroy_process_group()
            self.torch = None
        self.mpi.Barrier()


def _cupy_nccl(cp):
    """(cupy.cuda.nccl, None), or (None, why cupy has no NCCL)."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        return None, f"cupy {cp.__version__} has no NCCL ({e})"
    if not getattr(nccl, "available", False):
        return None, f"cupy {cp.__version__} found no NCCL library"
    return nccl, None


def _mpi_op(name: str):
    from mpi4py import MPI

    return getattr(MPI, name)


# -- Timing and floors for benchmarks/gpu_bench.py -------------------------------------------

# What no collective can beat: an empty kernel launched (and synchronised), and one flag
# carried from one process's kernel to another's and back through CUDA IPC memory. Compiled at
# run time by cupy (NVRTC). The flag stores and loads are the transport's own: release/acquire
# at system scope on 64-bit counters that only grow, so a launch never has to reset them.
FLOORS_SOURCE = r"""
extern "C" __global__ void pycoll_empty() {}

__device__ __forceinline__ unsigned long long pycoll_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long pycoll_load(unsigned long long p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void pycoll_store(unsigned long long p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One thread. `mine` is this rank's flag, `peer` the other rank's (IPC-mapped); the rank with
// `first` set sends, the other echoes, `rounds` times, counting on from `base`. out[0]: rounds
// done (fewer if a wait ran past timeout_ns), out[1]: ns from the end of the first round to the
// end of the last (the first absorbs the two launches' skew).
extern "C" __global__ void pycoll_ping_pong(unsigned long long mine, unsigned long long peer,
                                            unsigned long long base, int rounds, int first,
                                            unsigned long long timeout_ns,
                                            unsigned long long* out) {
  const unsigned long long start = pycoll_now();
  unsigned long long t1 = start;
  int done = 0;
  for (int i = 1; i <= rounds; ++i) {
    const unsigned long long v = base + i;
    if (first) pycoll_store(peer, v);
    while (pycoll_load(mine) < v) {
      if (pycoll_now() - start > timeout_ns) {
        out[0] = done;
        out[1] = 0;
        return;
      }
    }
    if (!first) pycoll_store(peer, v);
    done = i;
    if (i == 1) t1 = pycoll_now();
  }
  out[0] = done;
  out[1] = pycoll_now() - t1;
}
"""


@dataclass
class Floors:
    """The floors of one run (seconds; ping_pong None where it could not run, `why` says)."""

    launch_sync: float  # an empty kernel launched, then its stream synchronised
    launch_b2b: float  # per empty kernel, many launched back to back and synchronised once
    ping_pong: float | None  # one flag round trip between two processes' kernels (IPC)
    why: str = ""


def measure_floors(mpi, cp, kernel_mode: bool, iters: int = 200, calls: int = 200,
                   rounds: int = 2000, timeout_s: float = 5.0) -> Floors:  # fmt: skip
    """The floors on every rank at once, timed as gpu_bench times a collective. The ping-pong
    runs between ranks 0 and 1 only, and only where their kernels run side by side
    (`kernel_mode`: GPUs of their own, or MPS); every rank returns the same Floors."""
    module = cp.RawModule(code=FLOORS_SOURCE)
    empty = module.get_function("pycoll_empty")
    stream = cp.cuda.get_current_stream()

    def launch():
        empty((1,), (1,), ())

    launch()
    stream.synchronize()
    sync = time_synchronised(mpi, launch, stream.synchronize, iters)
    b2b = time_back_to_back(mpi, launch, stream.synchronize, calls)
    if mpi.size < 2:
        return Floors(sync, b2b, None, "one rank: no peer to signal")
    if not kernel_mode:
        return Floors(sync, b2b, None, "ranks time-slice one GPU (no MPS): kernels cannot "
                                       "wait for each other")  # fmt: skip
    per_round, why = _ping_pong(mpi, cp, module.get_function("pycoll_ping_pong"), rounds,
                                timeout_s)  # fmt: skip
    return Floors(sync, b2b, per_round, why)


def graph_per_call(mpi, cp, comm, calls: int = 100, reps: int = 5):
    """(seconds per call, "") of 8 B all-reduces through `comm` (a Communicator) captured into
    one CUDA graph of `calls` and launched `reps` times, the slowest rank's median; or (None,
    why not). Kernel mode only: stepped mode refuses to be captured."""
    error, per = None, []
    s = cp.cuda.Stream(non_blocking=True)
    x, out = cp.ones(2, cp.float32), cp.empty(2, cp.float32)
    try:
        with s:
            comm.all_reduce(x, out)  # the shape's plan is built outside the capture
        s.synchronize()
        s.begin_capture()
        try:
            with s:
                for _ in range(calls):
                    comm.all_reduce(x, out)
        finally:
            graph = s.end_capture()
        graph.launch(stream=s)
        s.synchronize()
        for _ in range(reps):
            mpi.Barrier()
            t0 = time.perf_counter()
            graph.launch(stream=s)
            s.synchronize()
            per.append((time.perf_counter() - t0) / calls)
    except Exception as e:  # reported; the rest of the benchmark goes on
        error = _first_line(e)
    errors = [e for e in mpi.allgather(error) if e]
    if errors:
        return None, errors[0]
    return max_over_ranks(mpi, float(np.median(per))), ""


def _ping_pong(mpi, cp, kernel, rounds: int, timeout_s: float):
    """(seconds per round trip, "") between ranks 0 and 1, or (None, why not). Every step
    that can fail on one rank is followed by an exchange of errors, so no rank is left in a
    collective the others skipped."""
    rt = cp.cuda.runtime
    state: dict = {"flag": None, "peer": None, "times": []}
    out = cp.zeros(2, cp.uint64)

    def step(fn):
        error = None
        try:
            fn()
        except Exception as e:  # reported, and the benchmark goes on without this floor
            error = _first_line(e)
        errors = [e for e in mpi.allgather(error) if e]
        return f"ping-pong: {errors[0]}" if errors else ""

    def allocate():
        state["flag"] = rt.malloc(8)  # its own allocation: an IPC handle names a whole one
        rt.memset(state["flag"], 0, 8)
        rt.deviceSynchronize()

    def open_peer():
        if mpi.rank < 2:  # lazy peer access (cudaIpcMemLazyEnablePeerAccess)
            state["peer"] = rt.ipcOpenMemHandle(handles[1 - mpi.rank], 1)

    def run(base):
        if mpi.rank >= 2:
            return
        args = (np.uint64(state["flag"]), np.uint64(state["peer"]), np.uint64(base),
                np.int32(rounds), np.int32(mpi.rank == 0), np.uint64(int(timeout_s * 1e9)),
                out)  # fmt: skip
        kernel((1,), (1,), args)
        done, ns = (int(v) for v in out.get())
        if done != rounds:
            raise TimeoutError(f"rank {mpi.rank} saw {done} of {rounds} rounds in {timeout_s:g} s")
        state["times"].append(ns * 1e-9 / (rounds - 1))

    why = step(allocate)
    handles = None
    if not why:
        handles = mpi.allgather(rt.ipcGetMemHandle(state["flag"]))
        why = step(open_peer)
    for base in (0, rounds):  # the first launch warms up, the second is timed
        if why:
            break
        mpi.Barrier()
        why = step(lambda b=base: run(b))

    def release():
        if state["peer"] is not None:
            rt.ipcCloseMemHandle(state["peer"])

    step(release)  # every peer has unmapped this rank's flag before it is freed
    if state["flag"] is not None:
        rt.free(state["flag"])
    if why:
        return None, why
    return max_over_ranks(mpi, state["times"][-1] if state["times"] else 0.0), ""
