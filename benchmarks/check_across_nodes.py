"""Cost of the check across nodes: collectives over several nodes with and without it, and the
path before it existed, in one run.

    PYCOLL_RANKS_PER_NODE=2 mpiexec -n 4 python benchmarks/check_across_nodes.py [--json FILE]

Three communicators over the same ranks:
- checked: as every communicator runs: each node's ranks compare their calls in its first
  node-local phase, every node's status reaches every rank in one exchange between nodes, and a
  small all-reduce's shards ride with the statuses;
- unchecked: PYCOLL_CHECK_MISMATCH=0 (no fingerprints inside the nodes, no statuses between
  them), the same messages otherwise: the check's cost is checked / unchecked. A broadcast or
  reduce unchecked lets a rank run ahead into its next call once its part is done; checked,
  every call is a meeting of every rank (as a barrier is);
- before: the path of the release before the check: fingerprints inside the nodes only, the
  shards all-reduced between nodes by a ring (PYCOLL_INTER_ALGO=ring, the check across nodes
  off), which gave a wrong answer in silence when ranks of one node disagreed.

Batches of --calls calls alternate between them, --rounds times. With more ranks than cores a
batch's time depends on how the scheduler deals the ranks out, so each figure is the median over
the rounds of a batch's time divided by the unchecked batch's of the same round (time = the
slowest rank's mean per call), with the quartiles, beside the median times themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.peers import mpi_library
from pycollectives.bench.timing import per_call


def _made(env: dict, across_nodes: bool = True):
    """A communicator made with `env` set (read once, when it is made)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        comm = pc.Communicator(MPI.COMM_WORLD)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    if not across_nodes:
        comm._host.checking = False  # inside the nodes only: as before the check existed
    return comm


def quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collectives", default="all_reduce,broadcast,reduce")
    ap.add_argument("--sizes", default="8,1024,65536,1048576", help="bytes per call")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200, help="calls per batch (fewer when large)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    comms = {
        "checked": _made({}),
        "unchecked": _made({"PYCOLL_CHECK_MISMATCH": "0"}),
        "before": _made({"PYCOLL_INTER_ALGO": "ring"}, across_nodes=False),
    }
    topo = comms["checked"].topology
    assert topo.num_nodes > 1, "run it over several nodes (PYCOLL_RANKS_PER_NODE)"
    rows = []
    if mpi.rank == 0:
        print(
            f"# float32 (sum), root 1, {mpi.size} ranks on {topo.num_nodes} nodes "
            f"({topo.describe()}), {platform.processor() or platform.machine()}, {mpi_library()}"
        )
        print(f"# median time per call (us) and, per round, time / unchecked: median [quartiles]"
              f" over {args.rounds} rounds")  # fmt: skip
        print(f"# {'collective':>10} {'bytes':>8} {'checked':>9} {'unchecked':>9} {'before':>9}"
              f"  {'checked/unchecked':>24}  {'checked/before':>24}")  # fmt: skip
    cases = [(c, int(b)) for c in args.collectives.split(",") for b in args.sizes.split(",")]
    for collective, nbytes in cases:
        x = np.ones(max(1, nbytes // 4), np.float32)

        def call(c, collective=collective, x=x):
            if collective == "all_reduce":
                c.all_reduce(x)
            elif collective == "broadcast":
                c.broadcast(x, root=1)
            else:
                c.reduce(x, root=1)

        calls = max(5, min(args.calls, (32 << 20) // max(nbytes, 1)))
        times = {k: [] for k in comms}
        for c in comms.values():  # warm up
            for _ in range(20):
                call(c)
        for r in range(args.rounds):
            order = list(comms.items())
            if r % 2:
                order.reverse()
            for name, c in order:
                times[name].append(per_call(mpi, lambda c=c: call(c), calls))
        base = times["unchecked"]
        row = {"collective": collective, "bytes": nbytes}
        for name, ts in times.items():
            row[f"{name}_us"] = statistics.median(ts) * 1e6
        for name in ("checked", "before"):
            row[f"{name}_over_unchecked"] = quartiles([t / b for t, b in zip(times[name], base)])
        row["checked_over_before"] = quartiles(
            [t / b for t, b in zip(times["checked"], times["before"])]
        )
        rows.append(row)
        if mpi.rank == 0:
            a, m, b = row["checked_over_unchecked"]
            c, n, d = row["checked_over_before"]
            print(f"  {collective:>10} {nbytes:>8} {row['checked_us']:>9.1f} "
                  f"{row['unchecked_us']:>9.1f} {row['before_us']:>9.1f}  "
                  f"{m:>8.3f} [{a:.3f}-{b:.3f}]  "
                  f"{n:>8.3f} [{c:.3f}-{d:.3f}]", flush=True)  # fmt: skip
    for c in comms.values():
        c.close()
    if mpi.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": mpi.size, "nodes": topo.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
