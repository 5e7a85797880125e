"""All-gather on 2 ranks written straight into the peer's output (host/single_copy.h) against
mpi4py's Allgather.

Usage: mpiexec -n 2 python single_copy.py data|mismatch   (run with PYCOLL_SINGLE_COPY_BYTES
low, so that small blocks take the path)
data:     every dtype, out of place and in place, blocks of one element up to several of the
          path's 256 KiB blocks and odd lengths, async_op; then prints the algorithm chosen
          for a large block (direct where the kernel allows it, else the staged ring).
mismatch: ranks that disagree on the count raise CollectiveMismatch, and neither output is
          written past what the rank asked for.
"""

from __future__ import annotations

import numpy as np
from checks import DTYPES, expect, make_input, run_main, run_mode
from mpi4py import MPI

import pycollectives as pc


def mpi_view(a):
    return a.view(np.uint16) if a.dtype.itemsize == 2 and a.dtype.kind != "i" else a


def data(mpi, c):
    r = mpi.rank
    for dt in DTYPES:
        for count in (1, 17, 4096, 70001, (600 << 10) // dt.itemsize + 3):
            x = make_input(r, count, dt, "sum")
            want = np.empty(2 * count, dt)
            mpi.Allgather(mpi_view(x), mpi_view(want))
            out = np.full(2 * count, 7, dt)
            c.all_gather(x, out)
            assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (dt, count, "oop")
            assert np.array_equal(x, make_input(r, count, dt, "sum")), "input written"
            ip = np.full(2 * count, 7, dt)
            ip[r * count : (r + 1) * count] = x
            c.all_gather(ip[r * count : (r + 1) * count], ip)
            assert np.array_equal(ip.view(np.uint8), want.view(np.uint8)), (dt, count, "in place")
            out[:] = 0
            c.all_gather(x, out, async_op=True).wait()
            assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (dt, count, "async")
    print(f"rank {r} algorithm {c.algorithm_for('all_gather', 64 << 20)}")


def mismatch(mpi, c):
    r = mpi.rank
    count = 5000 + 10 * r
    out = np.zeros(2 * count + 64, np.float32)
    expect(
        pc.CollectiveMismatch, lambda: c.all_gather(np.ones(count, np.float32), out[: 2 * count])
    )
    assert not out[2 * count :].any(), "written past the output"


def main():
    assert MPI.COMM_WORLD.size == 2
    run_mode({"data": data, "mismatch": mismatch})


if __name__ == "__main__":
    run_main(main)
