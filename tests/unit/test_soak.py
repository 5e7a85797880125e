"""The soak command's count of wrong elements."""

import numpy as np

from pycollectives.soak import count_wrong


def test_soak_counts_wrong_elements():
    want = np.arange(10, dtype=np.float64)
    got = want.astype(np.float32)
    assert count_wrong(got, want, got.dtype, 4, "sum") == 0
    got[3] += 0.5
    assert count_wrong(got, want, got.dtype, 4, "sum") == 1
    ints = np.arange(10, dtype=np.int32)
    bad = ints.copy()
    bad[[1, 7]] = -1
    assert count_wrong(bad, ints, ints.dtype, 2, "max") == 2
