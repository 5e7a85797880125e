"""`op=`: our ops and their names, torch's and MPI's twins translated by meaning, nothing else.
(torch's ReduceOp values compare equal to other integers than ours: AVG == 1 == our PROD.)"""

import pytest
from mpi4py import MPI

import pycollectives as pc
from pycollectives.ops import op_code


@pytest.mark.parametrize(
    "op,want", [(pc.SUM, pc.SUM), ("avg", pc.AVG), ("MAX", pc.MAX), ("prod", pc.PROD)]
)
def test_our_ops_and_names(op, want):
    assert op_code(op) == int(want)


@pytest.mark.parametrize(
    "mpi_op,want", [(MPI.SUM, pc.SUM), (MPI.PROD, pc.PROD), (MPI.MIN, pc.MIN), (MPI.MAX, pc.MAX)]
)
def test_mpi_twins(mpi_op, want):
    assert op_code(mpi_op) == int(want)


def test_torch_twins():
    dist = pytest.importorskip("torch.distributed")
    R = dist.ReduceOp
    pairs = [(R.SUM, pc.SUM), (R.PRODUCT, pc.PROD), (R.MIN, pc.MIN), (R.MAX, pc.MAX)]
    pairs += [(R.AVG, pc.AVG), (R(R.MAX), pc.MAX)]
    for theirs, ours in pairs:
        assert op_code(theirs) == int(ours), theirs
    with pytest.raises(TypeError, match="BAND"):
        op_code(R.BAND)


@pytest.mark.parametrize("bad", [0, 1, 4, True, 2.0, None, MPI.LAND, object()])
def test_anything_else_is_a_type_error(bad):
    with pytest.raises(TypeError, match="op"):
        op_code(bad)


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="sum, prod, min, max, avg"):
        op_code("median")
