"""Ranks that disagree on a collective all raise CollectiveMismatch naming the fields.

Usage: mpiexec -n N python mismatch.py
The last rank deviates in one field per case; every rank must raise, quickly, and the next
communicator must work normally. A rank that only sends in the call (a broadcast's root) may
raise at its next call instead: it used nobody's data, and does not wait for its receivers.
"""

from __future__ import annotations

import time

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc


def cases(comm, odd):
    n = comm.size
    x = np.ones(1000, np.float32)
    y = np.ones(1001 if odd else 1000, np.float32)
    out = np.empty(1000 * n, np.float32)
    return {
        "count": (lambda: comm.all_reduce(y), ["count"]),
        "dtype": (lambda: comm.all_reduce(x.astype(np.float64) if odd else x), ["dtype"]),
        "op": (lambda: comm.all_reduce(x, op="max" if odd else "sum"), ["op"]),
        "root": (lambda: comm.broadcast(x, root=1 if odd else 0), ["root"]),
        "collective": (
            lambda: comm.all_gather(x, out) if odd else comm.all_reduce(x),
            ["collective"],
        ),
        "algorithm": (
            lambda: comm.all_reduce(x, algorithm="tree" if odd else "ring"),
            ["algorithm"],
        ),
        "barrier": (lambda: comm.all_reduce(x) if odd else comm.barrier(), ["collective"]),
    }


def main():
    world = MPI.COMM_WORLD
    odd = world.rank == world.size - 1
    names = list(cases(pc.Communicator(timeout=30), odd))
    for name in names:
        comm = pc.Communicator(timeout=30)
        comm.all_reduce(np.ones(3, np.int32))  # a matching collective first
        fn, fields = cases(comm, odd)[name]
        t0 = time.monotonic()
        try:
            fn()
            if name == "root" and world.rank == (1 if odd else 0):
                comm.all_reduce(np.ones(3, np.int32))  # its root's check comes here at the latest
        except pc.CollectiveMismatch as e:
            msg = str(e)
            took = time.monotonic() - t0
            assert "#2" in msg and "disagree" in msg, msg
            for f in fields:
                assert f in msg, f"{name}: {msg}"
            assert f"rank {world.size - 1}" in msg, msg
            assert took < 5, f"{name}: detected after {took:.1f} s"
        else:
            raise AssertionError(f"{name}: no CollectiveMismatch on rank {world.rank}")
        try:
            comm.all_reduce(np.ones(3, np.int32))
        except pc.CollectiveError as e:
            assert "earlier error" in str(e)
        else:
            raise AssertionError("a communicator that saw a mismatch kept working")
        world.Barrier()  # everyone is done with this communicator
        comm.close()
    with pc.Communicator() as comm:
        x = np.ones(10, np.float32)
        comm.all_reduce(x)
        assert np.all(x == comm.size)
    if world.rank == 0:
        print(f"mismatch cases={len(names)}")


if __name__ == "__main__":
    run_main(main)
