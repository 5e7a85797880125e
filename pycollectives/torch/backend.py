"""pycollectives as a torch.distributed backend: ``"pycollectives"``.

``import pycollectives.torch`` registers it for ``cpu`` and ``cuda`` devices; then
``dist.init_process_group("pycollectives")`` works under torchrun or any ``env://`` launch, and
``pycollectives.torch.init_process_group()`` under mpiexec with nothing set. Each process group
(the default one, and every ``dist.new_group`` / ``DeviceMesh`` subgroup) is one
``pc.Communicator``, made over the store torch hands the backend (over MPI for a default group
that is the mpiexec world, which also covers several machines). ``timeout=`` becomes the
communicator's timeout.

Where the package was built against the installed torch, each group's backend is the C++
``pycollectives._torch.Backend``: all_reduce, broadcast, reduce, all_gather and reduce_scatter
into one tensor (and their coalesced forms) and barrier go from torch's dispatcher straight to
a communicator, without Python: the shared-memory one for CPU tensors, the CUDA transport for
CUDA tensors (queued on torch's current stream; the transport is made by the group's first
call on CUDA tensors). Every other call (and groups over several machines) reaches the Python
``ProcessGroup`` of this module, which it wraps. ``PYCOLL_TORCH_NATIVE=0`` uses the Python one
alone. ``PYCOLL_TORCH_DEVICE=emulated`` (tests; a checkout's build) runs the C++ backend's
CUDA path on the emulated device instead, with CPU tensors standing for CUDA ones.

Collectives of 1 MiB and more, and every send/recv, are issued asynchronously on the
communicator (its progress thread runs them in issue order); smaller collectives run at once
on the calling thread. Each returns a ``Work`` whose ``wait()``, ``is_completed()`` and
``get_future()`` behave as torch's own: a blocking torch call simply waits. Futures complete
from a helper thread once their operation has (DDP's communication hooks chain on them).
Tensors pass without copies where the layout allows (CPU tensors are host memory;
CUDA tensors take the CUDA transport, ordered on the current stream); lists of separate
tensors (``all_gather`` into a list, ``reduce_scatter`` from one, ``all_to_all`` of lists,
``gather``, ``scatter``) go through one contiguous buffer.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from pycollectives.communicator import Communicator
from pycollectives.errors import CollectiveError
from pycollectives.ops import AVG, MAX, MIN, PROD, SUM, TORCH_OPS, torch_op_name
from pycollectives.runtime import arrays, bootstrap
from pycollectives.work import AllOf
from pycollectives.work import Work as PcWork

NAME = "pycollectives"
# bool tensors travel as uint8: SUM, AVG and MAX are a logical or (max), MIN and PRODUCT a
# logical and (min).
_BOOL_OPS = {SUM: MAX, AVG: MAX, MAX: MAX, MIN: MIN, PROD: MIN}


def _reduce_op(op, tensor):
    """(`tensor` as the communicator takes it, our op) for a torch ReduceOp."""
    ours = TORCH_OPS.get(torch_op_name(op))
    if ours is None:
        raise ValueError(
            f"the pycollectives backend reduces with {', '.join(TORCH_OPS)}, not "
            f"{torch_op_name(op)}"
        )
    if tensor.dtype == torch.bool:
        return _plain(tensor), _BOOL_OPS[ours]
    return _plain(tensor), ours


# Collectives on fewer bytes run on the calling thread (microseconds), larger ones on the
# communicator's progress thread, so that they overlap with what the caller does meanwhile
# (handing an operation over costs tens of microseconds on a busy machine). Point-to-point
# operations always go asynchronously: a blocking send would wait for its receiver.
ASYNC_BYTES = 1 << 20


def _async(a, times=1) -> bool:
    nbytes = a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()
    return nbytes * times >= ASYNC_BYTES


def _plain(t):
    """`t` as the communicator takes it: a CPU tensor as a numpy view of its memory (the
    communicator's fastest path), bool as uint8 (the same bytes); a CUDA tensor as it is."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if not t.is_cpu:
        return t
    if t.dtype == torch.bfloat16:
        return arrays.host_view(t)
    return t.detach().numpy()


def _checked(t, what):
    if not t.is_contiguous():
        raise ValueError(f"the pycollectives backend needs contiguous tensors ({what})")
    return t


def _contiguous(t, what):
    return _plain(_checked(t, what))


def _flat_like(tensors):
    """One contiguous buffer holding `tensors` back to back."""
    first = tensors[0]
    return torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)


