"""Single-process DataParallel against multi-process DDP: step time and rank 0's traffic.

    python -m pycollectives.examples.dp_vs_ddp [--ranks 2,4] [--steps 20] [--plot F.png]

The same model, data, optimizer and batch, trained both ways at each number of ranks:

- DataParallel: one process, its ranks threads (``Communicator.local``). Rank 0 replicates
  the parameters, scatters the batch, gathers the outputs, computes the loss, scatters the
  output gradients, and receives every rank's gradients, reduced, to update alone
  (``parallel.SingleProcessDataParallel``, torch's ``nn.DataParallel`` recipe).
- DDP: one process per rank (this module launches ``mpiexec -n N`` of itself), each with its
  own part of the batch, gradients averaged by bucketed all-reduces overlapping backward
  (``pc.DataParallel``), every rank updating its own replica.

It prints a table of step time and of the bytes rank 0 and the other ranks send and receive
per step (as the collectives' algorithms move them; ``parallel.data.local.TrafficCounter``),
whether each run ends where one process training on the whole batch ends, and draws the table
to a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from pycollectives.examples.common import (
    batches,
    blas_share,
    classification_data,
    limit_blas_threads,
    max_abs_diff,
    print_match,
    train_one_process,
)
from pycollectives.parallel import nn, optim
from pycollectives.parallel.data.local import SingleProcessDataParallel, TrafficCounter

MIB = 2**20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m pycollectives.examples.dp_vs_ddp", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--ranks", default="2,4", help="comma-separated numbers of ranks")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sizes", default="256,1024,1024,10", help="layer widths of the MLP")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--plot", default="dp_vs_ddp.png", help="PNG to draw ('' for none)")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--mpiexec", default=None, help="default: the one beside this Python")
    ap.add_argument("--ddp-worker", metavar="OUT", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def setup(args):
    sizes = [int(s) for s in args.sizes.split(",")]
    n = (args.warmup + args.steps) * args.batch_size
    x, y = classification_data(n, sizes[0], sizes[-1], seed=1, dtype=args.dtype)
    return nn.mlp(sizes, np.random.default_rng(0), args.dtype), x, y


OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


def single_process(args):
    model, x, y = setup(args)
    return train_one_process(model, batches(x, y, args.batch_size), **OPT)


def run_dp(args, n):
    """Single-process DataParallel on n thread ranks."""
    model, x, y = setup(args)
    limits = limit_blas_threads(blas_share(n))  # n ranks' threads share the cores, as in DDP
    dp = SingleProcessDataParallel(model, n, **OPT)
    try:
        times = []
        for s, (xb, yb) in enumerate(batches(x, y, args.batch_size)):
            if s == args.warmup:
                base = dp.traffic()
            t0 = time.perf_counter()
            dp.step(xb, yb)
            times.append(time.perf_counter() - t0)
        traffic = [(a - c, b - d) for (a, b), (c, d) in zip(dp.traffic(), base)]
        return _row("DataParallel (1 process)", n, times[args.warmup :], traffic, args.steps,
                    [p.copy() for p in model.params])  # fmt: skip
    finally:
        dp.close()
        if limits is not None:
            limits.restore_original_limits()


def _row(mode, n, times, traffic, steps, params):
    others = traffic[1:]
    return {
        "mode": mode,
        "ranks": n,
        "step_ms": 1e3 * float(np.median(times)),
        "rank0_sent_mib": traffic[0][0] / steps / MIB,
        "rank0_received_mib": traffic[0][1] / steps / MIB,
        "others_sent_mib": float(np.mean([t[0] for t in others])) / steps / MIB,
        "others_received_mib": float(np.mean([t[1] for t in others])) / steps / MIB,
        "params": params,
    }


def ddp_worker(args):
    """One rank of the DDP run (under mpiexec); rank 0 writes its row to args.ddp_worker."""
    import pycollectives as pc

    comm = pc.Communicator()
    limit_blas_threads(blas_share(comm.size))
    counter = TrafficCounter(comm)
    model, x, y = setup(args)
    dp = pc.DataParallel(counter, model.params, rebuild=False)
    nn.hand_out(model.layers, model.params, dp.grads)  # backward writes into the buckets
    opt = optim.make(OPT["optimizer"], model.params, OPT["lr"], momentum=OPT["momentum"])
    part = args.batch_size // comm.size
    mine = slice(comm.rank * part, (comm.rank + 1) * part)
    times = []
    for s, (xb, yb) in enumerate(batches(x, y, args.batch_size)):
        if s == args.warmup:
            counter.sent = counter.received = 0
        comm.barrier()
        t0 = time.perf_counter()
        model.zero_grad()
        out, c = model.forward(xb[mine])
        model.backward(nn.softmax_cross_entropy(out, yb[mine])[1], c, ready=dp.mark_ready)
        dp.synchronize()  # averaged: each rank's loss is the mean over its part
        opt.step(model.grads)
        times.append(time.perf_counter() - t0)
    traffic = comm.all_gather_object((counter.sent, counter.received))
    times = comm.all_gather_object(times[args.warmup :])
    if comm.rank == 0:
        slowest = np.max(np.array(times), axis=0)  # a step ends when its slowest rank ends
        row = _row("DDP (1 process per rank)", comm.size, slowest, traffic, args.steps,
                   [p.tolist() for p in model.params])  # fmt: skip
        with open(args.ddp_worker, "w") as f:
            json.dump(row, f)
    comm.close()


def run_ddp(args, n, argv):
    mpiexec = args.mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", __spec__.name, *argv,
               "--ddp-worker", out]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            row = json.load(f)
    row["params"] = [np.asarray(p, args.dtype) for p in row["params"]]
    return row


def table(rows) -> str:
    head = (f"{'mode':26} {'ranks':>5} {'step ms':>9} {'rank 0 sent':>12} {'rank 0 recv':>12} "
            f"{'others sent':>12} {'others recv':>12}  (MiB per step)")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:26} {r['ranks']:5d} {r['step_ms']:9.2f} "
                     f"{r['rank0_sent_mib']:12.2f} {r['rank0_received_mib']:12.2f} "
                     f"{r['others_sent_mib']:12.2f} {r['others_received_mib']:12.2f}")  # fmt: skip
    return "\n".join(lines)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("DataParallel (1 process)", "o"), ("DDP (1 process per rank)", "s")):
        mine = [r for r in rows if r["mode"] == mode]
        ranks = [r["ranks"] for r in mine]
        a.plot(ranks, [r["step_ms"] for r in mine], marker=marker, label=mode)
        b.plot(ranks, [r["rank0_sent_mib"] + r["rank0_received_mib"] for r in mine],
               marker=marker, label=mode)  # fmt: skip
    a.set(xlabel="ranks", ylabel="step time (ms, median)", title="step time")
    b.set(xlabel="ranks", ylabel="MiB per step", title="rank 0 traffic (sent + received)")
    for ax in (a, b):
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.ddp_worker:
        ddp_worker(args)
        return 0
    ranks = [int(r) for r in args.ranks.split(",")]
    if any(r < 2 or args.batch_size % r for r in ranks):
        raise SystemExit(f"--ranks {args.ranks}: each must be >= 2 and divide --batch-size")
    want = single_process(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    nparams = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    title = (f"MLP {args.sizes} ({nparams / 1e6:.2f} M parameters, {args.dtype}), batch "
             f"{args.batch_size}, {os.cpu_count()} CPUs")  # fmt: skip
    print(title, flush=True)
    rows = []
    for n in ranks:
        for row in (run_dp(args, n), run_ddp(args, n, raw)):
            d = max_abs_diff(row.pop("params"), want)
            row["max_abs_diff"] = d
            rows.append(row)
    print(table(rows))
    ok = print_match(max(r["max_abs_diff"] for r in rows), args.dtype)
    for n in ranks:
        dp, ddp = (next(r for r in rows if r["ranks"] == n and r["mode"].startswith(m))
                   for m in ("DataParallel", "DDP"))  # fmt: skip
        moved = [r["rank0_sent_mib"] + r["rank0_received_mib"] for r in (dp, ddp)]
        ratio = moved[0] / max(moved[1], 1e-12)
        print(f"{n} ranks: step time DataParallel / DDP = {dp['step_ms'] / ddp['step_ms']:.2f}; "
              f"rank 0's bytes DataParallel / DDP = {ratio:.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, title)
        print(f"plot: {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
