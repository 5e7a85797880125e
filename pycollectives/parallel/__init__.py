"""Parallel training beyond data parallel, for models held as numpy or cupy arrays.

- ``nn``, ``optim``: layers whose backward takes a per-call cache, SGD and Adam;
- ``ZeroDataParallel`` (``zero``): ZeRO stages 1-3, the model state sharded across ranks;
- ``Pipeline`` (``pipeline``): a model's layers in stages across ranks, GPipe or 1F1B;
- ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP`` (``tensor``): one layer's
  weight split across ranks, Megatron-LM style;
- ``SingleProcessDataParallel`` (``local_dp``): torch's ``nn.DataParallel`` recipe on the
  thread ranks of ``Communicator.local(n)``.

Each has an example under ``pycollectives.examples`` that checks itself against the same
training in one process.
"""

from pycollectives.parallel import nn, optim
from pycollectives.parallel.local_dp import SingleProcessDataParallel, TrafficCounter
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
