"""Ring vs tree vs direct vs auto vs MPI, per size, in one run; optionally writes tuning rules.

    mpiexec -n 2 python benchmarks/algorithms.py [--collective all_reduce] [--json FILE]
    python benchmarks/algorithms.py --merge r2.json r3.json r4.json \
        --write pycollectives/tuning.json

Latency sizes (8 B - 64 KiB) report microseconds, bandwidth sizes (to 64 MiB) busbw in GB/s
as nccl-tests defines it. Each algorithm's batch alternates with the others' and MPI's, best
of --rounds batches, the slowest rank's mean per call. `auto` is what algorithm=None picks.
`--merge` turns several runs (one per rank count) into the tuning table that auto reads:
for each collective and rank count, the fastest algorithm per size, as size ranges. Going up
in size, the choice changes only to an algorithm at least --margin faster than the current
one, so that near-ties (noise) do not split the table into many small ranges.
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np

ALGOS = ("ring", "tree", "direct")
TREE = ("all_reduce", "broadcast", "reduce")
# The collectives with a choice of algorithm (what --collective takes).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def sizes(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 4 if s < 65536 else 2


def bench(args):
    from mpi4py import MPI

    import pycollectives as pc
    from pycollectives.bench.formulas import bus_factor
    from pycollectives.bench.timing import per_call

    mpi = MPI.COMM_WORLD
    comm = pc.Communicator(mpi)
    n, coll = comm.size, args.collective
    algos = [a for a in ALGOS if a != "tree" or coll in TREE] + ["auto"]

    def call(algo, x, out):
        a = None if algo == "auto" else algo
        if coll == "all_reduce":
            return lambda: comm.all_reduce(x, out, algorithm=a)
        if coll == "reduce_scatter":
            return lambda: comm.reduce_scatter(x, out, algorithm=a)
        if coll == "all_gather":
            return lambda: comm.all_gather(x, out, algorithm=a)
        if coll == "broadcast":
            return lambda: comm.broadcast(x, algorithm=a)
        return lambda: comm.reduce(x, out, algorithm=a)

    def mpi_call(x, out):
        return {
            "all_reduce": lambda: mpi.Allreduce(x, out),
            "reduce_scatter": lambda: mpi.Reduce_scatter_block(x, out),
            "all_gather": lambda: mpi.Allgather(x, out),
            "broadcast": lambda: mpi.Bcast(x),
            "reduce": lambda: mpi.Reduce(x, out),
        }[coll]

    rows = []
    if comm.rank == 0:
        print(
            f"# {coll} float32 sum, {n} ranks, {platform.machine()}; latency in us up to 64 KiB, "
            "busbw GB/s above"
        )
        print("# " + " ".join(f"{h:>10}" for h in ["bytes", *algos, "mpi", "auto/best"]))
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        count = max(1, nbytes // 4)
        # in: the input of one rank; out: its output (nccl-tests sizes: the larger buffer)
        per = max(1, count // n)  # one rank's block of a scattered or gathered buffer
        if coll == "reduce_scatter":
            x, out = np.ones(per * n, np.float32), np.empty(per, np.float32)
        elif coll == "all_gather":
            x, out = np.ones(per, np.float32), np.empty(per * n, np.float32)
        else:
            x, out = np.ones(count, np.float32), np.empty(count, np.float32)
        iters = int(min(3000, max(5, (128 << 20) // nbytes // 8)))
        fns = {a: call(a, x, out) for a in algos}
        fns["mpi"] = mpi_call(x, out)
        for f in fns.values():
            for _ in range(min(iters, 20)):
                f()
        best = {k: float("inf") for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                best[k] = min(best[k], per_call(mpi, f, iters))
        fastest = min(best[a] for a in algos if a != "auto")
        row = {
            "bytes": nbytes,
            "us": {k: v * 1e6 for k, v in best.items()},
            "auto_vs_best": best["auto"] / fastest,
            "best": min((a for a in algos if a != "auto"), key=best.get),
        }
        rows.append(row)
        if comm.rank == 0:
            if nbytes <= 65536:
                vals = [best[k] * 1e6 for k in [*algos, "mpi"]]
            else:
                vals = [nbytes / best[k] / 1e9 * bus_factor(coll, n) for k in [*algos, "mpi"]]
            print(
                "  "
                + " ".join(
                    [
                        f"{nbytes:>10}",
                        *(f"{v:>10.2f}" for v in vals),
                        f"{row['auto_vs_best']:>10.2f}",
                    ]
                ),
                flush=True,
            )
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"collective": coll, "ranks": n, "machine": platform.machine(), "rows": rows},
                f,
                indent=1,
            )
    comm.close()


def merge(args):
    """Fastest algorithm per size -> size-range rules, per collective and rank count."""
    runs = []
    for path in args.merge:
        with open(path) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: (r["collective"], r["ranks"]))
    rules = []
    for run in runs:
        same = [r["ranks"] for r in runs if r["collective"] == run["collective"]]
        # The largest measured rank count also covers everything above it.
        hi = run["ranks"] if run["ranks"] != max(same) else 1 << 20
        lo = run["ranks"] if run["ranks"] != min(same) else 2
        rows = sorted(run["rows"], key=lambda r: r["bytes"])
        choice = [rows[0]["best"]]
        for row in rows[1:]:
            cur = choice[-1]
            choice.append(
                row["best"] if row["us"][row["best"]] < row["us"][cur] * (1 - args.margin) else cur
            )
        for j, row in enumerate(rows):
            last = j == len(rows) - 1
            if not last and choice[j + 1] == choice[j]:
                continue
            rules.append(
                {
                    "collective": run["collective"],
                    "min_ranks": lo,
                    "max_ranks": hi,
                    "max_bytes": (1 << 62) if last else row["bytes"],
                    "algorithm": choice[j],
                }
            )
    table = {
        "generated_by": "benchmarks/algorithms.py --merge",
        "machine": platform.machine(),
        "rules": rules,
    }
    with open(args.write, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {len(rules)} rules to {args.write}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collective", default="all_reduce", choices=sorted(COLLECTIVES))
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the measurements to this file")
    ap.add_argument("--merge", nargs="+", help="measurement files to turn into tuning rules")
    ap.add_argument("--write", help="tuning table to write (with --merge)")
    ap.add_argument("--margin", type=float, default=0.1, help="relative gain needed to switch")
    args = ap.parse_args()
    if args.merge:
        merge(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
