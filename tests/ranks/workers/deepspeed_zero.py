"""DeepSpeed's ZeRO (stages 2 and 3) on the pycollectives backend, initialised the way
DeepSpeed does it (``deepspeed.init_distributed``, an env:// launch), against the same training
in one process: Adam on the mean of every rank's loss. Under torchrun, over one machine or two
emulated ones (PYCOLL_HOST_ID per agent).

Usage: torchrun ... deepspeed_zero.py (or the "deepspeed" case of torch_backend.py)
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pycollectives.torch as pct  # noqa: E402  (registers the backend)

STEPS, BATCH, LR = 3, 4, 1e-2


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(BATCH, 12, generator=g) for _ in range(STEPS)]


def one_process(n):
    """The reference: every rank's batches in one process, the mean of their losses."""
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    data = [batches(q) for q in range(n)]
    for step in range(STEPS):
        loss = sum(m(data[q][step]).square().mean() for q in range(n)) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def zero(stage, r):
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False, "weight_decay": 0},
        },
        "zero_force_ds_cpu_optimizer": False,
    }
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config)
    for x in batches(r):
        engine.backward(engine(x).square().mean())
        engine.step()
    params = list(engine.module.parameters())
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(params):
            return torch.cat([p.detach().reshape(-1).clone() for p in params])
    return torch.cat([p.detach().reshape(-1) for p in params])


def check_zero(gloo=None):
    """ZeRO-2 and ZeRO-3 on the default group (initialised already, or here as DeepSpeed
    does) against the one-process training; a case of torch_backend.py too."""
    deepspeed.init_distributed(dist_backend="pycollectives")
    r, n = dist.get_rank(), dist.get_world_size()
    want_nodes = os.environ.get("PYCOLL_EXPECT_NODES")
    if want_nodes:
        assert pct.communicator().topology.num_nodes == int(want_nodes)
    want = one_process(n)
    for stage in (2, 3):
        got = zero(stage, r)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"ZeRO-{stage}")
        sys.stdout.write(f"deepspeed zero{stage} rank={r}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    check_zero()
    dist.destroy_process_group()
