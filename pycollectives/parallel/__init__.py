"""Parallel training for models held as numpy or cupy arrays.

- ``data``: data parallel: ``DataParallel`` with its ``GradientBucketer``, the samplers
  (``DistributedSampler``, ``GlobalBatchSampler``), and ``SingleProcessDataParallel``,
  torch's ``nn.DataParallel`` recipe on the thread ranks of ``Communicator.local(n)``;
- ``nn``, ``optim``: layers whose backward takes a per-call cache, SGD and Adam;
- ``ZeroDataParallel`` (``zero``): ZeRO stages 1-3, the model state sharded across ranks;
- ``Pipeline`` (``pipeline``): a model's layers in stages across ranks, GPipe or 1F1B;
- ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP`` (``tensor``): one layer's
  weight split across ranks, Megatron-LM style.

Each has an example under ``pycollectives.examples`` that checks itself against the same
training in one process.
"""

from pycollectives.parallel import nn, optim
from pycollectives.parallel.data import (
    DataParallel,
    DistributedSampler,
    GlobalBatchSampler,
    GradientBucketer,
    SingleProcessDataParallel,
    TrafficCounter,
)
from pycollectives.parallel.pipeline import Pipeline, split_stages, theoretical_bubble
from pycollectives.parallel.tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    full_parameters,
)
from pycollectives.parallel.zero import ZeroDataParallel

__all__ = [
    "ColumnParallelLinear",
    "DataParallel",
    "DistributedSampler",
    "GlobalBatchSampler",
    "GradientBucketer",
    "ParallelMLP",
    "Pipeline",
    "RowParallelLinear",
    "SingleProcessDataParallel",
    "TrafficCounter",
    "ZeroDataParallel",
    "full_parameters",
    "nn",
    "optim",
    "split_stages",
    "theoretical_bubble",
]
