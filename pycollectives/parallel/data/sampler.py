"""DistributedSampler with torch's semantics."""

from __future__ import annotations

import math

import numpy as np


class DistributedSampler:
    """Indices of one rank's shard of a dataset, reshuffled every epoch.

    As ``torch.utils.data.DistributedSampler``: with ``shuffle`` the order is a permutation
    seeded by ``seed + epoch`` (call ``set_epoch`` every epoch); the list is padded by
    repeating its start so that it divides evenly (or, with ``drop_last``, cut down); rank r
    takes every `num_replicas`-th index starting at r. Every rank has the same length.

    Example::

        sampler = pc.DistributedSampler(len(data), comm.size, comm.rank, seed=0)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for idx in sampler: ...
    """

    def __init__(self, dataset_len, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last and dataset_len % num_replicas:
            self.num_samples = math.ceil((dataset_len - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        if self.shuffle:
            idx = np.random.default_rng(self.seed + self.epoch).permutation(self.dataset_len)
        else:
            idx = np.arange(self.dataset_len)
        if not self.drop_last:
            pad = self.total_size - len(idx)
            if pad > 0:
                idx = np.concatenate([idx, np.resize(idx, pad)])
        else:
            idx = idx[: self.total_size]
        return idx[self.rank : self.total_size : self.num_replicas]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples


class GlobalBatchSampler:
    """Step-indexed batches of a fixed global size, shared among however many ranks there are
    now: what elastic training takes its data from, since the world may shrink or grow between
    steps (``Communicator.shrink``, ``grow``). Step s takes `batch_size` indices from a
    permutation of the data seeded per pass over it (``seed + pass``), whatever the world
    size; rank r of w takes the r-th of ``numpy.array_split``'s w shares.

    The shares differ by at most one sample. Scaling each rank's mean gradient by ``weight``
    (w * share / batch_size) before averaging over the ranks (``DataParallel``) gives the mean
    over the step's samples, on any number of ranks.

    Example::

        batches = pc.GlobalBatchSampler(len(x), 64, seed=0)
        idx, weight = batches.share(step, comm.rank, comm.size)
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int = 0):
        if not 0 < batch_size <= dataset_len:
            raise ValueError(f"batch_size must be in [1, {dataset_len}], got {batch_size}")
        self.dataset_len, self.batch_size, self.seed = dataset_len, batch_size, seed
        self.per_pass = dataset_len // batch_size

    def batch(self, step: int) -> np.ndarray:
        """The indices of step `step`, every rank's together."""
        order = np.random.default_rng(self.seed + step // self.per_pass)
        at = (step % self.per_pass) * self.batch_size
        return order.permutation(self.dataset_len)[at : at + self.batch_size]

    def share(self, step: int, rank: int, world: int) -> tuple[np.ndarray, float]:
        """(rank `rank`'s indices of step `step` among `world` ranks, its weight)."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for {world} ranks")
        part = np.array_split(self.batch(step), world)[rank]
        return part, world * len(part) / self.batch_size
