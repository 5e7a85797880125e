"""The workers' shared checks (harness/checks.py): inputs every rank makes alike, and checks that
fail on any wrong element."""

import numpy as np
import pytest
from harness import checks
from harness.checks import DTYPES, check_close, make_input, same_bytes


def fresh_pools():
    checks._chunks.clear()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_inputs_do_not_depend_on_what_was_asked_before(dt):
    # A rank makes every rank's input; another rank, having been asked for other inputs
    # before, must make the same ones.
    fresh_pools()
    first = [make_input(q, 300_000, dt, "sum", salt=s) for q in range(5) for s in (0, 3)]
    fresh_pools()
    make_input(7, 5_000_000, dt, "prod")  # longer than the cached part of a pool
    make_input(0, 1, dt, "sum")
    again = [make_input(q, 300_000, dt, "sum", salt=s) for q in range(5) for s in (0, 3)]
    for a, b in zip(first, again):
        assert a.dtype == dt and a.shape == (300_000,)
        same_bytes(a, b, "again")


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_ranks_salts_and_ops_get_different_inputs(dt):
    made = {
        (q, s, op): make_input(q, 1000, dt, op, salt=s)
        for q in range(8)
        for s in range(3)
        for op in checks.OPS
        if checks.valid(dt, op)
    }
    digests = {checks.digest(a) for a in made.values()}
    assert len(digests) == len(made)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_inputs_stay_in_range_and_are_new_arrays(dt):
    x = make_input(2, 100_000, dt, "prod")
    y = make_input(2, 100_000, dt, "sum")
    wide = x.astype(np.float64)
    if checks.is_float(dt):
        assert wide.min() >= 0.5 and wide.max() <= 1.5
        assert np.abs(y.astype(np.float64)).max() <= 2.0
    else:
        assert wide.min() >= (0 if dt.kind == "u" else -3) and wide.max() < 4
        assert np.abs(y.astype(np.float64)).max() <= 1000
    assert len(np.unique(y)) > 100 or dt.itemsize == 1  # not a constant pattern
    before = x.copy()
    x[:] = 0  # the caller's to change: the pools are not
    same_bytes(make_input(2, 100_000, dt, "prod"), before, "made again")
    assert make_input(0, 0, dt, "sum").shape == (0,)


def test_same_bytes_fails_on_one_flipped_bit_and_names_it():
    a = np.linspace(-1, 1, 1000, dtype=np.float32)
    b = a.copy()
    b.view(np.uint32)[617] ^= 1
    with pytest.raises(AssertionError, match=r"x: 1 of 1000 elements wrong, first at \[617\]"):
        same_bytes(b, a, "x")
    z = np.zeros(3)
    with pytest.raises(AssertionError, match="1 of 3"):
        same_bytes(np.array([0.0, -0.0, 0.0]), z, "signed zero")
    with pytest.raises(AssertionError, match="4 x float32 where 3 x float32"):
        same_bytes(np.zeros(4, np.float32), np.zeros(3, np.float32), "size")
    same_bytes(a.reshape(10, 100), a, "shape alone may differ")


def test_check_close_fails_outside_the_tolerance_and_on_nan():
    dt = np.dtype(np.float32)
    want = np.linspace(-3, 3, 5000)  # float64, as reference() makes it
    got = want.astype(dt)
    check_close(got, want, dt, 4, "rounding", "sum")
    bad = got.copy()
    bad[4321] += 1e-3
    with pytest.raises(AssertionError, match=r"1 of 5000 elements wrong, first at \[4321\]"):
        check_close(bad, want, dt, 4, "off", "sum")
    bad = got.copy()
    bad[7] = np.nan
    with pytest.raises(AssertionError, match=r"first at \[7\]: got \S*nan"):
        check_close(bad, want, dt, 4, "nan", "sum")
    ints = np.arange(10, dtype=np.int32)
    check_close(ints.copy(), ints, ints.dtype, 2, "ints", "sum")
    off = ints.copy()
    off[3] += 1
    with pytest.raises(AssertionError, match=r"first at \[3\]"):
        check_close(off, ints, ints.dtype, 2, "ints", "sum")
