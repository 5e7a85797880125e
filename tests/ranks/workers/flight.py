"""Flight recorder drills on 3 ranks, each on a communicator of its own whose records go to
FLIGHT_DIR/<drill>; test_flight.py reads them back and runs the analyzer on them.

- skipped: rank 1 skips broadcast #4 and calls all-reduce #5 as its #4: every rank raises
  CollectiveMismatch and writes its ring;
- hang: rank 1 skips broadcast #4 and computes: ranks 0 and 2 time out, write their rings and
  ask rank 1 for its own (SIGUSR1), which its recorder writes while it computes;
- asked: point-to-point and asynchronous calls, then SIGUSR1 to every rank: each writes its
  ring with no failure;
- dead: rank 2 exits in the middle; the survivors raise and write theirs.

Usage: mpiexec -disable-auto-cleanup -n 3 python flight.py (FLIGHT_DIR set)
       mpiexec -n 4 python flight.py nodes (on 2 nodes: the skipped call across them)
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from checks import expect, hard_exit, run_main
from mpi4py import MPI

import pycollectives as pc

BASE = os.environ["FLIGHT_DIR"]
# Every drill's communicator stays open to the end: the SIGUSR1 of later drills reaches their
# recorders too, and must not replace a failure's record.
OPEN = []


def fresh(drill: str) -> pc.Communicator:
    os.environ["PYCOLL_FLIGHT_DIR"] = os.path.join(BASE, drill)
    OPEN.append(pc.Communicator(timeout=1.0))
    return OPEN[-1]


def steps(comm, x, n, skip_at=None):
    """n steps of all-reduce then broadcast; rank 1 leaves out the broadcast of step
    `skip_at` (collective #2 * skip_at + 2)."""
    for step in range(n):
        comm.all_reduce(x)
        if comm.rank == 1 and step == skip_at:
            continue
        comm.broadcast(x, root=0)


def skipped():
    comm = fresh("skipped")
    x = np.ones(4, np.float32)
    steps(comm, x, 1)  # #1, #2
    expect(pc.CollectiveMismatch, lambda: steps(comm, x, 2, skip_at=0), "#4")


def hang():
    comm = fresh("hang")
    x = np.ones(4, np.float32)
    steps(comm, x, 1)  # #1, #2
    if comm.rank == 1:
        steps(comm, x, 1, skip_at=0)  # #3, then no broadcast
        time.sleep(2.5)  # its own code, past the others' timeout
    else:
        expect(pc.CollectiveTimeout, lambda: steps(comm, x, 2), f"flight record: {BASE}/hang/")


def asked():
    comm = fresh("asked")
    rank, size = comm.rank, comm.size
    right, left = (rank + 1) % size, (rank - 1) % size
    out = np.zeros(6, np.int32)
    comm.batch_p2p(
        [
            pc.P2POp("send", np.full(6, rank, np.int32), right, tag=7),
            pc.P2POp("recv", out, left, tag=7),
        ]
    )
    assert np.all(out == left), out
    works = [comm.all_reduce(np.ones(1000, np.float64), async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    comm.barrier()
    os.kill(os.getpid(), signal.SIGUSR1)
    path = os.path.join(BASE, "asked")
    deadline = time.monotonic() + 10
    while not any(f.endswith(f"rank{rank}.json") for _, _, fs in os.walk(path) for f in fs):
        assert time.monotonic() < deadline, "no flight record 10 s after SIGUSR1"
        time.sleep(0.01)


def dead():
    comm = fresh("dead")
    x = np.ones(1 << 16, np.float32)
    comm.all_reduce(x)  # #1
    if comm.rank == 2:
        os._exit(0)
    expect(pc.CollectiveError, lambda: comm.all_reduce(x), "no longer running")


def main():
    if sys.argv[1:] == ["nodes"]:  # a communicator across nodes: the skipped call only
        saved = os.environ.get("PYCOLL_FLIGHT_DIR")
        skipped()
        OPEN.pop().close()  # a case of a rank pool: leave its process as it was
        if saved is None:
            del os.environ["PYCOLL_FLIGHT_DIR"]
        else:
            os.environ["PYCOLL_FLIGHT_DIR"] = saved
        return
    for drill in (skipped, hang, asked):
        drill()
        MPI.COMM_WORLD.Barrier()
    dead()
    print(f"rank {MPI.COMM_WORLD.rank} done", flush=True)
    hard_exit(0)


if __name__ == "__main__":
    run_main(main)
