"""PyTorch: the ``"pycollectives"`` torch.distributed backend, and ``DistributedDataParallel``.

Importing this package registers the backend (``pycollectives.torch.backend``)::

    import torch.distributed as dist
    import pycollectives.torch as pct
    pct.init_process_group()       # mpiexec, or torchrun / env:// (then the same as
                                   # dist.init_process_group("pycollectives"))
    dist.all_reduce(t)             # on pycollectives; stock DDP, new_group, ... likewise

``DistributedDataParallel(module, comm)`` is pycollectives' own data-parallel wrapper:

Gradients of the wrapped module's parameters live in pycollectives' buckets (``p.grad`` is a
view into a bucket, as torch DDP's ``gradient_as_bucket_view``); a post-accumulate-grad hook
marks each one ready, so full buckets are averaged while backward goes on; when backward ends
the adapter waits for the rest. Needs ``pip install pycollectives[torch]``.

Example (``mpiexec -n 2 python train.py``)::

    comm = pc.Communicator()
    model = DistributedDataParallel(torch.nn.Linear(10, 2), comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pycollectives.parallel.data.bucketer import GradientBucketer
from pycollectives.runtime import arrays
from pycollectives.torch import backend

backend.register()
BACKEND = backend.NAME
communicator = backend.communicator


def init_process_group(*, timeout=None, backend=BACKEND, **kwargs):
    """``dist.init_process_group("pycollectives", ...)`` that also works under mpiexec with
    nothing set: rank and size come from MPI, and rank 0's host and a free port from it are
    agreed over MPI for torch's store. Under torchrun or another env:// launch (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) those are used as they are.
    `timeout` (seconds or a timedelta) bounds every operation's wait for a peer; `backend`
    another torch backend launched the same way (to compare)."""
    if os.environ.get("RANK", "") == "" and os.environ.get("WORLD_SIZE", "") == "":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        where = None
        if world.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                where = (socket.gethostname(), s.getsockname()[1])
        host, port = world.bcast(where, root=0)
        os.environ.update(
            RANK=str(world.Get_rank()),
            WORLD_SIZE=str(world.Get_size()),
            MASTER_ADDR=os.environ.get("MASTER_ADDR") or host,
            MASTER_PORT=os.environ.get("MASTER_PORT") or str(port),
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend, **kwargs)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
_NUMPY_DTYPES[torch.bfloat16] = arrays.BFLOAT16_BITS  # bfloat16 buckets: tagged uint16

_BUFFER_DTYPES = set(_NUMPY_DTYPES) | {
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
}

# torch DDP's arguments: those that mean something here, and those refused by name.
_ACCEPTED = {
    "device_ids": "CPU modules take none",
    "output_device": "CPU modules take none",
    "dim": "batches are split by the caller",
    "gradient_as_bucket_view": "gradients are always views into the buckets",
    "static_graph": "buckets are laid out again after the first step anyway",
}
_REFUSED = {
    "process_group": "pass a pycollectives Communicator as `comm` (or use torch's own "
    "DistributedDataParallel on the pycollectives backend)",
    "mixed_precision": "cast the module instead",
    "delay_all_reduce_named_params": "not supported",
    "param_to_hook_all_reduce": "not supported",
    "init_sync": "parameters are always broadcast from rank 0",
    "skip_all_reduce_unused_params": "not supported",
}


class GradBucket:
    """What a communication hook gets (torch's ``dist.GradBucket`` methods): one bucket of
    gradients, not yet averaged."""

    def __init__(self, index, count, buffer, params, grads):
        self._index, self._count, self._buffer = index, count, buffer
        self._params, self._grads = params, grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        """The bucket's flat gradients (its memory: writing here writes the gradients)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor):
        self._buffer.copy_(tensor)

    def parameters(self) -> list:
        return list(self._params)

    def gradients(self) -> list:
        return list(self._grads)


class _HookWork:
    """A hook's future as the bucketer waits for it: its value lands in the bucket."""

    def __init__(self, fut, buffer):
        self._fut, self._buffer = fut, buffer

    def wait(self):
        out = self._fut.wait()
        if isinstance(out, (list, tuple)):
            out = out[0]
        if out.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(out)


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its parameters are broadcast from rank 0 and their gradients averaged.

    Args:
        module: a CPU ``torch.nn.Module`` (float32, float64, float16 or bfloat16 parameters).
        comm: a ``pc.Communicator`` (None: ``pc.Communicator()``).
        bucket_cap_mb / first_bucket_mb: as ``GradientBucketer``.
        broadcast_buffers: as torch DDP: rank 0's buffers (BatchNorm's running statistics,
            ...) are broadcast at the start of every forward pass that records gradients
            (outside ``no_sync``).
        find_unused_parameters: as torch DDP: parameters that got no gradient in a backward
            pass contribute zeros to the average (otherwise that is an error naming them).

    torch DDP's other arguments are accepted where they mean nothing here (``device_ids``,
    ``output_device``, ``dim``, ``gradient_as_bucket_view``, ``static_graph``) and refused by
    name otherwise (``process_group``, ``mixed_precision``, ...). ``register_comm_hook`` takes
    torch's hooks (``hook(state, bucket) -> Future``).
    """

    def __init__(
        self,
        module,
        comm=None,
        bucket_cap_mb=25.0,
        first_bucket_mb=1.0,
        *,
        broadcast_buffers=True,
        find_unused_parameters=False,
        **torch_kwargs,
    ):
        super().__init__()
        for key, value in torch_kwargs.items():
            if key in _REFUSED:
                raise TypeError(
                    f"DistributedDataParallel: {key} is not supported ({_REFUSED[key]})"
                )
            if key not in _ACCEPTED:
                raise TypeError(f"DistributedDataParallel: unexpected argument {key!r}")
            if key in ("device_ids", "output_device") and value not in (None, [], "cpu"):
                raise ValueError(
                    f"DistributedDataParallel: {key}={value!r}: this build moves host memory only"
                )
            if key == "dim" and value != 0:
                raise ValueError(
                    f"DistributedDataParallel: dim={value} is not supported ({_ACCEPTED[key]})"
                )
        if comm is None:
            import pycollectives as pc

            comm = pc.Communicator()
        self.module = module
        self.comm = comm
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for name, p in named:
            if p.device.type != "cpu":
                raise ValueError(
                    f"parameter {name} is on {p.device}: this build moves host memory only"
                )
            if p.dtype not in _NUMPY_DTYPES:
                raise TypeError(f"parameter {name} has unsupported dtype {p.dtype}")
        self._params = [p for _, p in named]
        self._buffers_synced = [b for b in module.buffers() if b.numel()]
        for name, b in module.named_buffers():
            if b.numel() and b.dtype not in _BUFFER_DTYPES:
                raise TypeError(f"buffer {name} has unsupported dtype {b.dtype}")
        with torch.no_grad():
            for p in self._params:
                comm.broadcast(p.detach(), root=0)
            self._sync_buffers()
        self.bucketer = GradientBucketer(
            comm,
            [(tuple(p.shape), _NUMPY_DTYPES[p.dtype]) for p in self._params],
            bucket_cap_mb,
            first_bucket_mb,
            names=[n for n, _ in named],
        )
        self._attach()
        self._queued = False
        self._fired = set()
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i, p))

    def register_comm_hook(self, state, hook):
        """As torch DDP's: ``hook(state, bucket)`` runs for each bucket once its gradients are
        final (``bucket.buffer()``: their sum on this rank, not yet averaged) and returns a
        ``torch.futures.Future`` of the tensor to write back (the average). torch's own hooks
        work (``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ...; their `state` is a
        torch process group, None for the default one). Register before the first backward,
        once."""
        if self.bucketer.reduce is not None:
            raise RuntimeError("register_comm_hook may be called only once")
        if self.bucketer.launch_times:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")

        def reduce(bucket):
            buf = arrays.torch_view(bucket.buffer)
            params = [self._params[i] for i in bucket.params]
            grads = [self._views[i] for i in bucket.params]
            count = len(self.bucketer.buckets)
            fut = hook(state, GradBucket(bucket.index, count, buf, params, grads))
            if not isinstance(fut, torch._C.Future):  # torch.futures.Future, or .then()'s
                raise TypeError(f"a comm hook must return a torch.futures.Future, got {fut!r}")
            return _HookWork(fut, buf)

        self.bucketer.reduce = reduce

    def _sync_buffers(self):
        for b in self._buffers_synced:
            t = b.detach()
            self.comm.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, root=0)

    def _attach(self):
        """Points every p.grad at its bucket view (keeping the current values)."""
        self._views = [arrays.torch_view(v) for v in self.bucketer.grads]
        for p, v in zip(self._params, self._views):
            if p.grad is not None and p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
            p.grad = v

    def _grad_ready(self, i, p):
        v = self._views[i]
        if p.grad is None or p.grad.data_ptr() != v.data_ptr():
            # zero_grad(set_to_none=True) dropped the view: autograd made a fresh tensor.
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = v
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._fired.add(i)
        self.bucketer.mark_ready(i)

    def _backward_done(self):
        self._queued = False
        if self.find_unused_parameters and self.bucketer.syncing:
            for i, v in enumerate(self._views):
                if i not in self._fired:  # no gradient this pass: zeros to the average
                    v.zero_()
                    self._params[i].grad = v
                    self.bucketer.mark_ready(i)
        self._fired.clear()
        self.bucketer.synchronize()
        self._attach()  # the first step may have laid the buckets out anew

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and torch.is_grad_enabled() and self.bucketer.syncing:
            with torch.no_grad():
                self._sync_buffers()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside averages."""
        with self.bucketer.no_sync():
            yield
