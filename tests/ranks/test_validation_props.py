"""Property-based argument validation (see workers/validation_props.py)."""

import pytest
from harness.launch import run_mpi

pytest.importorskip("hypothesis")


@pytest.mark.parametrize("nranks", [1, 2])
def test_validation_properties(nranks):
    run_mpi(nranks, "validation_props.py", timeout=300)
