"""Every collective on 1-5 ranks against numpy and MPI references (see workers/collectives.py)."""

import pytest
from mpi_harness import run_mpi

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]


@pytest.mark.parametrize("staging", ["small", "default"])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5])
def test_collective_matrix(nranks, collective, staging):
    out = run_mpi(nranks, "collectives.py", collective, staging)
    assert f"PASS {collective} ranks={nranks}" in out
