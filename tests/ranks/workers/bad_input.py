"""Bad arguments raise ValueError/TypeError naming the argument, and the communicator stays usable.

Each rank makes the same mistakes; after each one a real all-reduce must still give the right
answer on every rank (so nothing moved and no counter drifted).
"""

from __future__ import annotations

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc


def expect(exc, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        msg = str(e)
        for w in words:
            assert w in msg, f"message {msg!r} lacks {w!r}"
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")


def main():
    # Configuration errors surface before any rendezvous, on every rank alike.
    expect(ValueError, ["staging_slots", "[2, 64]"], pc.Communicator, staging_slots=1)
    expect(ValueError, ["staging_bytes", "64"], pc.Communicator, staging_bytes=100)
    expect(ValueError, ["timeout"], pc.Communicator, timeout=0)
    world = MPI.COMM_WORLD
    if world.size > 1:  # ranks that disagree: a ValueError naming each rank's, on every rank
        mine = 4096 << (world.rank % 2)
        words = ["disagree on the staging configuration", "rank 0: (4096, ", "rank 1: (8192, "]
        expect(ValueError, words, pc.Communicator, staging_bytes=mine)
    with pc.Communicator() as comm:
        n, r = comm.size, comm.rank
        f32 = np.ones(8, np.float32)
        cases = [
            # (exception, words in the message, callable, args, kwargs)
            (TypeError, ["x", "numpy"], comm.all_reduce, ([1.0, 2.0],), {}),
            (ValueError, ["x", "contiguous"], comm.all_reduce, (np.ones(16, np.float32)[::2],), {}),
            (TypeError, ["x", "dtype"], comm.all_reduce, (np.ones(4, np.complex64),), {}),
            (TypeError, ["x", "dtype"], comm.all_reduce, (np.ones(4, bool),), {}),
            (TypeError, ["x", "dtype"], comm.all_reduce, (np.ones(4, ">f4"),), {}),
            (
                TypeError,
                ["out", "dtype", "float64"],
                comm.all_reduce,
                (f32, np.empty(8, np.float64)),
                {},
            ),
            (ValueError, ["out", "elements"], comm.all_reduce, (f32, np.empty(9, np.float32)), {}),
            (ValueError, ["op"], comm.all_reduce, (f32,), {"op": "median"}),
            (TypeError, ["op", "int"], comm.all_reduce, (f32,), {"op": 17}),
            (TypeError, ["op", "int"], comm.all_reduce, (f32,), {"op": 1}),  # not PROD
            (ValueError, ["avg", "int32"], comm.all_reduce, (np.ones(4, np.int32),), {"op": "avg"}),
            (ValueError, ["algorithm"], comm.all_reduce, (f32,), {"algorithm": "carrier-pigeon"}),
            (ValueError, ["root", "range"], comm.broadcast, (f32,), {"root": n}),
            (ValueError, ["root", "range"], comm.reduce, (f32,), {"root": -1}),
            (
                ValueError,
                ["out", "elements"],
                comm.all_gather,
                (f32, np.empty(8 * n + 1, np.float32)),
                {},
            ),
            (
                ValueError,
                ["x", "elements"],
                comm.reduce_scatter,
                (np.ones(8 * n + 1, np.float32), np.empty(8, np.float32)),
                {},
            ),
            (ValueError, ["overlap"], comm.all_reduce, (f32[:6], f32[2:]), {}),
        ]
        ro = np.ones(8, np.float32)
        ro.flags.writeable = False
        cases += [
            (ValueError, ["x", "read-only"], comm.all_reduce, (ro,), {}),
            (ValueError, ["out", "read-only"], comm.all_reduce, (f32, ro), {}),
            (ValueError, ["x", "read-only"], comm.broadcast, (ro,), {}),
            (ValueError, ["avg", "uint8"], comm.all_reduce, (np.ones(4, np.uint8),), {"op": "avg"}),
        ]
        for exc, words, fn, args, kwargs in cases:
            before = comm.seq
            expect(exc, words, fn, *args, **kwargs)
            assert comm.seq == before, "a rejected call must not start a collective"
            # Still usable, and still in step with the other ranks.
            x = np.full(5, r + 1, np.int64)
            comm.all_reduce(x)
            assert np.all(x == n * (n + 1) // 2), x
        # Read-only x is fine where nothing is written to it.
        out = np.empty(8, np.float32)
        comm.all_reduce(ro, out)
        assert np.all(out == n)
        if r == 0:
            print(f"bad_input cases={len(cases)}")
    # After close, a clear error rather than a crash.
    expect(pc.CollectiveError, ["closed"], comm.all_reduce, f32)
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    run_main(main)
