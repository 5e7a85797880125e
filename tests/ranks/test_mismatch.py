"""Ranks that disagree on a collective all raise CollectiveMismatch (see workers/mismatch.py)."""

import pytest
from harness.launch import our_segments, run_mpi


@pytest.mark.parametrize("nranks", [2, 3])
def test_mismatch_detected_on_every_rank(nranks):
    before = our_segments()
    run_mpi(nranks, "mismatch.py", timeout=120)
    assert our_segments() == before
