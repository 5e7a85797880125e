"""What the scripts in benchmarks/ share: their common options, the machine line their
tables start with, their JSON files, and running themselves under mpiexec when started
without it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np


def batch_options(description: str, rounds: int, iters: int = 20000) -> argparse.Namespace:
    """The options of a benchmark that times small calls in batches, two ways alternating:
    --rounds batches (the best counts) of --iters calls."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--iters", type=int, default=iters)
    return ap.parse_args()


def sweep_options(description: str, rounds: int) -> argparse.Namespace:
    """The options of a benchmark over message sizes from --min-bytes to --max-bytes, best of
    --rounds batches, its rows also written to --json."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    return ap.parse_args()


def float32_sizes(lo: int, hi: int, step: int, budget: int, least: int, most: int):
    """(nbytes, x, out, calls) for nbytes = lo, lo * step, ... up to hi: x float32 ones of
    nbytes (nbytes // 4 elements), out an uninitialised array like it, and calls a batch's
    count, budget // nbytes // 4 (at least `least`, at most `most`)."""
    nbytes = lo
    while nbytes <= hi:
        x = np.ones(nbytes // 4, np.float32)
        calls = int(min(most, max(least, budget // max(nbytes, 1) // 4)))
        yield nbytes, x, np.empty_like(x), calls
        nbytes *= step


def machine() -> dict:
    """{"cpu": this machine's processor, "mpi": the MPI library mpi4py runs on}."""
    from pycollectives.bench.peers import mpi_library

    return {"cpu": platform.processor() or platform.machine(), "mpi": mpi_library()}


def write_json(path: str, doc):
    """Writes `doc` to `path` as JSON, indented one space a level."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def two_rank_options(description: str, sizes) -> argparse.ArgumentParser:
    """The options of a benchmark that launches itself on 2 ranks (measure_or_launch):
    --sizes (default `sizes`), --rounds, --json; the caller adds its own and parses."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--sizes", default=",".join(map(str, sizes)), help="bytes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    return ap


def measure_or_launch(args, measure, launch):
    """Under mpiexec: measure(args), which writes rank 0's rows to --json (to nowhere without
    it). Started without mpiexec: launch(args), which runs the script under it
    (run_on_two_ranks)."""
    under_mpiexec = any(k in os.environ for k in ("PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_RANK"))
    if not under_mpiexec:
        return launch(args)
    if args.json is None:
        args.json = os.devnull
    measure(args)
    return None


def run_on_two_ranks(script: str, args, extra=(), env=None) -> dict:
    """Runs `script` on 2 ranks with the mpiexec beside this Python, passing on --sizes and
    --rounds and then `extra`, with `env` added to the environment; returns the JSON its rank
    0 wrote (measure_or_launch)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [mpiexec, "-n", "2", sys.executable, script, "--sizes", args.sizes]
        cmd += ["--rounds", str(args.rounds), "--json", path, *extra]
        subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})
        with open(path) as f:
            return json.load(f)


def log_row(mpi, rows: list, row: dict):
    """Adds `row` to `rows`; rank 0 also prints it to stderr as it comes (the launching
    process prints the table at the end)."""
    rows.append(row)
    if mpi.rank == 0:
        print(json.dumps(row), file=sys.stderr, flush=True)
