"""On namespace nodes (tests/harness/netns.py), nothing but the network reaches another node.

Usage: mpiexec <NamespaceNodes.mpiexec_args> -n N python namespace_nodes.py NODES

Every rank: the communicator's nodes are the ranks grouped by host name (no PYCOLL_HOST_ID or
PYCOLL_RANKS_PER_NODE set), NODES of them; a file the lowest rank of each node puts in
/dev/shm is seen on that node alone; every segment a rank maps is on its node's own /dev/shm
(a device of its own); MPI's COMM_TYPE_SHARED split is the rank's node; then a hierarchical
all-reduce of 1 MiB a rank and a message to the next node against MPI.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc

BIG = 1 << 17


def main():
    for name in ("PYCOLL_HOST_ID", "PYCOLL_RANKS_PER_NODE"):
        assert name not in os.environ, f"{name} is set: these nodes must be found, not told"
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    comm = pc.Communicator()
    hosts = mpi.allgather(socket.gethostname())
    names = list(dict.fromkeys(hosts))
    want = [[q for q, h in enumerate(hosts) if h == name] for name in names]
    assert len(names) == int(sys.argv[1]), hosts
    assert comm.topology.nodes == want, (comm.topology.describe(), want)
    # MPI's own view agrees: its shared-memory split is this rank's node.
    shared = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    assert sorted(shared.allgather(r)) == want[names.index(hosts[r])], hosts
    shared.Free()
    node = names.index(hosts[r])
    probe = f"/dev/shm/pycoll-probe-{node}"
    if r == want[node][0]:
        with open(probe, "w") as f:
            f.write(hosts[r])
    mpi.Barrier()
    seen = sorted(f for f in os.listdir("/dev/shm") if f.startswith("pycoll-probe-"))
    assert seen == [f"pycoll-probe-{node}"], (hosts[r], seen)
    # Every segment this rank maps lies in its node's /dev/shm (a tmpfs of its own: one
    # device per node, another on every other node).
    shm = os.stat("/dev/shm").st_dev
    mine = f"{os.major(shm):02x}:{os.minor(shm):02x}"
    mapped = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/dev/shm/pycoll-"):
                mapped.add(fields[3])
    assert mapped == {mine}, (hosts[r], mapped, mine)
    for q, theirs in enumerate(mpi.allgather(mine)):
        assert (theirs == mine) == (hosts[q] == hosts[r]), (q, theirs, r, mine)
    x = np.arange(BIG, dtype=np.float64) * (r + 1)  # 1 MiB a rank: shows on the veths
    want_sum = mpi.allreduce(x)
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, want_sum)
    # A message to the same local rank of the next node (or its last rank), and back.
    nxt, prv = want[(node + 1) % len(want)], want[(node - 1) % len(want)]
    local = want[node].index(r)
    dst = nxt[min(local, len(nxt) - 1)]
    got = np.empty(8, np.int64)
    sends = [q for q in range(n) if q != r]  # who sends to whom, computed alike everywhere
    srcs = []
    for q in sends:
        qn = names.index(hosts[q])
        qnext = want[(qn + 1) % len(want)]
        if qnext[min(want[qn].index(q), len(qnext) - 1)] == r:
            srcs.append(q)
    ops = [pc.P2POp("send", np.full(8, r, np.int64), dst, 3)]
    outs = [np.empty(8, np.int64) for _ in srcs]
    ops += [pc.P2POp("recv", o, q, 3) for o, q in zip(outs, srcs)]
    comm.batch_p2p(ops)
    for o, q in zip(outs, srcs):
        assert np.all(o == q), (q, o)
    del got, prv
    mpi.Barrier()
    if r == want[node][0]:
        os.unlink(probe)
    comm.close()
    print(f"rank {r} on {hosts[r]} ok", flush=True)


if __name__ == "__main__":
    run_main(main)
