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

import os

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
    from pycollectives.bench.scripts import log_row, machine, write_json
    from pycollectives.bench.timing import best_per_call

    mpi = MPI.COMM_WORLD
    if mpi.Get_size() != 2:
        raise SystemExit("run on 2 ranks, or without mpiexec to launch them")
    comm = pc.Communicator(mpi)
    assert comm.topology.num_nodes == 2, "each rank must be a node (PYCOLL_RANKS_PER_NODE=1)"
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        iters = int(min(5000, max(3, (64 << 20) // max(nbytes, 1) // INFLIGHT)))
        for name, (sides, check) in patterns(comm, mpi, nbytes).items():
            # warm up, then check the data
            times = best_per_call(mpi, sides.values(), iters, args.rounds, min(iters, 20), check)
            best = dict(zip(sides, times))
            row = {"pattern": name, "bytes": nbytes}
            row.update({f"{side}_us": t * 1e6 for side, t in best.items()})
            row["ratio"] = best["mpi"] / best["ours"]
            log_row(mpi, rows, row)
    comm.close()
    if mpi.rank == 0:
        write_json(args.json, {**machine(), "rows": rows})


def launch(args):
    from pycollectives.bench.scripts import run_on_two_ranks, write_json

    res = run_on_two_ranks(os.path.abspath(__file__), args, env={"PYCOLL_RANKS_PER_NODE": "1"})
    print(f"# 2 ranks on 2 emulated nodes, {res['cpu']}, {res['mpi']}; best of {args.rounds}")
    print(f"# us per iteration; inflight = {INFLIGHT} messages; ratio = mpi / ours (>1: faster)")
    print(f"# {'pattern':<9} {'bytes':>9} {'ours':>10} {'mpi':>10} {'ratio':>7}")
    for r in res["rows"]:
        print(
            f"  {r['pattern']:<9} {r['bytes']:>9} {r['ours_us']:>10.2f} {r['mpi_us']:>10.2f}"
            f" {r['ratio']:>6.2f}x"
        )
    if args.json:
        write_json(args.json, res)


def main():
    from pycollectives.bench.scripts import measure_or_launch, two_rank_options

    args = two_rank_options(__doc__.splitlines()[0], SIZES).parse_args()
    return measure_or_launch(args, measure, launch)


if __name__ == "__main__":
    main()
