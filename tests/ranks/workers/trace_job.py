"""Calls that PYCOLL_TRACE should record: blocking and asynchronous collectives of known
sizes, point-to-point, a barrier, and user spans. Prints what it did, for the test to match.

Usage: PYCOLL_TRACE=dir/t-{rank}.json mpiexec -n 2 python trace_job.py
"""

from __future__ import annotations

import numpy as np
from checks import run_main

import pycollectives as pc
from pycollectives import trace


def main():
    assert trace.enabled()
    comm = pc.Communicator()
    rank, size = comm.rank, comm.size
    with trace.span("phase", part="blocking"):
        x = np.ones(1000, np.float32)
        comm.all_reduce(x)
        comm.all_reduce(x, algorithm="ring")
        out = np.empty(1000 * size, np.float32)
        comm.all_gather(x, out)
        comm.broadcast(np.zeros(10, np.int64), root=size - 1)
    with trace.span("phase", part="async"):
        big = np.ones(1 << 20, np.float32)  # 4 MiB
        work = comm.all_reduce(big, async_op=True)
        work.wait()
        assert big[0] == size
    peer = (rank + 1) % size
    src = (rank - 1) % size
    comm.batch_p2p([pc.P2POp("send", x, peer, 7), pc.P2POp("recv", np.empty_like(x), src, 7)])
    comm.barrier()
    comm.close()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    run_main(main)
