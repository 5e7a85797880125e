"""Bad input is rejected before any byte moves, on every rank, and the communicator stays usable."""

import pytest
from harness.launch import our_segments, run_mpi


@pytest.mark.parametrize("nranks", [1, 3])
def test_bad_input(nranks):
    before = our_segments()
    run_mpi(nranks, "bad_input.py")
    assert our_segments() == before
