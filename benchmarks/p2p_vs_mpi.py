"""Sendrecv and all-to-all on 2 ranks, 8 B to 16 MiB: pycollectives vs MPI (mpi4py).

    python benchmarks/p2p_vs_mpi.py [--sizes 8,1024,...] [--rounds 5] [--json FILE]

Run without mpiexec, it launches two runs of itself on 2 ranks: the full comparison, then MPI
alone with cross-memory attach turned off (MPIR_CVAR_CH4_CMA_ENABLE=0, MPICH's copy through
shared memory), printed as a second reference column. Under `mpiexec -n 2` it does one run.

Per size and operation, each rank exchanges `bytes` with the other (sendrecv: one send and one
recv of `bytes`; all_to_all: a 2 x `bytes` array, one block per rank):
  native  HostComm.p2p([send, recv]) / HostComm.run_call(("all_to_all", ...)): the C++ call alone
  api     Communicator.batch_p2p / Communicator.all_to_all: what users call
  mpi     Sendrecv / Alltoall on the same buffers
Times are the slowest rank's mean per iteration over a timed batch, best of --rounds batches
(the machine is shared: the best batch is the least disturbed); the variants alternate per
batch. busbw follows nccl-tests: sendrecv algbw x 1, all_to_all algbw x (n-1)/n, where algbw
is bytes moved per rank (all_to_all: the whole 2 x `bytes` array) over time.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20]
NO_CMA = {"MPIR_CVAR_CH4_CMA_ENABLE": "0"}


def variants(comm, mpi, nbytes, mpi_only):
    """(operation, {variant: fn}, check, busbw factor, bytes per rank) for one size."""
    import pycollectives as pc
    from pycollectives.backends import Call
    from pycollectives.bench.formulas import bus_factor

    peer = 1 - mpi.rank
    x = np.full(nbytes, mpi.rank + 1, np.uint8)
    y = np.empty(nbytes, np.uint8)
    xa = np.concatenate([np.full(nbytes, 10 * mpi.rank + q, np.uint8) for q in range(2)])
    ya = np.empty_like(xa)
    out = []
    sr = {"mpi": lambda: mpi.Sendrecv(x, dest=peer, recvbuf=y, source=peer)}
    a2a = {"mpi": lambda: mpi.Alltoall(xa, ya)}
    if not mpi_only:
        host = comm._host.c
        ops = [("send", x, peer, 0), ("recv", y, peer, 0)]
        api_ops = [pc.P2POp("send", x, peer, 0), pc.P2POp("recv", y, peer, 0)]
        sr["native"] = lambda: host.p2p(ops)
        sr["api"] = lambda: comm.batch_p2p(api_ops)
        call = Call("all_to_all", xa, ya)
        a2a["native"] = lambda: host.run_call(call)
        a2a["api"] = lambda: comm.all_to_all(xa, ya)

    def check_sr():
        assert np.all(y == peer + 1), "sendrecv: wrong data"

    def check_a2a():
        want = np.concatenate([np.full(nbytes, 10 * q + mpi.rank, np.uint8) for q in range(2)])
        assert np.array_equal(ya, want), "all_to_all: wrong data"

    out.append(("sendrecv", sr, check_sr, bus_factor("sendrecv", mpi.size), nbytes))
    out.append(("all_to_all", a2a, check_a2a, bus_factor("all_to_all", mpi.size), 2 * nbytes))
    return out


def measure(args):
    from mpi4py import MPI

    import pycollectives as pc
    from pycollectives.bench.scripts import log_row, machine, write_json
    from pycollectives.bench.timing import best_per_call

    mpi = MPI.COMM_WORLD
    if mpi.Get_size() != 2:
        raise SystemExit("run on 2 ranks, or without mpiexec to launch both runs")
    comm = None if args.mpi_only else pc.Communicator(mpi)
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        iters = int(min(20000, max(5, (256 << 20) // max(nbytes, 1) // 8)))
        for op, fns, check, factor, moved in variants(comm, mpi, nbytes, args.mpi_only):
            # warm up (page faults, caches), then check the data
            times = best_per_call(mpi, fns.values(), iters, args.rounds, min(iters, 50), check)
            row = {"op": op, "bytes": nbytes}
            for name, t in zip(fns, times):
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_busbw_GBs"] = moved * factor / t / 1e9
            log_row(mpi, rows, row)
    if comm is not None:
        comm.close()
    if mpi.rank == 0:
        write_json(args.json, {**machine(), "rows": rows})


def launch(args):
    """Both runs under mpiexec, then one table."""
    from pycollectives.bench.scripts import run_on_two_ranks, write_json

    here = os.path.abspath(__file__)
    res = {
        "main": run_on_two_ranks(here, args),
        "nocma": run_on_two_ranks(here, args, ["--mpi-only"], NO_CMA),
    }
    nocma = {(r["op"], r["bytes"]): r for r in res["nocma"]["rows"]}
    print(f"# 2 ranks, {res['main']['cpu']}, {res['main']['mpi']}; best of {args.rounds} batches")
    print("# us per call; busbw GB/s (nccl-tests factors); ratio = mpi time / ours (>1: faster)")
    head = ("op", "bytes", "native", "api", "mpi", "mpi-nocma", "bw nat", "bw mpi", "bw nocma")
    print(f"# {head[0]:<10} {head[1]:>9}" + "".join(f" {h:>9}" for h in head[2:]), end="")
    print(f" {'mpi/nat':>8} {'mpi/api':>8} {'nocma/nat':>9}")
    rows = []
    for r in res["main"]["rows"]:
        r["mpi_nocma_us"] = nocma[(r["op"], r["bytes"])]["mpi_us"]
        r["mpi_nocma_busbw_GBs"] = nocma[(r["op"], r["bytes"])]["mpi_busbw_GBs"]
        rows.append(r)
        vals = [r["native_us"], r["api_us"], r["mpi_us"], r["mpi_nocma_us"]]
        bws = [r["native_busbw_GBs"], r["mpi_busbw_GBs"], r["mpi_nocma_busbw_GBs"]]
        print(f"  {r['op']:<10} {r['bytes']:>9}" + "".join(f" {v:>9.2f}" for v in vals), end="")
        print("".join(f" {v:>9.3f}" for v in bws), end="")
        print(
            f" {r['mpi_us'] / r['native_us']:>7.2f}x {r['mpi_us'] / r['api_us']:>7.2f}x"
            f" {r['mpi_nocma_us'] / r['native_us']:>8.2f}x"
        )
    if args.json:
        write_json(args.json, {"ranks": 2, "rows": rows, "mpi": res["main"]["mpi"]})


def main():
    from pycollectives.bench.scripts import measure_or_launch, two_rank_options

    ap = two_rank_options(__doc__.splitlines()[0], SIZES)
    ap.add_argument("--mpi-only", action="store_true", help=argparse.SUPPRESS)
    return measure_or_launch(ap.parse_args(), measure, launch)


if __name__ == "__main__":
    main()
