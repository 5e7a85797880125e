"""Data-parallel training: every rank holds the whole model and trains on its share of the data.

- ``GradientBucketer`` (``bucketer``): gradients in flat buckets, each all-reduced as soon as it
  is full (``assign_buckets`` lays them out);
- ``DataParallel`` (``data_parallel``): a model held as parameter and gradient arrays, its
  gradients averaged through the bucketer;
- ``DistributedSampler``, ``GlobalBatchSampler`` (``sampler``): each rank's shard of a dataset;
- ``SingleProcessDataParallel`` (``local``): torch's ``nn.DataParallel`` recipe on the thread
  ranks of ``Communicator.local(n)``, with ``TrafficCounter``.
"""

from pycollectives.parallel.data.bucketer import GradientBucketer, assign_buckets
from pycollectives.parallel.data.data_parallel import DataParallel
from pycollectives.parallel.data.local import SingleProcessDataParallel, TrafficCounter
from pycollectives.parallel.data.sampler import DistributedSampler, GlobalBatchSampler

__all__ = [
    "DataParallel",
    "DistributedSampler",
    "GlobalBatchSampler",
    "GradientBucketer",
    "SingleProcessDataParallel",
    "TrafficCounter",
    "assign_buckets",
]
