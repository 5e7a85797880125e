"""Data-parallel training: gradient bucketing, a parameter-array model wrapper, a sampler."""

from pycollectives.ddp.bucketer import GradientBucketer, assign_buckets
from pycollectives.ddp.data_parallel import DataParallel
from pycollectives.ddp.sampler import DistributedSampler, GlobalBatchSampler

__all__ = [
    "DataParallel",
    "DistributedSampler",
    "GlobalBatchSampler",
    "GradientBucketer",
    "assign_buckets",
]
