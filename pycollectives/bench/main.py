"""Entry point of the benchmark CLI."""

from __future__ import annotations

import contextlib
import math
import platform
import sys
import time
import traceback

from pycollectives.bench import formulas as F
from pycollectives.bench import gpu, peers, report
from pycollectives.bench.cli import SharedArrays, Sweep, dtype_of, parse_args
from pycollectives.bench.contention import Contention
from pycollectives.ops import ALGORITHMS, ALGORITHMS_FOR


def refuse(mpi, message: str) -> int:
    """One line on rank 0's stderr and exit status 2, on every rank (like a usage error)."""
    if mpi.rank == 0:
        print(f"pycoll-bench: {message}", file=sys.stderr)
    return 2


def open_peer(name: str, mpi, dev, sweep=None):
    """The peer `name` on these ranks (collective): an object with ``runner(coll, op, root,
    dt)`` (a callable, or why it can't), ``reason`` (why none runs, or None), ``what`` and
    ``close()``."""
    if name in ALGORITHMS:
        return peers.Forced(sweep, name)
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


def measure_ours(sweep, colls, sizes, nranks, copy_bw, progress) -> dict:
    """{collective: [row per size]}, each row with the memory bound's time."""
    rows_of = {}
    for coll in colls:
        rows_of[coll] = []
        sweep.row(coll, sizes[0])  # untimed: the first timing after start-up runs slow
        for nbytes in sizes:
            row = sweep.row(coll, nbytes)
            progress.step(f"{coll} {nbytes} B")
            if row is None:
                continue
            t = F.bound_time(coll, row["size"], nranks, copy_bw)
            row["bound"] = {"time_us": t * 1e6, "busbw": F.busbw(coll, nranks, row["size"], t)}
            rows_of[coll].append(row)
    return rows_of


def measure_peer(sweep, peer, name, rows_of, progress):
    """Times `peer` on every row's size into the row's ``compare[name]``."""
    for coll, rows in rows_of.items():
        run = peer.runner(coll, sweep.args.op, sweep.args.root, sweep.dt)
        if rows:  # untimed, as for ours
            sweep.compare(dict(rows[0], compare={}), name, run)
        for row in rows:
            sweep.compare(row, name, run)
            progress.step(f"{name} {coll} {row['size']} B")


def best_of(rounds: list) -> dict:
    """One set of rows from several rounds' (same sizes): each size's fastest time for ours
    (out of place and in place apart), for each peer and for ours timed beside that peer,
    wrong results of every round added up, each peer's ratio taken between its best time
    and the best of ours beside it."""

    def best(entries):
        timed = [e for e in entries if "time_us" in e]
        if not timed:
            return dict(entries[0])
        out = dict(min(timed, key=lambda e: math.inf if math.isnan(e["time_us"]) else e["time_us"]))
        out["wrong"] = sum(e.get("wrong", 0) for e in timed)
        return out

    merged = {}
    for coll, rows in rounds[0].items():
        merged[coll] = []
        for j, first in enumerate(rows):
            same = [r[coll][j] for r in rounds]
            row = dict(first)
            for key in ("oop", "ip"):
                row[key] = best([r[key] for r in same])
            row["compare"] = {}
            for name in first["compare"]:
                entries = [r["compare"][name] for r in same]
                row["compare"][name] = entry = best(entries)
                if "time_us" in entry:
                    entry["ours_us"] = min(e["ours_us"] for e in entries if "time_us" in e)
                    entry["ratio"] = entry["time_us"] / entry["ours_us"]
            merged[coll].append(row)
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    try:
        return run(args, MPI.COMM_WORLD)
    except (Exception, KeyboardInterrupt):
        # One rank's failure ends the job: its peers would otherwise wait for it forever, in
        # a collective or in MPI_Finalize when they exit.
        sys.stdout.flush()
        traceback.print_exc()
        sys.stderr.flush()
        # The launcher forwards a rank's output from a pipe; an abort handled before it has
        # read that pipe loses the traceback (seen once, on a loaded machine). A moment for it.
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(1)
        return 1


def run(args, mpi) -> int:
    import pycollectives as pc

    if not 0 <= args.root < mpi.size:
        return refuse(mpi, f"-r {args.root} is out of range for {mpi.size} ranks")
    dev = None
    if args.device == "cuda":
        try:
            dev = gpu.open_device(mpi, dtype_of(args.datatype))
        except gpu.Unusable as e:
            return refuse(mpi, f"--device cuda cannot run: {e}")
    comm = pc.Communicator(mpi)
    sweep = Sweep(args, comm, mpi, SharedArrays(comm) if args.shared else dev)
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
        steps = len(sizes) * len(colls) * (1 + len(args.compare)) * args.rounds
        progress = report.Progress(steps, mpi.rank == 0)
        rounds, notes, meta_peers = [], [], {}
        for _ in range(args.rounds):
            rows_of = measure_ours(sweep, colls, sizes, comm.size, copy_bw, progress)
            # Peers run after all of our sizes, one at a time, each closed before the next:
            # some leave threads polling (gloo's, NCCL's proxies), which would slow what follows.
            for name in args.compare:
                peer = open_peer(name, mpi, dev, sweep)
                try:
                    measure_peer(sweep, peer, name, rows_of, progress)
                finally:
                    peer.close()
                if not peer.reason and peer.what and name not in meta_peers:
                    notes.append((name, peer.what))
                meta_peers[name] = peer.reason or peer.what
            rounds.append(rows_of)
        rows_of = best_of(rounds) if len(rounds) > 1 else rounds[0]
        title = (
            f"pycollectives {pc.__version__}, {comm.size} ranks, {platform.machine()}, "
            f"{args.datatype} {args.op}, algorithm {args.algo or 'auto'}"
        )
        if args.contention:
            title += f", {busy.n} busy processes beside the ranks"
        if args.shared:
            title += ", buffers from Communicator.empty"
        if args.time > 0:
            title += f", each size timed for at least {args.time:g} s"
        if args.rounds > 1:
            title += f", best of {args.rounds} rounds"
        meta = {
            "ranks": comm.size,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "mpi": peers.mpi_library(),
            "pycollectives": pc.__version__,
            "copy_bw_GBs": copy_bw,
            "args": vars(args),
        }
        if meta_peers:
            meta["peers"] = meta_peers
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
            forced = [n for n in args.compare if n in ALGORITHMS]
            if forced and args.algo is None and len(ALGORITHMS_FOR.get(coll, ())) > 1:
                others = (
                    {"shipped": report.shipped_choice, "model": report.model_choice}
                    if dev is None
                    else {}
                )
                print(report.choices(these, forced, comm.algorithm_for, comm.size, others))
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