def _pack(tensors):
    """`tensors` copied into one contiguous buffer."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpacker(flat, tensors):
    """A function that copies `flat` back into `tensors`."""

    def unpack():
        off = 0
        for t in tensors:
            t.copy_(flat[off : off + t.numel()].view(t.shape))
            off += t.numel()

    return unpack


class Work(dist.distributed_c10d.Work):
    """torch's face of one ``pycollectives.Work`` (`work`) where this backend serves alone: a
    build without ``pycollectives._torch`` (or ``PYCOLL_TORCH_NATIVE=0``). Under the C++
    backend its ``_torch.Work`` is the face, of these operations as of its own."""

    def __init__(self, work, outputs):
        super().__init__()
        self._work, self._outputs = work, outputs
        self._fut = None

    def wait(self, timeout=None):
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds() if timeout.total_seconds() > 0 else None
        return self._work.wait(timeout)

    def is_completed(self):
        return self._work.is_completed()

    def is_success(self):
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        return self._outputs

    def get_future(self):
        if self._fut is not None:
            return self._fut
        fut = self._fut = Future()

        def done(f):
            error = f.exception()
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(f.result())

        self._work.get_future().add_done_callback(done)
        return fut


class ProcessGroup(dist.ProcessGroup):
    """A torch process group over a ``pc.Communicator`` (see the module's docstring)."""

    def __init__(self, comm: Communicator, rank: int, size: int, face=Work):
        """`face`: the class of the Works it returns, made of (pycollectives.Work, outputs)."""
        super().__init__(rank, size)
        self.comm = comm
        self._face = face
        self._name, self._desc = "", ""
        self._emulated = None  # (EmuComm, EmuStream) under PYCOLL_TORCH_DEVICE=emulated

    def getBackendName(self):
        return NAME

    # The group's name and description (torch keeps them in its backends; this group is its
    # own backend).
    def getGroupName(self):
        return self._name

    def setGroupName(self, name):
        self._name = name

    def getGroupDesc(self):
        return self._desc

    def setGroupDesc(self, desc):
        self._desc = desc

    def _work(self, works, result, post=None):
        """One Work over `works` (the communicator's; those done already are not Works),
        returning `result`, `post` run after them. Its result() is the output tensors, a list
        of lists read as one, as torch's Work gives them."""
        works = [w for w in works if isinstance(w, PcWork)]
        outputs = [t for r in result for t in (r if isinstance(r, (list, tuple)) else [r])]
        return self._face(PcWork(AllOf(works), None, result, post), outputs)

    def shutdown(self):
        self.comm.close()
        self._emulated = None

    # -- the C++ backend's device path ---------------------------------------------------------

    def _cuda_transport(self, index):
        """(device_api capsule, native communicator) of this group's CUDA transport on GPU
        `index`, made on first use (collective, as the first CUDA call of this backend)."""
        from pycollectives import _cuda

        return _cuda.device_api, self.comm._cuda_for("torch", index)._native_comm()

    def _emulated_transport(self, index):
        """The same over the emulated device (tests): its communicator and its stream, made on
        first use (collective). ``PYCOLL_EMU_STREAM_DELAY_MS`` delays each queued call."""
        from pycollectives import _emu

        if self._emulated is None:
            dev = emulated_device(self.comm)
            delay = int(os.environ.get("PYCOLL_EMU_STREAM_DELAY_MS", "0"))
            self._emulated = (dev, _emu.EmuStream(dev, delay))
        return _emu.device_api, self._emulated[1]

    # -- reductions ---------------------------------------------------------------------------

    def allreduce(self, tensors, opts):
        works = []
        for t in tensors:
            x, op = _reduce_op(opts.reduceOp, _checked(t, "all_reduce"))
            works.append(self.comm.all_reduce(x, op=op, async_op=_async(x)))
        return self._work(works, tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        x, op = _reduce_op(opts.reduceOp, _checked(tensors[0], "reduce"))
        return self._work(
            [self.comm.reduce(x, root=opts.rootRank, op=op, async_op=_async(x))], tensors
        )

    def reduce_scatter(self, outputs, input_lists, opts):
        works = []
        for out, inputs in zip(outputs, input_lists):
            flat, op = _reduce_op(opts.reduceOp, _pack(inputs))
            o = _contiguous(out, "reduce_scatter output")
            works.append(self.comm.reduce_scatter(flat, o, op=op, async_op=_async(flat)))
        return self._work(works, outputs)

    def _reduce_scatter_one(self, output, input, opts):
        x, op = _reduce_op(opts.reduceOp, _checked(input, "reduce_scatter input"))
        o = _contiguous(output, "reduce_scatter output")
        return self.comm.reduce_scatter(x, o, op=op, async_op=_async(x))

    def reduce_scatter_single(self, output, input, opts):
        return self._work([self._reduce_scatter_one(output, input, opts)], [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self._reduce_scatter_one(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._work(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement ------------------------------------------------------------------------

    def broadcast(self, tensors, opts):
        works = []
        for t in tensors:
            x = _contiguous(t, "broadcast")
            works.append(self.comm.broadcast(x, root=opts.rootRank, async_op=_async(x)))
        return self._work(works, tensors)

    def allgather(self, output_lists, inputs, opts):
        works, posts = [], []
        for outs, x in zip(output_lists, inputs):
            flat = _flat_like(outs)
            works.append(
                self.comm.all_gather(
                    _contiguous(x, "all_gather"), _plain(flat), async_op=_async(flat)
                )
            )
            posts.append(_unpacker(flat, outs))
        return self._work(works, output_lists, lambda: [p() for p in posts])

    def allgather_coalesced(self, output_lists, inputs, opts):
        return self.allgather(output_lists, inputs, opts)

    def _all_gather_one(self, output, input):
        o = _contiguous(output, "all_gather output")
        x = _contiguous(input, "all_gather input")
        return self.comm.all_gather(x, o, async_op=_async(o))

    def all_gather_single(self, output, input, opts):
        return self._work([self._all_gather_one(output, input)], [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        works = [self._all_gather_one(o, i) for o, i in zip(outputs, inputs)]
        return self._work(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        x = _contiguous(input, "all_to_all input")
        o = _contiguous(output, "all_to_all output")
        n = self.comm.size
        if not input_splits and not output_splits:
            work = self.comm.all_to_all(x, o, async_op=_async(x))
        else:
            in_rows = list(input_splits) or [input.shape[0] // n] * n
            out_rows = list(output_splits) or [output.shape[0] // n] * n
            in_row = input[0].numel() if input.dim() > 0 and input.shape[0] else 1
            out_row = output[0].numel() if output.dim() > 0 and output.shape[0] else 1
            work = self.comm.all_to_all(
                x,
                o,
                in_splits=[r * in_row for r in in_rows],
                out_splits=[r * out_row for r in out_rows],
                async_op=_async(x),
            )
        return self._work([work], [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts):
        flat_in = _plain(_pack(inputs))
        flat_out = _flat_like(outputs)
        work = self.comm.all_to_all(
            flat_in,
            _plain(flat_out),
            in_splits=[t.numel() for t in inputs],
            out_splits=[t.numel() for t in outputs],
            async_op=_async(flat_in),
        )
        return self._work([work], outputs, _unpacker(flat_out, outputs))

    def gather(self, output_lists, inputs, opts):
        root = opts.rootRank
        x = _contiguous(inputs[0], "gather input")
        if self.comm.rank == root:
            outs = output_lists[0]
            flat = _flat_like(outs)
            work = self.comm.gather(x, _plain(flat), root=root, async_op=_async(flat))
            return self._work([work], output_lists, _unpacker(flat, outs))
        return self._work(
            [self.comm.gather(x, None, root=root, async_op=_async(x, self.comm.size))], output_lists
        )

    def scatter(self, outputs, input_lists, opts):
        root = opts.rootRank
        o = _contiguous(outputs[0], "scatter output")
        x = _plain(_pack(input_lists[0])) if self.comm.rank == root else None
        return self._work(
            [self.comm.scatter(x, o, root=root, async_op=_async(o, self.comm.size))], outputs
        )

    # -- point to point -----------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        works = [self.comm.send(_contiguous(t, "send"), dst, tag, async_op=True) for t in tensors]
        return self._work(works, tensors)

    def recv(self, tensors, src, tag):
        works = [self.comm.recv(_contiguous(t, "recv"), src, tag, async_op=True) for t in tensors]
        return self._work(works, tensors)

    def recv_anysource(self, tensors, tag):
        raise CollectiveError("the pycollectives backend cannot receive from any source")

    def barrier(self, opts=None):
        return self._work([self.comm.barrier()], [])


def _group(store, rank, size):
    """The rendezvous of a backend's group. Under mpiexec, MPI: the world for the default
    group, and for a subgroup the MPI communicator of its members (found through the store
    torch hands the backend), so that a group spanning nodes has MPI between them. Under
    torchrun or env://, that store: nodes are found by host identity and gloo runs between
    them. Every rank of a group decides alike: the default group is made before
    ``dist.is_initialized()``, and its ranks are the MPI world's under mpiexec."""
    from mpi4py import MPI

    # torch's store for a group is that group's own (prefixed by it): one prefix of ours in
    # it, not one counted per process (ranks that are not members of a group count fewer).
    group = bootstrap.StoreGroup(rank, size, store, prefix="pycollectives")
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:  # an env:// launch: each process an MPI world of one
        return group
    if not dist.is_initialized() and (world.Get_rank(), world.Get_size()) == (rank, size):
        return bootstrap.MpiGroup(world)
    members = group.allgather(world.Get_rank())
    return bootstrap.MpiGroup.of_members(world, members)


def emulated_device(comm: Communicator, **options):
    """An emulated device communicator (``pycollectives._emu.EmuComm``, tests only) over the
    ranks of `comm`, in kernel mode unless `options` (EmuOptions' fields) say otherwise:
    collective. Its shared memory is unlinked once every rank has mapped it."""
    from pycollectives import _emu

    o = _emu.EmuOptions()
    for name, value in options.items():
        setattr(o, name, value)
    o.timeout = comm.timeout
    dev = _emu.EmuComm(comm.rank, comm.size, o)
    names = comm.all_gather_object((dev.segment_name, dev.flags_name))
    dev.attach([s for s, _ in names], [f for _, f in names])
    comm.barrier()
    dev.unlink()
    return dev


def _device_path(pg):
    """(what makes the C++ backend's device transport, the tensors' device type)."""
    if os.environ.get("PYCOLL_TORCH_DEVICE", "").strip() == "emulated":
        return pg._emulated_transport, "cpu"
    return pg._cuda_transport, "cuda"


def _native():
    """pycollectives._torch, or None where it was not built (or PYCOLL_TORCH_NATIVE=0)."""
    if os.environ.get("PYCOLL_TORCH_NATIVE", "1").strip() == "0":
        return None
    try:
        from pycollectives import _torch
    except ImportError:
        return None
    return _torch


def create(opts, backend_options=None):
    """The creator torch calls for every process group of this backend (its extended form:
    `opts` also names the group, which DeviceMesh and functional collectives look it up by)."""
    timeout = opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    rank, size = opts.group_rank, opts.group_size
    comm = Communicator(_group(opts.store, rank, size), timeout=seconds)
    native = _native()
    pg = ProcessGroup(comm, rank, size, Work if native is None else native.Work)
    pg.setGroupName(opts.group_id)
    if native is None:
        return pg
    host = comm._host.c if comm._host_run is not None else None  # one machine: shared memory
    device, device_type = _device_path(pg)
    return native.Backend(pg, host, rank, size, ASYNC_BYTES, device, device_type)


def communicator(group=None) -> Communicator:
    """The ``pc.Communicator`` under a process group of this backend (default: the default
    group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroup):
        pg = pg._get_backend(torch.device("cpu"))
        pg = getattr(pg, "fallback", pg)
    if not isinstance(pg, ProcessGroup):
        raise ValueError(f"{group!r} is not a process group of the {NAME} backend")
    return pg.comm


def register():
    """Registers the backend with torch (once)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])
