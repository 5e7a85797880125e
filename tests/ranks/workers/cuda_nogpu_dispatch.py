"""Communicator with CUDA arrays where CUDA cannot run (no GPU, or several nodes): every rank
gets the same clear error, nothing hangs, and host collectives keep working.

Usage: mpiexec -n N python cuda_nogpu_dispatch.py CASE
  nogpu      every rank passes a CUDA array: CollectiveError naming why, twice
  mixed      rank 0 passes a CUDA array, the others numpy: CollectiveMismatch everywhere
  badinput   a CUDA array of an unsupported dtype: TypeError on the caller, before anything moves
  nodes      a communicator over several (emulated) nodes refuses CUDA arrays
  registered comm.empty(device="cuda") and comm.register of a CUDA array: CollectiveError on
             every rank (no CUDA), the same for later GPU calls; host memory is a TypeError
             for register, a ValueError for a bad device name; host collectives keep working
"""

from __future__ import annotations

import sys

import numpy as np
from checks import expect, run_main

import pycollectives as pc


class FakeCudaArray:
    """Looks like device memory (``__cuda_array_interface__``); never dereferenced."""

    def __init__(self, count, typestr="<f4"):
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": typestr,
            "data": (0x7F0000000000, False),
            "strides": None,
            "version": 3,
        }
        self.device = 0


def host_still_works(comm):
    x = np.full(5, comm.rank + 1, np.int64)
    comm.all_reduce(x)
    assert (x == comm.size * (comm.size + 1) // 2).all(), x


def main():
    case = sys.argv[1]
    comm = pc.Communicator(timeout=20)
    r = comm.rank
    if case == "nogpu":
        first = expect(
            pc.CollectiveError, lambda: comm.all_reduce(FakeCudaArray(8)), "CUDA", "rank 0"
        )
        again = expect(pc.CollectiveError, lambda: comm.broadcast(FakeCudaArray(8)), "CUDA")
        assert first == again, (first, again)
        host_still_works(comm)
    elif case == "mixed":
        x = FakeCudaArray(8) if r == 0 else np.zeros(8, np.float32)
        expect(pc.CollectiveMismatch, lambda: comm.all_reduce(x))
    elif case == "badinput":
        if r == 0:
            expect(TypeError, lambda: comm.all_reduce(FakeCudaArray(8, "<c8")), "dtype")
            out = FakeCudaArray(3)
            expect(ValueError, lambda: comm.all_gather(FakeCudaArray(2), out), "elements")
            expect(TypeError, lambda: comm.all_reduce(np.zeros(2), stream=0), "stream")
        host_still_works(comm)
    elif case == "registered":
        expect(TypeError, lambda: comm.register(np.zeros(4, np.float32)), "CUDA arrays")
        expect(ValueError, lambda: comm.empty(4, device="gpu"), "device")
        first = expect(pc.CollectiveError, lambda: comm.empty(8, device="cuda"), "CUDA", "rank 0")
        again = expect(pc.CollectiveError, lambda: comm.register(FakeCudaArray(8)), "CUDA")
        assert first == again, (first, again)
        assert comm.empty(3, np.float64).shape == (3,)  # host shared memory, as before
        host_still_works(comm)
    elif case == "nodes":
        assert comm.topology.num_nodes > 1
        expect(pc.CollectiveError, lambda: comm.all_reduce(FakeCudaArray(8)), "nodes")
        host_still_works(comm)
    else:
        raise SystemExit(f"unknown case {case}")
    if case != "mixed":
        comm.close()
    print(f"{case} rank={r}")


if __name__ == "__main__":
    run_main(main)
