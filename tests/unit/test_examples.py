"""The examples' data: the digits read from scikit-learn's file are scikit-learn's digits."""

import numpy as np
import pytest

from pycollectives.examples.common import digits, digits_split


def test_digits_are_scikit_learns():
    datasets = pytest.importorskip("sklearn.datasets")
    want_x, want_y = datasets.load_digits(return_X_y=True)
    x, y = digits()
    assert x.dtype == want_x.dtype and np.array_equal(x, want_x)
    assert y.dtype == np.int64 and np.array_equal(y, want_y)


def test_digits_split_holds_out_a_fifth_the_same_way_on_every_call():
    (xtr, ytr), (xte, yte) = digits_split(3)
    assert len(xtr) + len(xte) == 1797 and len(xte) == 1797 // 5
    assert xtr.dtype == np.float32 and 0.0 <= xtr.min() and xtr.max() <= 1.0
    again = digits_split(3)
    assert np.array_equal(again[0][0], xtr) and np.array_equal(again[1][1], yte)
    assert not np.array_equal(digits_split(4)[1][1], yte)
