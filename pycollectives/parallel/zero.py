"""ZeRO data parallelism (DeepSpeed's stages, PyTorch FSDP's sharding) for numpy and cupy models.

Every rank trains on its own part of each batch, as with ``DataParallel``, but the model state
is partitioned across the ranks instead of replicated:

- stage 1: optimizer state sharded. Gradients are reduce-scattered (averaged), each rank updates
  the parameters of its shard, and the updated shards are all-gathered.
- stage 2: gradients sharded too. Each bucket's reduce-scatter starts while backward goes on,
  and the full gradients of a bucket are freed once it finishes.
- stage 3: parameters sharded too. Each layer's parameters are all-gathered just before the
  layer runs (forward and again in backward) and freed after it; the next layer's gather is
  started before this one computes (prefetch).

Parameters are grouped into units, each one flat buffer padded to a multiple of the number of
ranks: consecutive layers up to ``bucket_cap_mb`` (stages 1 and 2), one layer each (stage 3).
Rank r owns elements ``[r*s, (r+1)*s)`` of every unit. Example::

    model = nn.mlp([784, 512, 512, 10], rng)
    zero = ZeroDataParallel(comm, model, "adam", lr=1e-3, stage=3)
    for x, y in my_shard_of_each_batch:
        out, caches = zero.forward(x)
        loss, d = nn.softmax_cross_entropy(out, y)
        zero.backward(d, caches)      # gradients averaged over ranks, sharded
        zero.step()                   # each rank updates its shard
    zero.save("ckpt.npz")             # rank 0 writes the full model and optimizer state
"""

from __future__ import annotations

import contextlib

import numpy as np

from pycollectives import checkpoint
from pycollectives.parallel import nn, optim
from pycollectives.parallel.nn import Sequential, array_module


