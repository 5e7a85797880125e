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
import json
import os
import platform
import subprocess
import sys
import tempfile

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
    from pycollectives.bench.peers import mpi_library
    from pycollectives.bench.timing import per_call

    mpi = MPI.COMM_WORLD
    if mpi.Get_size() != 2:
        raise SystemExit("run on 2 ranks, or without mpiexec to launch both runs")
    comm = None if args.mpi_only else pc.Communicator(mpi)
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        iters = int(min(20000, max(5, (256 << 20) // max(nbytes, 1) // 8)))
        for op, fns, check, factor, moved in variants(comm, mpi, nbytes, args.mpi_only):
            best = {}
            for name, fn in fns.items():  # warm up (page faults, caches), then check the data
                for _ in range(min(iters, 50)):
                    fn()
                check()
                best[name] = float("inf")
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    best[name] = min(best[name], per_call(mpi, fn, iters))
            row = {"op": op, "bytes": nbytes}
            for name, t in best.items():
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_busbw_GBs"] = moved * factor / t / 1e9
            rows.append(row)
            if mpi.rank == 0:
                print(json.dumps(row), file=sys.stderr, flush=True)
    if comm is not None:
        comm.close()
    if mpi.rank == 0:
        info = {
            "cpu": platform.processor() or platform.machine(),
            "mpi": mpi_library(),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


def launch(args):
    """Both runs under mpiexec, then one table."""
    here = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"main": {}, "nocma": NO_CMA}
        res = {}
        for name, extra in runs.items():
            path = os.path.join(tmp, name + ".json")
            cmd = [mpiexec, "-n", "2", sys.executable, here, "--sizes", args.sizes]
            cmd += ["--rounds", str(args.rounds), "--json", path]
            cmd += ["--mpi-only"] if name == "nocma" else []
            subprocess.run(cmd, check=True, env={**os.environ, **extra})
            with open(path) as f:
                res[name] = json.load(f)
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
        with open(args.json, "w") as f:
            json.dump({"ranks": 2, "rows": rows, "mpi": res["main"]["mpi"]}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--mpi-only", action="store_true", help=argparse.SUPPRESS)
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
