"""Measures this machine's links and fits the cost model's alpha, beta, gamma to them.

    mpiexec -n 2 python benchmarks/model_calibrate.py [--write PATH]

Two link classes, each measured with our own ring all-reduce (float32 sum) on 2 ranks, 8 B to
16 MiB: "intra" over shared memory (one node), "inter" over the MPI transport (the same two
ranks as two emulated nodes, PYCOLL_RANKS_PER_NODE=1, flat ring). For each class the model's
time is linear in (alpha, 1/beta, gamma) given the schedule's step, byte and reduction counts
(pycollectives.cost_model.schedule_costs); a least-squares fit on relative error gives them.
The file written (by default pycollectives/cost_model_calibration.json) keeps the measurements
too; tests/unit/test_cost_model.py checks the model against them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np
from mpi4py import MPI

import pycollectives as pc
from pycollectives import cost_model
from pycollectives.bench.peers import mpi_library
from pycollectives.bench.timing import per_call

SIZES = [8 << (2 * k) for k in range(12)]  # 8 B .. 32 MiB


def measure(comm, mpi, algorithm, nbytes, rounds=3):
    x = np.ones(max(1, nbytes // 4), np.float32)
    out = np.empty_like(x)
    iters = int(min(2000, max(3, (32 << 20) // nbytes)))

    def call():
        comm.all_reduce(x, out, algorithm=algorithm)

    warm = min(iters, 20)
    return min(per_call(mpi, call, iters, warmup=warm if i == 0 else 0) for i in range(rounds))


def fit_at(points, piece_bytes, cache_bytes, rendezvous_bytes):
    """alpha, beta (in cache), beta_large, gamma, rendezvous_alpha minimising the relative
    error of S*alpha + B/beta + R*gamma (+ S*rendezvous_alpha for large messages); returns
    (params, worst relative error)."""
    rows = []
    for p in points:
        n = p["nodes"] * p["ranks_per_node"]
        c = cost_model.schedule_costs("ring", "all_reduce", n, p["bytes"] // 4, piece_bytes // 4)
        steps = max(c.steps, cost_model._chain("ring", "all_reduce", n))
        large = p["bytes"] > cache_bytes
        rndv = (
            steps
            if rendezvous_bytes and c.bytes_sent // max(1, c.messages) > rendezvous_bytes
            else 0
        )
        row = [
            steps,
            0 if large else c.bytes_sent,
            c.bytes_sent if large else 0,
            c.bytes_reduced,
            rndv,
        ]
        rows.append(np.array(row, float) / p["seconds"])
    a, *_ = np.linalg.lstsq(np.array(rows), np.ones(len(rows)), rcond=None)
    a = np.maximum(a, [1e-9, 1e-13, 1e-13, 0.0, 0.0])
    worst = float(np.max(np.abs(np.array(rows) @ a - 1)))
    params = {"alpha": float(a[0]), "beta": float(1 / a[1]), "beta_large": float(1 / a[2])}
    params.update(gamma=float(a[3]), cache_bytes=cache_bytes, piece_bytes=piece_bytes)
    params.update(rendezvous_bytes=rendezvous_bytes, rendezvous_alpha=float(a[4]))
    return params, worst


def fit(points, piece_bytes, rendezvous):
    """The best fit over the cache sizes (and, for MPI, rendezvous thresholds) the measured
    sizes allow."""
    sizes = [p["bytes"] for p in points[2:-2]]
    thresholds = [s // 4 for s in sizes] if rendezvous else [0]
    fits = (fit_at(points, piece_bytes, c, t) for c in sizes for t in thresholds)
    return min(fits, key=lambda f: f[1])[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", default=str(cost_model.CALIBRATION_FILE))
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    if mpi.Get_size() != 2:
        raise SystemExit("run on 2 ranks: mpiexec -n 2 python benchmarks/model_calibrate.py")
    classes = {
        "intra": ({}, {"piece_bytes": 256 << 10}),
        "inter": ({"PYCOLL_RANKS_PER_NODE": "1"}, {"piece_bytes": 1 << 20}),
    }
    measurements, params = [], {}
    for name, (env, link_kwargs) in classes.items():
        os.environ.update(env)
        comm = pc.Communicator(mpi)
        algorithm = "ring" if name == "inter" else None
        points = []
        for nbytes in SIZES:
            t = measure(comm, mpi, "ring" if algorithm is None else algorithm, nbytes)
            points.append(
                {
                    "link": name,
                    "collective": "all_reduce",
                    "algorithm": "ring",
                    "bytes": nbytes,
                    "nodes": 2 if name == "inter" else 1,
                    "ranks_per_node": 1 if name == "inter" else 2,
                    "seconds": t,
                }
            )
            if mpi.rank == 0:
                print(f"{name:6} {nbytes:>10} B {t * 1e6:10.1f} us", flush=True)
        comm.close()
        for k in env:
            del os.environ[k]
        params[name] = fit(points, link_kwargs["piece_bytes"], rendezvous=name == "inter")
        measurements += points
    if mpi.rank == 0:
        cal = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{mpi_library()}",
            "generated_by": "benchmarks/model_calibrate.py",
            "params": params,
            "measurements": measurements,
        }
        with open(args.write, "w") as f:
            json.dump(cal, f, indent=1)
        print(json.dumps(params, indent=1))


if __name__ == "__main__":
    main()
