"""Stock PyTorch DistributedDataParallel on the "pycollectives" backend.

    mpiexec -n 4 python -m pycollectives.examples.torch_ddp [--epochs 10]
    torchrun --nproc_per_node 4 -m pycollectives.examples.torch_ddp [--epochs 10]

A torch training script, unchanged but for the backend's name: an MLP classifies
scikit-learn's bundled digits, each rank trains on its shard (torch's DistributedSampler),
and torch's own DistributedDataParallel averages the gradients, over pycollectives' shared
memory instead of gloo. Under mpiexec ``pycollectives.torch.init_process_group()`` takes rank,
size and the rendezvous from MPI; under torchrun it is ``dist.init_process_group``. At the end
every rank compares its parameters with rank 0's (replicas must be identical) and rank 0
prints the held-out accuracy. ``--backend gloo`` runs the same job on gloo.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import pycollectives.torch as pct
from pycollectives.examples.common import digits_mlp_parser, digits_split


def data(seed: int):
    (xtr, ytr), (xte, yte) = (tuple(map(torch.from_numpy, part)) for part in digits_split(seed))
    return torch.utils.data.TensorDataset(xtr, ytr), (xte, yte)


def main(argv=None):
    ap = digits_mlp_parser("stock torch DDP on the pycollectives backend", epochs=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=(pct.BACKEND, "gloo"), default=pct.BACKEND)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # ranks share the machine's cores
    if args.backend == pct.BACKEND:
        pct.init_process_group()  # the one change from a gloo or NCCL script
    else:
        pct.init_process_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    train, (xte, yte) = data(args.seed)
    sampler = torch.utils.data.distributed.DistributedSampler(train, seed=args.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    t0 = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        if rank == 0:
            print(f"epoch {epoch + 1:>3}  loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - t0

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    identical = torch.equal(flat, ref)
    ok = torch.tensor([int(identical)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        print(
            f"{args.backend}: {size} ranks, {steps} steps in {elapsed:.2f} s "
            f"({elapsed / steps * 1e3:.2f} ms/step); test accuracy {acc:.4f}; "
            f"replicas identical: {'yes' if ok.item() else 'NO'}"
        )
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
