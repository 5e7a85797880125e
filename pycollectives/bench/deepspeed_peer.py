"""``--compare deepspeed``: DeepSpeed's shared-memory all-reduce on its CPU accelerator.

What DeepSpeed 0.19 does on CPU without oneccl_bindings_for_pytorch (read from its source):

* ``DS_ACCELERATOR=cpu`` picks ``CPU_Accelerator``, whose communication backend is gloo;
  ``deepspeed.comm.init_distributed`` then makes a ``TorchBackend`` over torch.distributed.
* ``TorchBackend.__init__`` JIT-builds ``ShareMemCommBuilder`` (``deepspeed_shm_comm``:
  csrc/cpu/comm/shm_interface.cpp and shm.cpp, ``-O2 -fopenmp``, ninja and g++, cached by
  torch under ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), prints
  "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" and calls its
  ``initialize``, which maps the shared-memory segments only when ``LOCAL_SIZE`` equals the
  world size (their names carry ``MASTER_ADDR`` and ``MASTER_PORT``).
* Only ``deepspeed.comm.inference_all_reduce`` takes that path
  (``torch.ops.deepspeed.inference_all_reduce_``), and only for float32 (needs AVX2) and
  float16/bfloat16 (need AVX-512BW); it always sums, on the whole world. Everything else
  (``all_reduce``, ``all_gather``, ``reduce_scatter``, other dtypes) is torch.distributed
  over gloo, so this peer offers only the shared-memory all-reduce.
* Each rank's segment (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``,
  66 MiB) is never unlinked by DeepSpeed; this peer unlinks them once every rank has mapped
  them, so nothing is left behind.

``DeepSpeed(mpi)`` sets DeepSpeed's environment from the MPI ranks, builds (or loads) the op
before any timing, checks the path is really taken (the op is registered and a probe's input
is found in this rank's segment) and says so in ``what``; ``reason`` says why it cannot run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import socket
import time

import numpy as np

from pycollectives.runtime.bootstrap import MpiGroup

# What DeepSpeed reads from the environment (torch's env:// rendezvous and shm.cpp).
ENV = ("DS_ACCELERATOR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
ENV += ("LOCAL_SIZE",)
# The shm kernels' dtypes and the vector_kernel_level each needs (1: AVX2, 2: AVX-512BW).
SHM_DTYPES = {"float32": 1, "float16": 2, "bfloat16": 2}
ISA = {0: "neither AVX2 nor AVX-512BW", 1: "AVX2 but not AVX-512BW", 2: "AVX-512BW"}
# shm_interface.cpp keeps the byte count in an int.
MAX_BYTES = (1 << 31) - 1
BUILT = "deepspeed_shm_comm_op built successfully"


def _agree(mpi, why):
    """The first rank's reason on every rank (None when no rank has one)."""
    whys = mpi.allgather(why)
    for rank, w in enumerate(whys):
        if w:
            return w if mpi.size == 1 or whys.count(w) == len(whys) else f"rank {rank}: {w}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class DeepSpeed:
    """deepspeed.comm.inference_all_reduce (shared memory) on the same ranks and buffers."""

    def __init__(self, mpi):
        self.mpi, self.reason, self.what, self.log = mpi, None, "", []
        self.saved = {k: os.environ.get(k) for k in ENV}
        self.segments, self.own_pg, self.level = [], False, 0
        why = None
        if mpi.size < 2:
            why = "deepspeed's shm all-reduce needs 2 or more ranks (on one it returns at once)"
        elif importlib.util.find_spec("torch") is None:
            why = "torch is not installed"
        elif importlib.util.find_spec("deepspeed") is None:
            why = "deepspeed is not installed (pip install deepspeed)"
        elif MpiGroup(mpi, dup=False).local()[1] != mpi.size:
            why = "deepspeed's shm all-reduce needs every rank on one host (LOCAL_SIZE=WORLD_SIZE)"
        self.reason = _agree(mpi, why)
        if self.reason:
            return
        try:
            self.reason = self._open()
        except Exception as e:
            self.reason = f"deepspeed failed: {type(e).__name__}: {e}".splitlines()[0]
        self.reason = _agree(mpi, self.reason)
        if self.reason:
            self.close()

    def _open(self):
        mpi, rank, n = self.mpi, self.mpi.rank, self.mpi.size
        port = mpi.bcast(_free_port() if rank == 0 else None)
        addr = "127.0.0.1"
        env = dict(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
        env.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_SIZE=str(n))
        os.environ.update(env)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            import deepspeed
            import deepspeed.comm as dist
            import torch
            from deepspeed.accelerator import get_accelerator

            accel = get_accelerator()
        self.torch, self.dist = torch, dist
        why = None
        if accel._name != "cpu":
            why = f"deepspeed's accelerator is {accel._name}, not cpu (imported before this peer)"
        elif accel.communication_backend_name() != "gloo":
            why = (
                f"deepspeed's cpu backend is {accel.communication_backend_name()} "
                "(oneccl_bindings_for_pytorch is installed): not its torch backend's shm path"
            )
        why = _agree(mpi, why)
        if why:
            return why
        # The JIT build, rank 0 first (torch's lock file would leave the others waiting on a
        # stale lock if a build were killed), the others asleep meanwhile (MPI's waits spin,
        # taking a core from the compiler); TorchBackend finds the op loaded afterwards.
        builder = accel.create_op_builder("ShareMemCommBuilder")
        t0, why = time.perf_counter(), None
        for turn in (True, False):
            if turn == (rank == 0):
                try:
                    with contextlib.redirect_stdout(out):
                        if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
                            why = f"deepspeed says {builder.NAME} is not compatible here"
                        else:
                            builder.load()
                except Exception as e:
                    why = f"building {builder.NAME} failed: {type(e).__name__}: {e}"
                    why = why.splitlines()[0]
            done = mpi.Ibarrier()
            while not done.Test():
                time.sleep(0.01)
            why = _agree(mpi, why)
            if why:
                return why
        build_s = time.perf_counter() - t0
        # init_distributed, its log lines captured (DeepSpeed's logger prints WARNING and up).
        logger, cap = logging.getLogger("DeepSpeed"), _Capture()
        level, handlers = logger.level, logger.handlers[:]
        logger.handlers, self.own_pg = [cap], not torch.distributed.is_initialized()
        logger.setLevel(logging.INFO)
        try:
            with contextlib.redirect_stdout(out):
                dist.init_distributed(
                    dist_backend="gloo", auto_mpi_discovery=False, rank=rank, world_size=n
                )
        finally:
            logger.handlers = handlers
            logger.setLevel(level)
        self.log = out.getvalue().splitlines() + cap.lines
        # Proof that inference_all_reduce takes the shm path: the conditions TorchBackend
        # checks, then a probe whose input must turn up in this rank's segment.
        cdb = dist.comm.cdb
        self.level = getattr(cdb, "shm_vector_kernel_level", 0)
        uid = os.getuid()
        self.segments = [
            f"/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{r}" for r in range(n)
        ]
        why = None
        if type(cdb).__name__ != "TorchBackend" or getattr(cdb, "shm_comm_op", None) is None:
            why = f"deepspeed's backend {type(cdb).__name__} has no shm op"
        elif not hasattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_"):
            why = "torch.ops.deepspeed.inference_all_reduce_ is not registered"
        elif self.level < 1:
            why = f"this CPU has {ISA[self.level]}: every shm kernel would fall back to gloo"
        elif not all(map(os.path.exists, self.segments)):
            why = "deepspeed mapped no shm segments (LOCAL_SIZE != WORLD_SIZE?)"
        else:
            k = 256
            x = torch.full((k,), 1000.0 + rank)
            dist.inference_all_reduce(x)
            want = sum(1000.0 + r for r in range(n))
            # shm.cpp's workspace: 2 int states, then the two 1 MiB small-message buffers.
            seg = self.segments[rank]
            mine = [np.fromfile(seg, np.float32, k, offset=8 + b * (1 << 20)) for b in (0, 1)]
            if not bool((x == want).all()):
                why = f"deepspeed's shm all-reduce probe gave {x[0].item()}, not {want}"
            elif not any(bool((m == 1000.0 + rank).all()) for m in mine):
                why = "the probe's input is not in deepspeed's shm segment (not the shm path?)"
        why = _agree(mpi, why)
        mpi.Barrier()  # every rank has mapped every segment: the names can go
        self._unlink()
        if why:
            return why
        built = next((line.strip() for line in self.log if BUILT in line), None)
        if built is None:
            return f"deepspeed did not print '{BUILT}'"
        so = getattr(cdb.shm_comm_op, "__file__", "?")
        dtypes = [d for d, need in SHM_DTYPES.items() if self.level >= need]
        self.what = (
            f"deepspeed {deepspeed.__version__}, cpu accelerator, torch.distributed "
            f"{torch.distributed.get_backend()}; shm all-reduce (deepspeed_shm_comm) active: "
            f"'{built}', {so} loaded in {build_s:.1f} s, torch.ops.deepspeed."
            f"inference_all_reduce_ registered, LOCAL_SIZE=WORLD_SIZE={n}, probe passed through "
            f"/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_<rank>; {ISA[self.level]}:"
            f" {'/'.join(dtypes)} sum only; {torch.get_num_threads()} OpenMP thread(s) per rank"
        )
        return None

    def runner(self, coll, op, root, dt):
        if self.reason:
            return self.reason
        if coll != "all_reduce":
            return f"deepspeed's shm path has no {coll} (it would be torch.distributed over gloo)"
        if op != "sum":
            return f"deepspeed's shm all-reduce only sums (inference_all_reduce ignores op {op})"
        need = SHM_DTYPES.get(dt.name)
        if need is None:
            return f"deepspeed's shm all-reduce has no {dt.name} (it would be gloo)"
        if self.level < need:
            return (
                f"deepspeed's shm {dt.name} kernel needs AVX-512BW, this CPU has {ISA[self.level]}"
            )
        torch, ds = self.torch, self.dist
        if dt.name == "bfloat16":  # numpy's (ml_dtypes) bfloat16 seen as torch's, no copy

            def tensor(a):
                return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy

        def run(x, out, in_place):
            if x.nbytes > MAX_BYTES:
                raise ValueError("deepspeed's shm all-reduce counts bytes in an int (< 2 GiB)")
            t = tensor(x if in_place else out)
            if not in_place:
                t.copy_(tensor(x))
            ds.inference_all_reduce(t)

        return run

    def close(self):
        if getattr(self, "dist", None) is not None and self.dist.comm.cdb is not None:
            self.mpi.Barrier()
            if self.own_pg and self.torch.distributed.is_initialized():
                self.torch.distributed.destroy_process_group()
                self.dist.comm.cdb = None  # so that a later DeepSpeed(mpi) initializes again
        self._unlink()
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def _unlink(self):
        """This rank's segment (the mappings stay valid; DeepSpeed never unlinks it)."""
        if self.segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.segments[self.mpi.rank])
