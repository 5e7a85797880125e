"""The soak command: thousands of random collectives, zero wrong elements."""

import numpy as np
from mpi_harness import run_mpi

from pycollectives.soak import count_wrong


def test_soak_2000_random_collectives_on_4_ranks():
    out = run_mpi(4, "run_module.py", "pycollectives.soak", "--iterations", "2000", timeout=300)
    assert "soak: 2000 collectives on 4 ranks" in out, out
    assert "wrong elements: 0, cross-rank differences: 0" in out, out


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
