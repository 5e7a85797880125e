"""Exchanges between ranks under mpiexec are bounded (bootstrap.MpiGroup.meet): a rank that
never comes to a split is named by every other within the timeout, ranks that reach
different exchanges all raise, and the group keeps working where every rank comes."""

import sys
import time

from checks import expect, run_main
from mpi4py import MPI

import pycollectives as pc
from pycollectives.runtime.bootstrap import MpiGroup


def main():
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    late = n - 1
    # Every rank comes: a split and a rendezvous, as a Communicator's set-up makes them.
    g = MpiGroup(world, timeout=1.0)
    part = g.split(r % 2, -r)
    assert (part.rank, part.size) == (sorted(range(r % 2, n, 2), reverse=True).index(r),
                                      len(range(r % 2, n, 2)))  # fmt: skip
    assert part.allgather(r) == sorted(range(r % 2, n, 2), reverse=True)
    part.free()
    # The last rank fails before the split (here: it does not call it): the others raise
    # CollectiveTimeout naming it, within the timeout (1 s) and a little.
    g = MpiGroup(world, timeout=1.0)
    if r != late:
        start = time.monotonic()
        expect(pc.CollectiveTimeout, lambda: g.split(0, r), f"split: rank(s) [{late}] did not come")
        took = time.monotonic() - start
        assert 0.9 < took < 3.0, took
    world.Barrier()
    # Ranks at different exchanges: the last at a rendezvous, the others at a split. Every
    # rank raises, none waits in an MPI call the others never make.
    g = MpiGroup(world, timeout=5.0)
    start = time.monotonic()
    if r == late:
        expect(pc.CollectiveError, lambda: g.allgather(r), "ranks disagree", "is at split")
    else:
        expect(pc.CollectiveError, lambda: g.split(0, r), "ranks disagree", "a rendezvous")
    assert time.monotonic() - start < 3.0
    world.Barrier()
    sys.stdout.write(f"rank {r} ok\n")
    sys.stdout.flush()


if __name__ == "__main__":
    run_main(main)
