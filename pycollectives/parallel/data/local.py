"""Single-process data parallelism, as torch's ``nn.DataParallel`` does it, on thread ranks.

One process drives n ranks (``Communicator.local(n)``, one thread each). Every step:

1. replicate: rank 0 broadcasts the parameters to every replica;
2. scatter: rank 0 splits the batch and sends each rank its part;
3. each rank runs forward on its part; the outputs are gathered on rank 0, which computes the
   loss and scatters the output gradients back;
4. each rank runs backward; the gradients are reduced (summed) onto rank 0;
5. rank 0 updates the parameters; the other replicas are stale until the next broadcast.

Rank 0 sends and receives a whole copy of the parameters per other rank and step: the
bottleneck the DP-versus-DDP comparison (``examples.dp_vs_ddp``) measures. ``TrafficCounter``
counts what each rank sends and receives. Example::

    dp = SingleProcessDataParallel(nn.mlp([64, 256, 10], rng), 4, "sgd", lr=0.1)
    for x, y in batches:
        loss = dp.step(x, y)
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

from pycollectives.parallel import nn, optim


def flatten_into(model: nn.Sequential):
    """(flat parameters, flat gradients) of `model`; its layers then hold views of them."""
    params = model.params
    xp = nn.array_module(params[0])
    flat_p = xp.concatenate([p.reshape(-1) for p in params])
    flat_g = xp.zeros_like(flat_p)
    shapes = [p.shape for p in params]
    nn.hand_out(model.layers, nn.flat_views(flat_p, shapes), nn.flat_views(flat_g, shapes))
    return flat_p, flat_g


class TrafficCounter:
    """A communicator that counts the bytes this rank sends and receives, as the algorithm of
    each call moves them: a root sends (broadcast, scatter) or receives (reduce, gather) each
    other rank's share directly; an all-reduce moves 2(n-1)/n of the buffer each way (ring or
    direct) or twice the buffer per tree child. Everything else passes through."""

    def __init__(self, comm):
        self._comm, self.sent, self.received = comm, 0, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _count(self, sent, received):
        self.sent += int(sent)
        self.received += int(received)

    def _rooted(self, root, share, outward):
        """The root sends (`outward`) or receives `share` bytes to or from each other rank;
        each other rank receives or sends its one share."""
        at_root = self.rank == root
        moved = (share * (self._comm.size - 1), 0) if at_root else (0, share)
        self._count(*(moved if outward else moved[::-1]))

    def broadcast(self, x, root=0, **kw):
        self._rooted(root, x.nbytes, outward=True)
        return self._comm.broadcast(x, root, algorithm="direct", **kw)

    def reduce(self, x, out=None, root=0, **kw):
        self._rooted(root, x.nbytes, outward=False)
        return self._comm.reduce(x, out, root, algorithm="direct", **kw)

    def scatter(self, x, out, root=0, **kw):
        self._rooted(root, out.nbytes, outward=True)
        return self._comm.scatter(x, out, root, **kw)

    def gather(self, x, out=None, root=0, **kw):
        self._rooted(root, x.nbytes, outward=False)
        return self._comm.gather(x, out, root, **kw)

    def all_reduce(self, x, out=None, op="sum", algorithm=None, **kw):
        n, b = self._comm.size, x.nbytes
        algo = algorithm or self._comm.algorithm_for("all_reduce", b)
        if algo == "tree":  # a binary tree: up from and down to each child
            children = len([c for c in (2 * self.rank + 1, 2 * self.rank + 2) if c < n])
            parent = 1 if self.rank else 0
            moved = b * (children + parent)
        else:
            moved = 2 * (n - 1) * b / n
        self._count(moved, moved)
        return self._comm.all_reduce(x, out, op, algorithm, **kw)


class SingleProcessDataParallel:
    """`model` trained on `n` thread ranks of this process, as ``nn.DataParallel`` does (see
    the module). `comms`: n local communicators to use (default ``Communicator.local(n)``,
    closed by ``close``). The optimizer lives on rank 0 only."""

    def __init__(self, model: nn.Sequential, n: int, optimizer="sgd", lr=0.01, comms=None,
                 **opt_kw):  # fmt: skip
        from pycollectives.communicator import Communicator

        self._own = comms is None
        comms = Communicator.local(n) if comms is None else comms
        if len(comms) != n:
            raise ValueError(f"{n} ranks but {len(comms)} communicators")
        self.n = n
        self.comms = [TrafficCounter(c) for c in comms]
        self.replicas = [model] + [copy.deepcopy(model) for _ in range(n - 1)]
        flats = [flatten_into(m) for m in self.replicas]
        self.flat_params = [f[0] for f in flats]
        self.flat_grads = [f[1] for f in flats]
        self.model = model
        self.optimizer = optim.make(optimizer, [self.flat_params[0]], lr, **opt_kw)
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="pycoll-dp")

    def step(self, x, labels, loss=nn.softmax_cross_entropy) -> float:
        """One training step on the batch (`x`, `labels`), held by rank 0 (this process);
        returns the loss. The batch must split into n equal parts."""
        b = len(x)
        if b % self.n:
            raise ValueError(f"a batch of {b} does not split into {self.n} equal parts")
        if len(labels) != b:
            raise ValueError(f"{b} inputs but {len(labels)} labels")
        part = b // self.n
        result = {}

        def rank_step(r):
            comm, model, xp = self.comms[r], self.replicas[r], nn.array_module(self.flat_params[r])
            comm.broadcast(self.flat_params[r], root=0)  # replicate
            mine = xp.empty((part,) + x.shape[1:], x.dtype)
            comm.scatter(x if r == 0 else None, mine, root=0)
            out, caches = model.forward(mine)
            gathered = xp.empty((b,) + out.shape[1:], out.dtype) if r == 0 else None
            comm.gather(xp.ascontiguousarray(out), gathered, root=0)
            dout = None
            if r == 0:
                result["loss"], dout = loss(gathered, labels)
            dmine = xp.empty_like(out)
            comm.scatter(dout, dmine, root=0)
            self.flat_grads[r][...] = 0
            model.backward(dmine, caches)
            comm.reduce(self.flat_grads[r], root=0)  # summed onto rank 0
            if r == 0:
                self.optimizer.step([self.flat_grads[0]])

        def guarded(r):
            try:
                rank_step(r)
            except BaseException as e:  # the other ranks' waits end now, not at the timeout
                for c in self.comms:
                    c.abort(f"rank {r} of the data-parallel step failed: {e}")
                raise

        for f in [self._pool.submit(guarded, r) for r in range(self.n)]:
            f.result()
        return float(result["loss"])

    def traffic(self) -> list:
        """(bytes sent, bytes received) by each rank so far."""
        return [(c.sent, c.received) for c in self.comms]

    def close(self):
        self._pool.shutdown()
        if self._own:
            for c in self.comms:
                c.close()


__all__ = ["SingleProcessDataParallel", "TrafficCounter", "flatten_into"]
