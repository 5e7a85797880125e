"""Collectives on CUDA device memory: the CUDA IPC transport.

``CudaComm`` is the GPU counterpart of the host communicator; ``Communicator`` hands it GPU
arrays (cupy, torch CUDA tensors, anything with ``__cuda_array_interface__`` or a CUDA
``__dlpack__``). Each rank uses the device chosen with ``device=`` or ``PYCOLL_DEVICE``; without
either, the device of the arrays the communicator is made for (``Communicator`` makes it for its
first GPU collective), else ``local_rank % device_count``. Arrays on another device than a
chosen one are an error on every rank, raised while the communicator is set up.

``cuda_status()`` says whether CUDA is usable, absent, or present but unusable (a GPU that
``nvidia-smi`` lists, with a driver too old for the CUDA runtime, say), and why.

Ranks that share one GPU without MPS cannot run kernels that wait for one another (the GPU
time-slices processes), so they run in the stepped mode: one short launch per step,
with the waiting done by the host between launches. Elsewhere one kernel runs the whole
collective. ``PYCOLL_CUDA_SYNC=kernel|stepped`` forces either.

Example (``mpiexec -n 2 python example.py``)::

    import cupy, pycollectives as pc
    from mpi4py import MPI
    from pycollectives.backends.cuda import CudaComm
    comm = CudaComm(MPI.COMM_WORLD, MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, timeout=60)
    x = cupy.full(1024, comm.rank, cupy.float32)
    comm.all_reduce(x, op=pc.SUM)   # in place, on cupy's current stream
"""

from __future__ import annotations

import sys
import warnings
import weakref

from pycollectives.backends import Call, gathered_or_raise, same_on_every_rank
from pycollectives.backends.cuda.args import described, gpu_array
from pycollectives.backends.cuda.env import (
    _native,
    arrays_device,
    choose_device,
    choose_sync_mode,
    cuda_available,
    mps_active,
)
from pycollectives.backends.cuda.residency import GpuShare, mps_sm_limit, plan_residency
from pycollectives.errors import CollectiveError
from pycollectives.ops import ALGORITHMS_FOR, SUM, algo_code, op_code
from pycollectives.options import Options, checked_timeout
from pycollectives.runtime import arrays
from pycollectives.runtime.bootstrap import as_group
from pycollectives.trace import flight
from pycollectives.work import InFlight, Work


class _CudaCompletion:
    """What a ``Work`` asks of a queued CUDA collective: an asynchronous one (``async_op=True``,
    queued on the communicator's stream behind the caller's stream), or a blocking one (kept
    until it has ended, so that its arrays live as long as the GPU reads them).

    ``wait()`` makes later work on the issuing stream wait for it (it does not block the host;
    synchronise the stream for that) and raises if an earlier device wait failed or a peer
    died. ``is_completed()`` asks the GPU whether it has finished: an event query, or, for a
    blocking call in kernel mode (one launch on the caller's stream, no event), a read of the
    word where the device reports each call's end.
    """

    __slots__ = ("_native", "_comm", "_stream")

    def __init__(self, native, comm, stream):
        self._native, self._comm, self._stream = native, comm, stream

    def wait(self, timeout: float | None = None) -> bool:
        c = self._comm._c
        if c is not None:
            c.check()  # an earlier device wait that failed, or a dead peer
        self._native.wait_on(self._stream)
        return True

    def is_completed(self) -> bool:
        return self._native.is_completed()

    @property
    def seq(self) -> int:
        return self._native.seq


