"""Property-based argument validation (hypothesis), on every rank with the same examples.

Property: for any array-ish input, a collective either raises ValueError/TypeError whose
message names the offending argument (and then the communicator still works), or it
succeeds with the right answer.
"""

from __future__ import annotations

import numpy as np
from checks import run_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pycollectives as pc

DTYPES = [
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "bool",
    ">f4",
    "<i8",
]
SUPPORTED = {"int8", "uint8", "int32", "int64", "float16", "float32", "float64"}


@st.composite
def arrays(draw):
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    a = np.ones(shape, dt)
    if draw(st.booleans()) and a.ndim and a.shape[-1] > 1:
        a = a[..., ::2]  # not contiguous
    if draw(st.booleans()):
        a.flags.writeable = False
    return a


def main():
    comm = pc.Communicator()
    n = comm.size
    checked = [0]

    @settings(
        max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        x=arrays(),
        out_kind=st.sampled_from(["none", "same", "bigger", "float64", "ro"]),
        op=st.sampled_from(["sum", "max", "avg", "bogus", pc.MAX, 3, None]),
    )
    def all_reduce_validates(x, out_kind, op):
        out = {
            "none": None,
            "same": np.empty_like(x) if x.dtype.kind != "b" else None,
            "bigger": np.empty(x.size + 1, x.dtype),
            "float64": np.empty(x.size, np.float64),
            "ro": np.empty_like(x),
        }[out_kind]
        if out_kind == "ro":
            out.flags.writeable = False
        dt = x.dtype
        ok_dtype = dt.name in SUPPORTED and dt.byteorder != ">"
        if out is None:
            out_ok = x.flags.writeable  # in place
        else:
            out_ok = out.dtype == dt and out.size == x.size and out.flags.writeable
        valid = (
            ok_dtype
            and x.flags.c_contiguous
            and (isinstance(op, pc.ReduceOp) or op in ("sum", "max", "avg"))  # 3: no int
            and not (op == "avg" and dt.kind != "f")
            and out_ok
        )
        before = x.copy()
        try:
            comm.all_reduce(x, out, op=op)
        except (ValueError, TypeError) as e:
            msg = str(e)
            assert not valid, f"valid call rejected: {msg}"
            assert any(w in msg for w in ("x", "out", "op")), msg
            checked[0] += 1
            y = np.ones(3, np.int32)
            comm.all_reduce(y)  # still usable, still in step with the other ranks
            assert np.all(y == n)
            return
        assert valid, f"invalid call accepted: {dt} {x.shape} out={out_kind} op={op}"
        res = x if out is None else out
        if op == "max" or op is pc.MAX:
            assert np.array_equal(res, before)
        elif op == "sum":
            assert np.array_equal(res, before * n)
        checked[0] += 1

    all_reduce_validates()
    comm.close()
    if comm.rank == 0:
        print(f"validation_props examples={checked[0]}")


if __name__ == "__main__":
    run_main(main)
