"""Entry point of the benchmark CLI."""

from __future__ import annotations

import contextlib
import platform
import sys

from pycollectives.bench import formulas as F
from pycollectives.bench import gpu, peers, report
from pycollectives.bench.cli import Sweep, dtype_of, parse_args
from pycollectives.bench.contention import Contention
from pycollectives.ops import ALGORITHMS_FOR


def refuse(mpi, message: str) -> int:
    """One line on rank 0's stderr and exit status 2, on every rank (like a usage error)."""
    if mpi.rank == 0:
        print(f"pycoll-bench: {message}", file=sys.stderr)
    return 2


def open_peer(name: str, mpi, dev):
    """The peer `name` on these ranks (collective): an object with ``runner(coll, op, root,
    dt)`` (a callable, or why it can't), ``reason`` (why none runs, or None), ``what`` and
    ``close()``."""
    if name == "mpi":
        return peers.Mpi(mpi, gpu.staged_runner if dev is not None else None)
    if name == "gloo":
        return peers.Gloo(mpi)
    if name == "oneccl":
        from pycollectives.bench.oneccl import OneCCL

        return OneCCL(mpi)
    if name == "deepspeed":
        from pycollectives.bench.deepspeed_peer import DeepSpeed

        return DeepSpeed(mpi)
    return gpu.Nccl(mpi, dev)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    import pycollectives as pc

    mpi = MPI.COMM_WORLD
    if not 0 <= args.root < mpi.size:
        return refuse(mpi, f"-r {args.root} is out of range for {mpi.size} ranks")
    dev = None
    if args.device == "cuda":
        try:
            dev = gpu.open_device(mpi, dtype_of(args.datatype))
        except gpu.Unusable as e:
            return refuse(mpi, f"--device cuda cannot run: {e}")
    comm = pc.Communicator(mpi)
    sweep = Sweep(args, comm, mpi, dev)
    colls = list(F.collectives_for(args.device)) if args.collective == "all" else [args.collective]
    if args.algo is not None:  # `all --algo tree`: the collectives that have a tree
        colls = [c for c in colls if args.algo in ALGORITHMS_FOR.get(c, ())]
    if dev is None:
        copy_bw = peers.copy_bandwidth(mpi) if args.compare else peers.copy_bandwidth(mpi, 64 << 20)
    else:
        copy_bw = gpu.copy_bandwidth(mpi, dev)
        # The CUDA transport is set up by the first GPU collective: here, not in a timed loop.
        try:
            comm.all_reduce(dev.cp.ones(1, dev.cp.float32))
            dev.sync()
        except pc.CollectiveError as e:  # raised alike on every rank
            comm.close()
            return refuse(mpi, f"--device cuda cannot run: {e}")
    busy = Contention(mpi) if args.contention else contextlib.nullcontext()
    with busy:
        sizes = F.sizes(args.minbytes, args.maxbytes, args.stepfactor)
        progress = report.Progress(len(sizes) * len(colls) * (1 + len(args.compare)), mpi.rank == 0)
        rows_of = {}
        for coll in colls:
            rows_of[coll] = []
            sweep.row(coll, sizes[0])  # untimed: the first timing after start-up runs slow
            for nbytes in sizes:
                row = sweep.row(coll, nbytes)
                progress.step(f"{coll} {nbytes} B")
                if row is None:
                    continue
                t = F.bound_time(coll, row["size"], comm.size, copy_bw)
                row["bound"] = {
                    "time_us": t * 1e6,
                    "busbw": F.busbw(coll, comm.size, row["size"], t),
                }
                rows_of[coll].append(row)
        title = (
            f"pycollectives {pc.__version__}, {comm.size} ranks, {platform.machine()}, "
            f"{args.datatype} {args.op}, algorithm {args.algo or 'auto'}"
        )
        if args.contention:
            title += f", {busy.n} busy processes beside the ranks"
        meta = {
            "ranks": comm.size,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "mpi": peers.mpi_library(),
            "pycollectives": pc.__version__,
            "copy_bw_GBs": copy_bw,
            "args": vars(args),
        }
        progress.total = progress.done + len(args.compare) * sum(map(len, rows_of.values()))
        # Peers are set up and run after all of our sizes, one at a time, each closed before the
        # next: some leave threads polling (gloo's, NCCL's proxies), which would slow what follows.
        notes = []
        for name in args.compare:
            peer = open_peer(name, mpi, dev)
            try:
                for coll in colls:
                    run = peer.runner(coll, args.op, args.root, sweep.dt)
                    if rows_of[coll]:  # untimed, as for ours
                        sweep.compare(dict(rows_of[coll][0], compare={}), name, run)
                    for row in rows_of[coll]:
                        sweep.compare(row, name, run)
                        progress.step(f"{name} {coll} {row['size']} B")
            finally:
                peer.close()
            if not peer.reason and peer.what:
                notes.append((name, peer.what))
            meta.setdefault("peers", {})[name] = peer.reason or peer.what
    progress.close()

    memory = "memory copy bandwidth per rank, all ranks copying"
    if dev is not None:
        gpus = sorted(set(mpi.allgather(dev.name)))
        sync_mode = getattr(getattr(comm, "_cuda", None), "sync_mode", None)
        title += f", cuda on {'/'.join(gpus)}, rank devices {dev.devices}"
        title += f", {sync_mode} sync" if sync_mode else ""
        meta.update(gpus=gpus, devices=dev.devices, cuda_sync=sync_mode)
        memory = "GPU memory copy bandwidth per rank (device to device), all ranks copying"
    rows = []
    for coll in colls:
        these = rows_of[coll]
        rows += these
        if mpi.rank == 0:
            print(report.table_header(f"{coll}: {title}"))
            for r in these:
                print(report.table_row(r))
            if args.compare:
                print(report.comparison(these, args.compare, copy_bw, memory, notes))
    if mpi.rank == 0:
        print(report.footer(rows))
        if args.json:
            report.write_json(args.json, meta, rows)
        if args.plot:
            report.plot(args.plot, rows, args.compare, title)
    mpi.Barrier()  # no rank returns (and prints) while rank 0 is still printing
    comm.close()
    wrong = sum(r["oop"]["wrong"] + r["ip"]["wrong"] for r in rows)
    return 1 if wrong else 0  # a peer's wrong results are reported, not ours to fail on