class _Unit:
    """Consecutive layers whose parameters share one flat buffer, sharded over the ranks."""

    def __init__(self, layer_ids, layers, nranks, rank, first_param):
        self.layer_ids = layer_ids
        self.shapes = [p.shape for i in layer_ids for p in layers[i].params]
        self.first_param = first_param  # index of its first parameter in the model's list
        self.numel = sum(int(np.prod(s)) for s in self.shapes)
        self.shard = -(-self.numel // nranks)
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.full = None  # flat parameters (stages 1, 2: always; 3: while in use)
        self.full_grad = None  # flat gradients while backward fills them
        self.shard_param = None
        self.shard_grad = None
        self.pending = []  # (Work, reduced shard) of reduce-scatters not yet waited for


class ZeroDataParallel:
    """A `Sequential` model trained data-parallel with ZeRO `stage` 1, 2 or 3 (see the module).

    At construction rank 0's parameters are broadcast, so the ranks start alike. `optimizer`
    is "sgd" or "adam" (or a callable ``params -> optim.Optimizer``), built over this rank's
    shards with `lr` and `opt_kw` (``momentum=0.9``, ``betas=...``). Gradients are averaged
    over ranks, so each rank passes a loss averaged over its own equal part of the batch.
    """

    def __init__(self, comm, model: Sequential, optimizer="adam", lr=1e-3, stage=3,
                 bucket_cap_mb=25.0, prefetch=True, **opt_kw):  # fmt: skip
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not isinstance(model, Sequential):
            raise TypeError(f"model must be a parallel.nn.Sequential, got {type(model).__name__}")
        if not callable(optimizer) and optimizer not in optim.NAMES:
            raise ValueError(
                f"optimizer must be one of {optim.NAMES} or a callable, got {optimizer!r}"
            )
        params = model.params
        if not params:
            raise ValueError("the model has no parameters")
        if any(p is None for p in params):
            raise ValueError(
                "the model's parameters are sharded by another stage-3 ZeroDataParallel"
            )
        self.xp = array_module(params[0])
        self.dtype = params[0].dtype
        if any(p.dtype != self.dtype or array_module(p) is not self.xp for p in params):
            raise TypeError("parameters must share one dtype and one array library")
        self.comm, self.model, self.stage, self.prefetch = comm, model, stage, prefetch
        self.units = self._make_units(bucket_cap_mb * 2**20 if stage < 3 else 0)
        self._unit_of = {i: u for u in self.units for i in u.layer_ids}
        # The unit to prefetch while each one computes, in forward and in backward order.
        self._next_fwd = dict(zip(self.units, self.units[1:] + [None]))
        self._next_bwd = dict(zip(self.units[::-1], self.units[-2::-1] + [None]))
        self._sync = True
        self._gathers = {}  # unit -> Work of a started all-gather (stage 3)
        xp = self.xp
        for u in self.units:
            flat = self._pack(u, [p for layer in self._layers(u) for p in layer.params], xp)
            comm.broadcast(flat, root=0)
            if stage < 3:
                u.full = flat
                u.shard_param = flat[u.lo : u.hi]
                self._bind(u)
            else:
                u.shard_param = flat[u.lo : u.hi].copy()
                self._unbind(u)
            if stage == 1:
                u.full_grad = xp.zeros_like(flat)
        shards = [u.shard_param for u in self.units]
        if callable(optimizer):
            self.optimizer = optimizer(shards)
        else:
            self.optimizer = optim.make(optimizer, shards, lr, **opt_kw)

    # -- layout --------------------------------------------------------------------------------

    def _make_units(self, cap_bytes):
        layers, units, ids, first, n = self.model.layers, [], [], 0, 0
        itemsize = np.dtype(self.dtype).itemsize
        for i, layer in enumerate(layers):
            if not layer.params:
                continue
            ids.append(i)
            n += sum(p.size for p in layer.params) * itemsize
            if n >= cap_bytes:
                units.append(_Unit(ids, layers, self.comm.size, self.comm.rank, first))
                first += sum(len(layers[j].params) for j in ids)
                ids, n = [], 0
        if ids:
            units.append(_Unit(ids, layers, self.comm.size, self.comm.rank, first))
        return units

    def _pack(self, u, pieces, xp):
        """One padded flat buffer of unit `u` holding `pieces` (its parameters' shapes, in
        order; a missing piece, None, stays zero)."""
        flat = xp.zeros(u.shard * self.comm.size, self.dtype)
        for view, piece in zip(self._views(u, flat), pieces):
            if piece is not None:
                view[...] = xp.asarray(piece).reshape(view.shape)
        return flat

    def _views(self, u, flat):
        return nn.flat_views(flat, u.shapes)

    def _bind(self, u):
        """Points the unit's layers at its flat buffers (gradients: None when it has none)."""
        none = [None] * len(u.shapes)
        grads = none if u.full_grad is None else self._views(u, u.full_grad)
        nn.hand_out(self._layers(u), self._views(u, u.full), grads)

    def _unbind(self, u):
        u.full = None
        none = [None] * len(u.shapes)
        nn.hand_out(self._layers(u), none, none)

    def _layers(self, u):
        return [self.model.layers[i] for i in u.layer_ids]

    # -- stage 3: gather before use, free after -------------------------------------------------

    def _start_gather(self, u):
        if self.stage < 3 or u.full is not None or u in self._gathers:
            return
        full = self.xp.empty(u.shard * self.comm.size, self.dtype)
        work = self.comm.all_gather(u.shard_param, full, async_op=True)
        self._gathers[u] = (work, full)

    def _materialize(self, u, next_unit):
        if self.stage == 3 and u.full is None:
            self._start_gather(u)
            work, full = self._gathers.pop(u)
            if self.prefetch and next_unit is not None:
                self._start_gather(next_unit)  # overlaps this unit's compute
            work.wait()
            u.full = full
            self._bind(u)

    def _release(self, u):
        if self.stage == 3:
            self._unbind(u)

    # -- training -------------------------------------------------------------------------------

    def forward(self, x):
        """The model's output and the caches backward needs."""
        caches = []
        for i, layer in enumerate(self.model.layers):
            u = self._unit_of.get(i)
            if u is not None:
                self._materialize(u, self._next_fwd[u])
            x, c = layer.forward(x)
            caches.append(c)
            if u is not None and i == u.layer_ids[-1]:
                self._release(u)
        return x, caches

    def backward(self, dy, caches):
        """Backward through the model; each unit's gradients are reduce-scattered as soon as
        they are final (unless inside ``no_sync``). Returns the input's gradient."""
        for i in reversed(range(len(self.model.layers))):
            u = self._unit_of.get(i)
            if u is not None and i == u.layer_ids[-1]:
                self._materialize(u, self._next_bwd[u])
                if u.full_grad is None:
                    u.full_grad = self.xp.zeros(u.shard * self.comm.size, self.dtype)
                self._bind(u)
            dy = self.model.layers[i].backward(dy, caches[i])
            if u is not None and i == u.layer_ids[0]:
                if self._sync:
                    self._reduce_scatter(u)
                self._release(u)
        for u in self.units:
            self._finish_reduce(u)
        return dy

    def _reduce_scatter(self, u):
        out = self.xp.empty(u.shard, self.dtype)
        work = self.comm.reduce_scatter(u.full_grad, out, op="avg", async_op=True)
        u.pending.append((work, out))
        if self.stage >= 2:
            u.full_grad = None  # the Work holds it until the reduction is done

    def _finish_reduce(self, u):
        for work, out in u.pending:
            work.wait()
            if u.shard_grad is None:
                u.shard_grad = out
            else:
                u.shard_grad += out
        if u.pending and self.stage == 1:
            u.full_grad[...] = 0
        u.pending = []
        if self.stage >= 2 and u.full is not None:
            self._bind(u)  # its layers no longer point at freed gradients

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep accumulating full gradients locally; the first one
        after it reduces everything accumulated (gradient accumulation)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def step(self):
        """Updates this rank's shards with the reduced gradients, then (stages 1, 2) gathers
        the updated parameters. Gradients are cleared."""
        if any(u.shard_grad is None for u in self.units):
            raise RuntimeError(
                "step: no reduced gradients (call backward outside no_sync before step)"
            )
        self.optimizer.step([u.shard_grad for u in self.units])
        for u in self.units:
            u.shard_grad = None
            if self.stage < 3:
                self.comm.all_gather(u.full[u.lo : u.hi], u.full)  # in place

    # -- inspection and checkpoints -------------------------------------------------------------

    def full_parameters(self) -> list:
        """Every parameter, whole, on every rank (a gather per unit for stage 3)."""
        out = []
        for u in self.units:
            full = u.full
            if full is None:
                full = self.xp.empty(u.shard * self.comm.size, self.dtype)
                self.comm.all_gather(u.shard_param, full)
            out += [v.copy() for v in self._views(u, full)]
        return out

    def state_bytes(self) -> dict:
        """Bytes of model state this rank holds between steps (parameters, gradients, optimizer
        state), and the unsharded total of one replica."""
        item = np.dtype(self.dtype).itemsize
        full = sum(u.shard * self.comm.size for u in self.units) * item
        shard = sum(u.shard for u in self.units) * item
        numel = sum(u.numel for u in self.units) * item
        per_elem = len(self.optimizer.state_names)  # optimizer buffers per parameter element
        held = {
            "params": full if self.stage < 3 else shard,
            "grads": full if self.stage == 1 else shard,
            "optimizer": self.optimizer.state_bytes(),
        }
        held["total"] = sum(held.values())
        held["unsharded"] = numel * (2 + per_elem)
        return held

    @staticmethod
    def _key(name, i: int) -> str:
        """The checkpoint key of parameter `i` (name None) or of optimizer buffer `name` of it."""
        return f"arr_{i}" if name is None else f"state/{name}/{i}"

    def save(self, path, meta=None):
        """Rank 0 writes the full parameters (``arr_<i>``, as ``DataParallel.save``) and the
        full optimizer state (``state/<buffer>/<i>``) to `path`, atomically; returns on every
        rank once written."""
        root = self.comm.rank == 0
        saved = {}
        for k, u in enumerate(self.units):
            for name, flat in self._gathered(k, u).items():
                if root:
                    for j, v in enumerate(self._views(u, flat)):
                        saved[self._key(name, u.first_param + j)] = self._host(v)
        if root:
            saved["optimizer/steps"] = np.array(self.optimizer.steps, np.int64)
            checkpoint.save(path, saved, meta)
        self.comm.barrier()

    def _gathered(self, k, u):
        """Parameters (key None) and optimizer buffers of unit `u` (the k-th), whole on rank 0."""
        bufs = {None: u.shard_param}
        bufs.update(self.optimizer.state[k])
        out = {}
        for name, shard in bufs.items():
            full = None
            if self.comm.rank == 0:
                full = self.xp.empty(u.shard * self.comm.size, self.dtype)
            self.comm.gather(self.xp.ascontiguousarray(shard), full, root=0)
            out[name] = full
        return out

    def load(self, path) -> dict:
        """Restores parameters and optimizer state from rank 0's reading of `path` (written by
        ``save``, or parameters only by ``DataParallel.save``); returns the saved meta."""
        saved, meta, error = {}, {}, None
        if self.comm.rank == 0:
            try:
                saved, meta = checkpoint.load(path)
            except (OSError, ValueError) as e:
                error = f"cannot read {path}: {e}"
            for u in self.units if error is None else ():
                for j, shape in enumerate(u.shapes):
                    got = saved.get(self._key(None, u.first_param + j))
                    if got is None or got.shape != shape:
                        error = f"{path} does not hold this model's parameter {u.first_param + j}"
        steps = int(saved.get("optimizer/steps", 0))
        error, meta, steps = self.comm.broadcast_object((error, meta, steps), root=0)
        if error is not None:
            raise ValueError(error)
        self.optimizer.steps = steps
        for k, u in enumerate(self.units):
            for name in [None, *self.optimizer.state[k]]:
                full = None
                if self.comm.rank == 0:  # absent optimizer state starts from zero
                    pieces = [saved.get(self._key(name, u.first_param + j)) for j in
                              range(len(u.shapes))]  # fmt: skip
                    full = self._pack(u, pieces, self.xp)
                dst = u.shard_param if name is None else self.optimizer.state[k][name]
                self.comm.scatter(full, dst, root=0)
            if self.stage < 3:
                self.comm.all_gather(u.full[u.lo : u.hi], u.full)
        return meta

    def _host(self, a):
        return a if self.xp is np else self.xp.asnumpy(a)
