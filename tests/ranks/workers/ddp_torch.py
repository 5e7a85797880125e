"""The torch adapter: same parameters as 1 rank with the whole batch, and as torch's own
DistributedDataParallel over gloo, after several steps on the same data."""

from __future__ import annotations

import copy
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from checks import run_main
from mpi4py import MPI
from torch_nets import BranchNet

import pycollectives as pc
from pycollectives.torch import DistributedDataParallel as OurDDP


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 5),
    )


def train(model, batches, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none: the adapter must cope with fresh gradient tensors
    return model


def run_semantics(model, r, dtype, steps=4):
    """Trains a BranchNet whose extra head is used only on rank 0's even steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + r)
    for step in range(steps):
        x = (torch.randn(8, 20, generator=g) + r).to(dtype)
        y = torch.randint(0, 5, (8,), generator=g)
        out = model(x, use_extra=(r == 0 and step % 2 == 0))
        torch.nn.functional.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
    return model.module


def check_torch_semantics(comm, r, n):
    """Buffers broadcast every forward, unused parameters, bfloat16: as torch DDP on gloo."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        torch.manual_seed(5 + r)  # replicas start apart: the wrappers broadcast rank 0's
        base = BranchNet().to(dtype)
        ours = run_semantics(
            OurDDP(copy.deepcopy(base), comm, find_unused_parameters=True, device_ids=None),
            r,
            dtype,
        )
        theirs = run_semantics(
            torch.nn.parallel.DistributedDataParallel(
                copy.deepcopy(base), find_unused_parameters=True
            ),
            r,
            dtype,
        )
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{dtype} {name}")
    for bad, words in (({"process_group": None}, "Communicator"), ({"bogus": 1}, "bogus")):
        try:
            OurDDP(BranchNet(), comm, **bad)
        except TypeError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted")


def check_comm_hooks(comm, r, n, batches):
    """register_comm_hook: torch's fp16 hook gives torch DDP's parameters (gloo, same hook);
    a hook's value is what lands in the gradients; misuse is refused."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    base = make_model(3)
    ours = OurDDP(copy.deepcopy(base), comm, bucket_cap_mb=0.01, first_bucket_mb=0.005)
    ours.register_comm_hook(None, default_hooks.fp16_compress_hook)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(ours, batches)
    train(theirs, batches)
    for p, q in zip(ours.module.parameters(), theirs.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3)
    # A hook returning zeros: no parameter moves (plain SGD), on every bucket.
    calls = []

    def zeros(state, bucket):
        calls.append((state, bucket.index(), bucket.is_last(), len(bucket.parameters())))
        fut = torch.futures.Future()
        fut.set_result(torch.zeros_like(bucket.buffer()))
        return fut

    still = OurDDP(copy.deepcopy(base), comm, bucket_cap_mb=0.01, first_bucket_mb=0.005)
    still.register_comm_hook("s", zeros)
    train(still, batches[:2])
    for p, q in zip(still.module.parameters(), base.parameters()):
        assert torch.equal(p, q), "a comm hook's result did not reach the gradients"
    nb = len(still.bucketer.buckets)
    assert len(calls) == 2 * nb and calls[nb - 1][2] and calls[0][0] == "s", calls
    assert sum(c[3] for c in calls[:nb]) == len(list(base.parameters())), calls
    for bad, err in (((None, zeros), RuntimeError), ((None, 5), TypeError)):
        try:
            (still if err is RuntimeError else OurDDP(make_model(), comm)).register_comm_hook(*bad)
        except err:
            pass
        else:
            raise AssertionError(f"register_comm_hook{bad} was accepted")


def main():
    world = MPI.COMM_WORLD
    n, r = world.size, world.rank
    steps, b = 5, 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * n * b, 20, generator=g)
    y = torch.randint(0, 5, (steps * n * b,), generator=g)
    mine = [
        (
            x[k * n * b + r * b : k * n * b + (r + 1) * b],
            y[k * n * b + r * b : k * n * b + (r + 1) * b],
        )
        for k in range(steps)
    ]
    whole = [(x[k * n * b : (k + 1) * n * b], y[k * n * b : (k + 1) * n * b]) for k in range(steps)]

    base = make_model(0)
    ref = train(copy.deepcopy(base), whole)

    comm = pc.Communicator()
    ours_module = make_model(0 if r == 0 else 100 + r)  # replaced by rank 0's at construction
    ours = OurDDP(ours_module, comm, bucket_cap_mb=0.01, first_bucket_mb=0.005)
    assert len(ours.bucketer.buckets) > 1
    train(ours, mine)

    path = world.bcast(tempfile.mktemp() if r == 0 else None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=r, world_size=n)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    train(theirs, mine)

    for (name, p), q, t in zip(
        ours_module.named_parameters(), ref.parameters(), theirs.module.parameters()
    ):
        for want, what in (
            (q, "1 rank with the whole batch"),
            (t, "torch DistributedDataParallel (gloo)"),
        ):
            np.testing.assert_allclose(
                p.detach().numpy(),
                want.detach().numpy(),
                rtol=1e-4,
                atol=1e-5,
                err_msg=f"{name} vs {what}",
            )

    # no_sync: two local backward passes accumulate, the third averages the sum.
    model = OurDDP(make_model(3), comm, first_bucket_mb=0.005)
    xs = [torch.full((2, 20), float(r + k)) for k in range(3)]
    with model.no_sync():
        for k in range(2):
            model(xs[k]).sum().backward()
    model(xs[2]).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    local = make_model(3)
    local.load_state_dict(model.module.state_dict())  # rank 0's weights, as broadcast
    sums = []
    for rank in range(n):
        local.zero_grad()
        for k in range(3):
            local(torch.full((2, 20), float(rank + k))).sum().backward()
        sums.append([q.grad.clone() for q in local.parameters()])
    for i, gi in enumerate(got):
        want = sum(s[i] for s in sums) / n
        np.testing.assert_allclose(gi.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)

    check_torch_semantics(comm, r, n)
    check_comm_hooks(comm, r, n, mine)
    dist.destroy_process_group()
    comm.close()
    world.Barrier()
    if r == 0:
        os.unlink(path) if os.path.exists(path) else None
        print("ddp_torch")


if __name__ == "__main__":
    run_main(main)
