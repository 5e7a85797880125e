"""Bucket layout and sampler, without processes."""

import numpy as np
import pytest

from pycollectives.parallel.data import DistributedSampler, assign_buckets

MB = 1 << 20


def layout(sizes, order=None, first=1 * MB, cap=25 * MB, dtypes=None):
    shapes = [((n,), np.dtype(dtypes[i] if dtypes else np.float32)) for i, n in enumerate(sizes)]
    order = list(reversed(range(len(sizes)))) if order is None else order
    return assign_buckets(shapes, order, first, cap)


def test_reverse_order_first_bucket_small_then_cap():
    # 10 params of 128 Ki floats (512 KiB each): the first bucket (1 MiB) holds 2, then 2 MiB each.
    buckets = layout([128 << 10] * 10, cap=2 * MB)
    assert [b.params for b in buckets] == [[9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]
    assert all(b.size * 4 <= (MB if b.index == 0 else 2 * MB) for b in buckets)


def test_offsets_are_contiguous_and_views_never_split():
    sizes = [3, 1000, 7, 300000, 5]
    buckets = layout(sizes, first=4096, cap=64 * 1024)
    seen = []
    for b in buckets:
        off = 0
        for i, o in zip(b.params, b.offsets):
            assert o == off
            off += sizes[i]
            seen.append(i)
        assert off == b.size
    assert sorted(seen) == list(range(len(sizes)))
    big = next(b for b in buckets if 3 in b.params)
    assert big.params == [3], "a gradient larger than the cap gets a bucket of its own"


def test_one_dtype_per_bucket():
    buckets = layout([10, 10, 10, 10], dtypes=["float32", "float64", "float64", "float32"])
    for b in buckets:
        assert (
            len({np.dtype(["float32", "float64", "float64", "float32"][i]) for i in b.params}) == 1
        )


def test_explicit_order_is_followed():
    buckets = layout([10] * 5, order=[2, 0, 4, 1, 3])
    assert [i for b in buckets for i in b.params] == [2, 0, 4, 1, 3]


@pytest.mark.parametrize(
    "n,replicas,drop_last",
    [(10, 3, False), (10, 3, True), (9, 3, False), (2, 4, False), (17, 5, True)],
)
def test_sampler_shards(n, replicas, drop_last):
    shards = [
        DistributedSampler(n, replicas, r, shuffle=True, seed=3, drop_last=drop_last)
        for r in range(replicas)
    ]
    lens = {len(s) for s in shards}
    assert len(lens) == 1
    idx = [s.indices() for s in shards]
    assert all(len(i) == len(shards[0]) for i in idx)
    union = np.concatenate(idx)
    if drop_last:
        assert len(set(union.tolist())) == len(union)  # no repeats when cutting down
        assert len(union) == n - n % replicas
    else:
        assert set(union.tolist()) == set(range(n))  # padding repeats, never omits
        assert len(union) == -(-n // replicas) * replicas


def test_sampler_epochs_reshuffle_identically_on_every_rank():
    a = DistributedSampler(100, 4, 1, seed=7)
    b = DistributedSampler(100, 4, 1, seed=7)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b)
    b.set_epoch(2)
    assert list(a) != list(b)


def test_sampler_matches_torch_without_shuffle():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler as TorchSampler

    for n, replicas, drop_last in [(10, 3, False), (10, 3, True), (7, 4, False)]:
        data = list(range(n))
        for r in range(replicas):
            theirs = list(TorchSampler(data, replicas, r, shuffle=False, drop_last=drop_last))
            ours = list(DistributedSampler(n, replicas, r, shuffle=False, drop_last=drop_last))
            assert ours == theirs, (n, replicas, r, drop_last)
    assert torch.__version__
