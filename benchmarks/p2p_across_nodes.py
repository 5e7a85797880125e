"""Point-to-point between nodes, 2 ranks on 2 emulated nodes: pycollectives vs MPI (mpi4py).

    python benchmarks/p2p_across_nodes.py [--sizes 8,1024,...] [--rounds 5] [--json FILE]

Run without mpiexec, it launches itself on 2 ranks with PYCOLL_RANKS_PER_NODE=1, so that every
message crosses the inter-node path (MPI, as between machines), here over this machine's MPI.

Per size (bytes per message), two patterns, each timed through what a user calls:
  sendrecv  one send and one recv with the other rank, in one call: Communicator.batch_p2p
            against MPI's Sendrecv;
  inflight  8 messages on 8 tags sent asynchronously, received blocking in the reverse order,
            then the sends waited for (the program MPI's progress rule allows): Communicator
            send(async_op=True) / recv against Isend / Recv / Waitall.
Times are the slower rank's mean per iteration over a timed batch, best of --rounds batches,
the two sides alternating per batch; ratio = MPI's time / ours (> 1: we are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20]
INFLIGHT = 8


def patterns(comm, mpi, nbytes):
    """{pattern: ({side: fn}, check)} for one message size."""
    from mpi4py import MPI

    import pycollectives as pc

    peer = 1 - mpi.rank
    x = [np.full(nbytes, 10 * mpi.rank + k, np.uint8) for k in range(INFLIGHT)]
    y = [np.empty(nbytes, np.uint8) for _ in range(INFLIGHT)]
    pair = [pc.P2POp("send", x[0], peer, 0), pc.P2POp("recv", y[0], peer, 0)]

    def ours_inflight():
        works = [comm.send(x[k], peer, tag=k, async_op=True) for k in range(INFLIGHT)]
        for k in reversed(range(INFLIGHT)):
            comm.recv(y[k], peer, tag=k)
        for w in works:
            w.wait()

    def mpi_inflight():
        reqs = [mpi.Isend(x[k], dest=peer, tag=k) for k in range(INFLIGHT)]
        for k in reversed(range(INFLIGHT)):
            mpi.Recv(y[k], source=peer, tag=k)
        MPI.Request.Waitall(reqs)

    def check(count):
        def run():
            for k in range(count):
                assert np.all(y[k] == 10 * peer + k), "wrong data"

        return run

    return {
        "sendrecv": (
            {
                "ours": lambda: comm.batch_p2p(pair),
                "mpi": lambda: mpi.Sendrecv(x[0], dest=peer, recvbuf=y[0], source=peer),
            },
            check(1),
        ),
        "inflight": ({"ours": ours_inflight, "mpi": mpi_inflight}, check(INFLIGHT)),
    }


def measure(args):
    from mpi4py import MPI

    import pycollectives as pc
    from pycollectives.bench.peers import mpi_library
    from pycollectives.bench.timing import per_call

    mpi = MPI.COMM_WORLD
    if mpi.Get_size() != 2:
        raise SystemExit("run on 2 ranks, or without mpiexec to launch them")
    comm = pc.Communicator(mpi)
    assert comm.topology.num_nodes == 2, "each rank must be a node (PYCOLL_RANKS_PER_NODE=1)"
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        iters = int(min(5000, max(3, (64 << 20) // max(nbytes, 1) // INFLIGHT)))
        for name, (sides, check) in patterns(comm, mpi, nbytes).items():
            best = {}
            for side, fn in sides.items():  # warm up, then check the data
                for _ in range(min(iters, 20)):
                    fn()
                check()
                best[side] = float("inf")
            for _ in range(args.rounds):
                for side, fn in sides.items():
                    best[side] = min(best[side], per_call(mpi, fn, iters))
            row = {"pattern": name, "bytes": nbytes}
            row.update({f"{side}_us": t * 1e6 for side, t in best.items()})
            row["ratio"] = best["mpi"] / best["ours"]
            rows.append(row)
            if mpi.rank == 0:
                print(json.dumps(row), file=sys.stderr, flush=True)
    comm.close()
    if mpi.rank == 0:
        info = {"cpu": platform.processor() or platform.machine(), "mpi": mpi_library()}
        with open(args.json, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)


def launch(args):
    here = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [mpiexec, "-n", "2", sys.executable, here, "--sizes", args.sizes]
        cmd += ["--rounds", str(args.rounds), "--json", path]
        subprocess.run(cmd, check=True, env={**os.environ, "PYCOLL_RANKS_PER_NODE": "1"})
        with open(path) as f:
            res = json.load(f)
    print(f"# 2 ranks on 2 emulated nodes, {res['cpu']}, {res['mpi']}; best of {args.rounds}")
    print(f"# us per iteration; inflight = {INFLIGHT} messages; ratio = mpi / ours (>1: faster)")
    print(f"# {'pattern':<9} {'bytes':>9} {'ours':>10} {'mpi':>10} {'ratio':>7}")
    for r in res["rows"]:
        print(
            f"  {r['pattern']:<9} {r['bytes']:>9} {r['ours_us']:>10.2f} {r['mpi_us']:>10.2f}"
            f" {r['ratio']:>6.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args()
    under_mpiexec = any(k in os.environ for k in ("PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_RANK"))
    if not under_mpiexec:
        return launch(args)
    if args.json is None:
        args.json = os.devnull
    measure(args)
    return None


if __name__ == "__main__":
    main()