class CudaComm:
    """Collectives on CUDA arrays between the ranks of `mpi_comm` (all on one machine).

    ``CudaComm(mpi_comm, rank, size, *, timeout, device=None, arrays=None)`` is collective:
    every rank exchanges its IPC handle, device UUID and flag segment in one MPI all-gather.

    The device is `device`, else ``PYCOLL_DEVICE``; without either, the device of `arrays`
    (the arrays of the collective the communicator is made for: ``Communicator`` passes those
    of its first GPU collective), else ``local_rank % device_count``. The device is decided
    and checked before anything is exchanged, and whatever fails on one rank (arrays on
    another device than the one chosen, or on two devices; no CUDA; ...) raises
    ``CollectiveError`` naming that rank on every rank, never a hang.

    Methods (codes as ``pycollectives.ops.op_code`` / ``algo_code`` return them; `stream` is an
    int handle, a cupy or torch stream, or None for the array library's current stream)::

        all_reduce(x, out, op, algorithm)                 # out None: in place
        reduce_scatter(x, out, op, counts, algorithm)     # x: size * out.size
        all_gather(x, out, counts, algorithm)             # out: size * x.size
        broadcast(x, root, algorithm)
        reduce(x, out, root, op, algorithm)               # out None: in place
        all_to_all(x, out, in_splits, out_splits, algorithm)
        gather(x, out, root, algorithm)                   # out: the root's only
        scatter(x, out, root, algorithm)                  # x: the root's only
        barrier()
        empty(shape, dtype) / zeros(shape, dtype)  # registered cupy arrays (collective)
        register(array)                            # registers an existing CUDA array
        close()

    These are ``Communicator``'s signatures: every collective also takes ``async_op=`` and
    ``stream=``, by keyword only. `counts` are each rank's block (uneven); ``all_to_all``
    splits are what this rank sends to / receives from each rank (None: even).

    Each returns the output array, or a ``pycollectives.Work`` with ``async_op=True``. The
    collective is ordered after the work already queued on the stream; without `async_op`,
    later work on that stream is ordered after it. The host does not wait for the GPU
    (synchronise the stream, or call ``barrier()``, for that). A device wait that runs past
    `timeout` (or sees a dead peer), and in kernel mode a call that does not match its peers'
    (compared on the device), poison the communicator: the next call raises
    ``CollectiveTimeout``, ``CollectiveError`` or ``CollectiveMismatch``.

    Tuning (environment): ``PYCOLL_CUDA_STAGING_BYTES`` (1 MiB), ``PYCOLL_CUDA_STAGING_SLOTS``
    (4), ``PYCOLL_CUDA_BLOCKS`` (16 blocks per launch; ``auto``: the GPU's SMs over the ranks
    that share it, at most 64), ``PYCOLL_CUDA_LL_BYTES`` (32 KiB: kernel
    mode's messages up to here in the LL format, data and flag in one store; 0: off),
    ``PYCOLL_CUDA_SYNC``, ``PYCOLL_ALGO``, ``PYCOLL_DEBUG=INFO``.
    """

    def __init__(
        self, mpi_comm, rank, size, *, timeout=None, device=None, arrays=None, options=None
    ):
        group = as_group(mpi_comm)
        options = Options.resolve(timeout=timeout) if options is None else options
        if timeout is not None and timeout != options.timeout:
            options = options.replace(timeout=float(timeout))
        timeout = options.timeout

        if (group.rank, group.size) != (rank, size):
            raise ValueError(
                f"rank/size {rank}/{size} do not match the communicator's {group.rank}/{group.size}"
            )
        self.rank, self.size = rank, size
        self._group = group
        self.device = None
        self._c = None
        self._inflight = InFlight()
        local_rank, node_size = group.local()
        self._forced = options.algorithm
        native, error, probe = None, None, None
        try:
            if node_size != size:
                raise CollectiveError(
                    f"the communicator spans several machines ({node_size} of its {size} ranks "
                    "share this one); the CUDA transport needs all ranks on one machine"
                )
            ok, why = cuda_available()
            if not ok:
                raise CollectiveError(f"CUDA is not available: {why}")
            cu = _native()
            on = None if arrays is None else arrays_device(arrays)
            ndev = cu.device_count()[0]
            self.device = choose_device(device, local_rank, ndev, arrays_device=on)
            sms = cu.sm_count(self.device)
            share = (
                bytes(cu.device_uuid(self.device)),
                sms,
                cu.resident_blocks_per_sm(self.device),
                mps_sm_limit(sms),
            )
            probe = (
                share,
                mps_active(),
                options.cuda_sync,
                options.cuda_blocks,
                bool(cu.has_stream_value_ops(self.device)),
            )
        except Exception as e:  # whatever it is, every rank hears of it: no rank waits alone
            error = f"{type(e).__name__}: {e}"
        # Two exchanges, each of which turns a failure on any rank into an error on every rank,
        # never a hang. The first: every rank's GPU, from which every rank makes the same choice
        # of mode and blocks (the blocks shape the segment, so before it is made).
        probes = gathered_or_raise(group, "cannot set up the CUDA transport", probe, error)
        same_on_every_rank([p[3] or "auto" for p in probes], "PYCOLL_CUDA_BLOCKS")
        shares = [GpuShare(*p[0]) for p in probes]
        mode = choose_sync_mode([g.uuid for g in shares], [p[1] for p in probes],
                                [p[2] for p in probes])  # fmt: skip
        self.residency = plan_residency(shares, probes[0][3] or 0, mode)
        self.sync_mode = self.residency.mode
        if self.residency.why and rank == 0:
            warnings.warn(f"pycollectives: {self.residency.why}", RuntimeWarning, stacklevel=3)
        report = None
        try:
            opts = options.cuda_options(cu, self.device, blocks=self.residency.blocks)
            # Interprocess events are stepped mode's fences only: kernel mode neither creates nor
            # exports them, so a machine that cannot export them (MPS, some containers) still
            # runs it.
            opts.stepped_events = opts.stepped_events and self.sync_mode == "stepped"
            # ... on fence counters where every rank's GPU has the stream memory operations
            # (safe however a GPU binds a wait), else on interprocess events.
            # (PYCOLL_CUDA_FENCE_COUNTERS=0: on the events everywhere.)
            opts.fence_counters = (
                opts.stepped_events and options.cuda_fence_counters and all(p[4] for p in probes)
            )
            native = cu.CudaComm(rank, size, self.device, opts)
            report = (
                (
                    opts.slot_bytes,
                    opts.nslots,
                    opts.nblocks,
                    opts.ll_max_bytes,
                    opts.stepped_twoshot,
                    opts.lookahead,
                    opts.stepped_events,
                    opts.fence_counters,
                    opts.register_on_use_bytes,
                    opts.push,
                    opts.copy_engines,
                ),
                native.ipc_handle,
                native.shm_name,
            )
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        try:
            reports = gathered_or_raise(group, "cannot set up the CUDA transport", report, error)
            same_on_every_rank(
                [rep[0] for rep in reports],
                "the CUDA staging configuration (bytes, slots, blocks, LL bytes, stepped two-shot, "
                "lookahead, stepped events, fence counters, register-on-use bytes, push, "
                "copy engines)",
            )
        except (CollectiveError, ValueError):
            if native is not None:
                native.close()
            raise
        error = None
        try:
            native.attach([rep[1] for rep in reports], [rep[2] for rep in reports], self.sync_mode)
        except (CollectiveError, ValueError) as e:
            error = str(e)
        try:
            gathered_or_raise(group, "cannot map peers' GPU memory", error=error)
        except CollectiveError:
            native.unlink()
            native.close()
            raise
        native.unlink()  # every peer has mapped ours (or given up): the names can go
        flight.attach(native, options, flight.comm_id(reports[0][2]), rank, size)
        self._c = native

    # -- lifetime -----------------------------------------------------------------------------

    def close(self):
        """Waits for this rank's queued work and for every rank (so no peer still reads our
        memory), then frees the device memory. Collective, like the constructor."""
        c, self._c = self._c, None
        if c is None:
            return
        try:
            if not c.poisoned:
                c.barrier()
        finally:
            c.close()
            self._inflight = InFlight()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check(self):
        """Raises what an earlier device wait left (a timeout, a mismatch found on the device,
        a dead peer): the error the next call would raise."""
        self._native_comm().check()

    def _native_comm(self):
        if self._c is None:
            raise CollectiveError("the CUDA communicator is closed")
        return self._c

    @property
    def timeout(self) -> float:
        return self._native_comm().timeout

    @timeout.setter
    def timeout(self, seconds: float):
        self._native_comm().timeout = checked_timeout(seconds)

    @property
    def seq(self) -> int:
        """Number of collectives (and barriers) this rank has queued."""
        return self._native_comm().seq

    def run_now_route(self):
        """Where the host communicator's one-step path (``_C.HostComm.run_now_via``) sends
        this rank's blocking calls on cupy arrays: the native transport's C interface, its
        communicator, cupy's array type, its current stream and this rank's device. None where
        cupy is not loaded or the native module has no C interface; calls then take ``run``."""
        cupy = sys.modules.get("cupy")
        api = getattr(_native(), "device_api", None)
        c = self._native_comm()
        if cupy is None or api is None or not hasattr(c, "address"):
            return None
        return api, c.address, c, cupy.ndarray, cupy.cuda.get_current_stream, self.device

    # -- registered buffers -------------------------------------------------------------------

    def empty(self, shape, dtype="float32"):
        """A cupy array of device memory that every rank maps (registered, symmetric):
        collective, every rank with the same shape and dtype. An all-reduce whose input and
        output are both registered arrays (or views into them, at the same offset on every
        rank) runs the two-shot: each rank reduces its shard of every rank's input and writes
        it into every rank's output, each byte moved through memory the least number of times.
        The memory is freed when the last array over it goes.

        Example::

            x = comm.empty(1 << 20, "float32")
            x[:] = cupy.random.random(1 << 20, dtype=cupy.float32)
            comm.all_reduce(x)   # in place, two-shot
        """
        import cupy

        dt = cupy.dtype(dtype)
        count = 1
        for n in (shape,) if isinstance(shape, int) else shape:
            count *= int(n)
        block = self._native_comm().alloc(count * dt.itemsize)
        mem = cupy.cuda.UnownedMemory(block.ptr, block.bytes, block, self.device)
        array = cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, 0))
        return self.register(array)

    def zeros(self, shape, dtype="float32"):
        """``empty`` filled with zeros (on the current stream)."""
        array = self.empty(shape, dtype)
        array.fill(0)
        return array

    def register(self, array):
        """Registers an existing CUDA array of this rank's device (cupy, torch, anything with
        ``__cuda_array_interface__``): collective, every rank its own array, in the same order.
        The IPC handle of its allocation goes to the peers once and each opens it once; later
        registrations of the same allocation send only where in it the array lies. The
        registration ends when the array's memory goes (or the communicator closes). Returns
        `array`."""
        c = self._native_comm()
        mine, error = None, None
        try:
            info = gpu_array(array, "register", "array", True, self.device)
            mine = c.register_handle(info.ptr, info.nbytes)
        except (TypeError, ValueError, CollectiveError) as e:
            error = f"{type(e).__name__}: {e}"
        everyone = gathered_or_raise(self._group, "cannot register the array", mine, error)
        number = c.register_add(info.ptr, info.nbytes, everyone)
        owner = _memory_owner(array)
        if owner is not None:  # memory not from empty(): released with it
            try:
                weakref.finalize(owner, _release, weakref.ref(self), number)
            except TypeError:  # not weakly referenceable: kept until close()
                pass
        return array

    # -- collectives --------------------------------------------------------------------------

    def run(self, call):
        """Checks and queues a ``backends.Call``; returns its completion handle (the
        Communicator's backend protocol)."""
        return self._launch(call)

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        return self._forced if self._forced in ALGORITHMS_FOR[collective] else "auto"

    def _queue(self, collective, x, out, op, root, algorithm, stream, async_op, result, **lists):
        """Checks and queues one collective (`collective` by name; `lists`: counts, in_splits,
        out_splits); returns `result`, or a ``Work`` with `async_op`. The named methods below
        are its usual spellings."""
        if type(op) is not int:  # a name, a ReduceOp or another library's twin, None
            op = 0 if op is None else op_code(op)
        if type(algorithm) is not int:  # a name or None
            isname = algorithm is None or isinstance(algorithm, str)
            algorithm = algo_code(algorithm) if isname else int(algorithm)
        call = Call(collective, x, out, op, root or 0, algorithm, async_op, stream, **lists)
        completion = self._launch(call)
        # The arrays stay referenced until the GPU is done with them, waited for or not.
        work = Work(completion, (x, out), result)
        self._inflight.add(work)
        return work if async_op else result

    def _launch(self, call):
        c = self._native_comm()
        xd, od, info = described(
            call.collective, call.x, call.out, call.root, self.rank, self.device
        )
        s = (
            arrays.current_stream(info)
            if call.stream is None
            else arrays.stream_handle(call.stream)
        )
        # One native call checks the collective (as the host path does) and queues it.
        return _CudaCompletion(c.run(call, xd, od, s), self, s)

    # The same signatures as Communicator's: the arrays, root, op and counts by position, then
    # algorithm; async_op and stream by keyword only.

    def all_reduce(self, x, out=None, op=SUM, algorithm=None, *, async_op=False, stream=None):
        res = x if out is None else out
        return self._queue("all_reduce", x, out, op, None, algorithm, stream, async_op, res)

    def reduce_scatter(
        self, x, out, op=SUM, counts=None, algorithm=None, *, async_op=False, stream=None
    ):
        return self._queue(
            "reduce_scatter", x, out, op, None, algorithm, stream, async_op, out, counts=counts
        )

    def all_gather(self, x, out, counts=None, algorithm=None, *, async_op=False, stream=None):
        return self._queue(
            "all_gather", x, out, None, None, algorithm, stream, async_op, out, counts=counts
        )

    def broadcast(self, x, root=0, algorithm=None, *, async_op=False, stream=None):
        return self._queue("broadcast", x, None, None, root, algorithm, stream, async_op, x)

    def reduce(self, x, out=None, root=0, op=SUM, algorithm=None, *, async_op=False, stream=None):
        res = x if out is None else out
        return self._queue("reduce", x, out, op, root, algorithm, stream, async_op, res)

    def all_to_all(
        self, x, out, in_splits=None, out_splits=None, algorithm=None, *, async_op=False,
        stream=None,
    ):  # fmt: skip
        return self._queue(
            "all_to_all", x, out, None, None, algorithm, stream, async_op, out,
            in_splits=in_splits, out_splits=out_splits,
        )  # fmt: skip

    def gather(self, x, out=None, root=0, algorithm=None, *, async_op=False, stream=None):
        return self._queue("gather", x, out, None, root, algorithm, stream, async_op, out)

    def scatter(self, x, out, root=0, algorithm=None, *, async_op=False, stream=None):
        return self._queue("scatter", x, out, None, root, algorithm, stream, async_op, out)

    def barrier(self):
        """Returns once this rank's queued collectives have finished on the GPU and every rank
        has entered the barrier."""
        self._native_comm().barrier()
        self._inflight = InFlight()  # all of it has finished


def _memory_owner(array):
    """What `array`'s registration lives as long as: cupy's memory object (the allocation's
    piece the array is a view of), else the array itself; None for memory from empty(), whose
    registrations lapse with the allocation."""
    mem = getattr(getattr(array, "data", None), "mem", None)
    if mem is None:
        return array
    return None if isinstance(getattr(mem, "_owner", None), _native().CudaAllocation) else mem


def _release(comm_ref, number):
    comm = comm_ref()
    if comm is not None and comm._c is not None:
        comm._c.register_release(number)
