"""Entry point of the benchmark CLI."""

from __future__ import annotations

import platform

from pycollectives.bench import formulas as F
from pycollectives.bench import peers, report
from pycollectives.bench.cli import Sweep, parse_args


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    import pycollectives as pc

    mpi = MPI.COMM_WORLD
    if args.device == "cuda":
        if mpi.rank == 0:
            print(
                "pycoll-bench: --device cuda: this build has no CUDA transport "
                "(numpy arrays on the host only)"
            )
        return 2
    if not 0 <= args.root < mpi.size:
        if mpi.rank == 0:
            print(f"pycoll-bench: -r {args.root} is out of range for {mpi.size} ranks")
        return 2
    comm = pc.Communicator(mpi)
    sweep = Sweep(args, comm, mpi)
    colls = list(F.COLLECTIVES) if args.collective == "all" else [args.collective]
    gloo = peers.Gloo(mpi) if "gloo" in args.compare else None
    copy_bw = peers.copy_bandwidth(mpi) if args.compare else peers.copy_bandwidth(mpi, 64 << 20)
    sizes = F.sizes(args.minbytes, args.maxbytes, args.stepfactor)
    progress = report.Progress(len(sizes) * len(colls), mpi.rank == 0)
    rows = []
    title = (
        f"pycollectives {pc.__version__}, {comm.size} ranks, {platform.machine()}, "
        f"{args.datatype} {args.op}, algorithm {args.algo or 'auto'}"
    )
    for coll in colls:
        runners = {}
        for name in args.compare:
            if name == "mpi":
                runners[name] = peers.mpi_runner(mpi, coll, args.op, args.root, sweep.dt)
            elif name == "gloo":
                runners[name] = gloo.runner(coll, args.op, args.root, sweep.dt)
            else:
                runners[name] = "NCCL needs --device cuda and a GPU"
        these = []
        for nbytes in sizes:
            row = sweep.row(coll, nbytes)
            progress.step(f"{coll} {nbytes} B")
            if row is None:
                continue
            t = F.bound_time(coll, row["size"], comm.size, copy_bw)
            row["bound"] = {"time_us": t * 1e6, "busbw": F.busbw(coll, comm.size, row["size"], t)}
            these.append(row)
        for name, run in runners.items():  # after all of ours (see Sweep.compare)
            for row in these:
                sweep.compare(row, name, run)
        rows += these
        if mpi.rank == 0:
            progress.close()
            print(report.table_header(f"{coll}: {title}"))
            for r in these:
                print(report.table_row(r))
            if args.compare:
                print(report.comparison(these, args.compare, copy_bw))
    if mpi.rank == 0:
        print(report.footer(rows))
        meta = {
            "ranks": comm.size,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "pycollectives": pc.__version__,
            "copy_bw_GBs": copy_bw,
            "args": vars(args),
        }
        if args.json:
            report.write_json(args.json, meta, rows)
        if args.plot:
            report.plot(args.plot, rows, args.compare, title)
    if gloo is not None:
        gloo.close()
    comm.close()
    wrong = sum(r["oop"]["wrong"] + r["ip"]["wrong"] for r in rows)
    return 1 if wrong else 0
