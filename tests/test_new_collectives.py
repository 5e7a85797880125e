"""All-to-all, gather, scatter and uneven all-gather / reduce-scatter on 1-5 ranks against
mpi4py's own collectives, plus mismatch detection and argument checks
(see workers/new_collectives.py)."""

import pytest
from mpi_harness import run_mpi


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5])
def test_new_collectives_match_mpi(nranks):
    out = run_mpi(nranks, "new_collectives.py", "data")
    assert f"PASS data ranks={nranks}" in out


@pytest.mark.parametrize("nranks", [2, 3])
def test_disagreeing_splits_and_counts_raise_on_every_rank(nranks):
    out = run_mpi(nranks, "new_collectives.py", "mismatch")
    assert f"PASS mismatch ranks={nranks}" in out


@pytest.mark.parametrize("nranks", [1, 3])
def test_bad_arguments_raise_before_anything_moves(nranks):
    out = run_mpi(nranks, "new_collectives.py", "args")
    assert f"PASS args ranks={nranks}" in out
