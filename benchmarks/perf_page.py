"""The tables of docs/performance.md, made from the result files in benchmarks/results/.

A table's rows are never typed by hand: each block of the page between
`<!-- perf-table NAME -->` and `<!-- end perf-table -->` is written from the files TABLES names,
and ends with a line naming them and the machine they were measured on. The GPU tables
(`<!-- gpu-table NAME -->`, benchmarks/gpu_tables.py) are rewritten with them. The prose around
the blocks is the page's own.

    python benchmarks/perf_page.py            # prints every table
    python benchmarks/perf_page.py --write    # puts them into docs/performance.md
    python benchmarks/perf_page.py --check    # exit 1 where the page differs (a test runs it)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from pycollectives.bench.report import percent

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_tables  # noqa: E402 - benchmarks/gpu_tables.py, which writes the page's GPU tables

RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Where the files were measured (the files of the CPU benchmarks do not say it themselves).
VM = "the 2-core AMD EPYC VM (KVM, L3 32 MiB, no GPU; MPICH 5.0.2)"
MODEL = "the α–β model (`python -m pycollectives.cost_model`), calibrated on the 2-core VM"

PEERS = {"mpi": "MPI", "gloo": "gloo", "oneccl": "oneCCL", "deepspeed": "DeepSpeed shm"}


# --- numbers as the page writes them -----------------------------------------------------------


def size(n: int) -> str:
    """8 B, 4 KiB, 16 MiB, 1 GiB."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def num(v: float) -> str:
    """Three significant figures, at most two decimals; whole numbers from 100."""
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def us(v: float) -> str:
    """A time given in µs: 1.70 µs, 10.9 µs, 182 µs, 1.24 ms, 12.2 ms, 102 ms."""
    if v >= 1000:
        return f"{num(v / 1000)} ms"
    return f"{num(v)} µs"


def ratio(v: float) -> str:
    """A peer's time over ours: 2.15×, 262×; bold below 1 (the peer is faster)."""
    if v < 1:
        return f"**{v:.3f}×**" if v >= 0.1 else f"**{v:.2g}×**"
    return f"{num(v)}×"


def gbs(v: float) -> str:
    return f"{num(v)} GB/s"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def made_from(files: list[str], machine: str) -> str:
    names = ", ".join(f"`{f}`" for f in files)
    return f"Made by `benchmarks/perf_page.py` from {names}; measured on {machine}."


def load_json(name: str):
    return json.loads((RESULTS / name).read_text())


def rows_by(name: str, key: str) -> dict:
    """A result file's rows by (row[key], row["bytes"])."""
    return {(r[key], r["bytes"]): r for r in load_json(name)["rows"]}


def text(name: str) -> str:
    return (RESULTS / name).read_text()


def need(pattern: str, source: str, name: str, flags=re.M):
    m = re.search(pattern, source, flags)
    if m is None:
        raise ValueError(f"{name}: nothing matches {pattern!r}")
    return m


# --- the tables ---------------------------------------------------------------------------------


def allreduce_vs_mpi() -> list[str]:
    name = "allreduce_vs_mpi-2ranks.json"
    rows = {r["bytes"]: r for r in load_json(name)["rows"]}
    out = []
    for n in (8, 4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB):
        r = rows[n]
        ours, mpi = us(r["ours_us"]), us(r["mpi_us"])
        if n >= 64 * KiB:
            ours += f" ({gbs(r['ours_busbw_GBs'])})"
            mpi += f" ({gbs(r['mpi_busbw_GBs'])})"
        out.append([size(n), ours, mpi, ratio(r["speedup"])])
    head = ["all-reduce float32, 2 ranks", "pycollectives", "MPI_Allreduce", "MPI / ours"]
    return table(head, out) + ["", made_from([name], VM)]


def sweep_rows(name: str) -> tuple[list[str], dict[int, dict]]:
    """A pycoll-bench result (its --json file): the peers compared, and by size ours (out of
    place), of bound and each peer's ratio (None where the peer lacks the collective)."""
    data = load_json(name)
    peers = data["meta"]["args"]["compare"]
    rows = {}
    for r in data["rows"]:
        ours = r["oop"]["time_us"]
        compare = r.get("compare", {})
        rows[r["size"]] = {
            "ours": ours,
            "of bound": r["bound"]["time_us"] / ours,
            **{p: (compare.get(p) or {}).get("ratio") for p in peers},
        }
    return peers, rows


def sweep(name: str, sizes: list[int], label: str) -> list[str]:
    peers, rows = sweep_rows(name)
    # A peer without the collective gets no column.
    shown = [p for p in peers if any(rows[n][p] is not None for n in sizes)]
    out = []
    for n in sizes:
        r = rows[n]
        out.append([size(n), us(r["ours"]), percent(r["of bound"])] + [ratio(r[p]) for p in shown])
    head = [label, "ours", "of bound", *(PEERS[p] for p in shown)]
    return table(head, out) + ["", made_from([name], VM)]


SWEEP_ALL_REDUCE = [8, 256, 4 * KiB, 64 * KiB, 256 * KiB, MiB, 2 * MiB, 4 * MiB, 8 * MiB,
                    16 * MiB, 32 * MiB, 64 * MiB]  # fmt: skip
SWEEP_SHARED = [8, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB]
SWEEP_CONTENTION = [8, 128, 2 * KiB, 32 * KiB, 512 * KiB, 8 * MiB, 32 * MiB]
SWEEP_GATHER = [8, 2 * KiB, 8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB]
SWEEP_SCATTER = [8, 2 * KiB, 32 * KiB, 512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB]


def shared_others() -> list[str]:
    """All-gather, broadcast and reduce-scatter on Communicator.empty buffers, from 512 KiB."""
    sizes = [512 * KiB, 2 * MiB, 8 * MiB, 32 * MiB]
    out, files = [], []
    for collective, label in (
        ("all_gather", "all-gather"),
        ("broadcast", "broadcast"),
        ("reduce_scatter", "reduce-scatter"),
    ):
        name = f"bench-{collective}-shared-2ranks.json"
        files.append(name)
        _, rows = sweep_rows(name)
        out.append(
            [f"{label}: ours, of bound"]
            + [f"{us(rows[n]['ours'])}, {percent(rows[n]['of bound'])}" for n in sizes]
        )
        out.append(
            [f"{label}: MPI, oneCCL"]
            + [f"{ratio(rows[n]['mpi'])}, {ratio(rows[n]['oneccl'])}" for n in sizes]
        )
    return table(["shared buffers", *map(size, sizes)], out) + ["", made_from(files, VM)]


def call_cost() -> list[str]:
    files = ["call_cost-1rank.txt", "call_cost-2ranks.txt"]
    runs = []
    for name in files:
        rows = {}
        for line in text(name).splitlines():
            m = re.match(r"\s*(\w+)\s+([\d.]+), ([\d.]+)\s+([\d.]+), ([\d.]+)\s+([\d.]+)x", line)
            if m:
                rows[m.group(1)] = m.groups()[1:]
        runs.append(rows)
    out = []
    for call in runs[0]:
        cells = [call.replace("_", "-")]
        for rows in runs:
            ours_med, ours_best, mpi_med, mpi_best, _ = rows[call]
            cells += [f"{ours_med} ({ours_best})", f"{mpi_med} ({mpi_best})"]
        out.append(cells)
    head = ["8 B, µs per call", "1 rank: ours", "mpi4py", "2 ranks: ours", "mpi4py"]
    return table(head, out) + ["", made_from(files, VM)]


def ddp_vs_torch() -> list[str]:
    files = ["ddp_vs_torch-2ranks.txt", "ddp_vs_torch-bucketview-2ranks.txt"]
    runs = []
    for name in files:
        runs.append(
            {k: float(v) for k, v in re.findall(r"^\s*(\w+):\s+([\d.]+) ms$", text(name), re.M)}
        )
    labels = {
        "local": "no communication",
        "ours": "pycollectives.torch.DistributedDataParallel",
        "torch_ours": 'torch DDP on the "pycollectives" backend',
        "torch_gloo": "torch DDP on gloo",
        "allreduce": "the gradient all-reduce alone",
    }
    out = []
    for key, label in labels.items():
        cells = [label]
        for run in runs:
            cell = f"{run[key]:.1f} ms"
            if key in ("ours", "torch_ours"):
                cell += f" ({run[key] / run['torch_gloo']:.2f}×)"
            cells.append(cell)
        out.append(cells)
    head = ["2 ranks, step time", "default", "`--bucket-view`"]
    return table(head, out) + ["", made_from(files, VM)]


def torch_backend() -> list[str]:
    name = "torch_backend_vs_gloo-2ranks.txt"
    src = text(name)
    rows: dict[str, dict[int, list[str]]] = {}
    for line in src.splitlines():
        m = re.match(
            r"\s*(\w+(?: list)?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line
        )
        if m:
            rows.setdefault(m.group(1), {})[int(m.group(2))] = list(m.groups()[2:])
    calls = {
        "all_reduce": "`dist.all_reduce`",
        "all_gather": "`dist.all_gather_into_tensor`",
        "reduce_scatter": "`dist.reduce_scatter_tensor`",
        "all_gather list": "`dist.all_gather` (a list)",
        "reduce_scatter list": "`dist.reduce_scatter` (a list)",
    }
    sizes = [8, 64 * KiB, MiB, 16 * MiB]
    out = [[label] + [" / ".join(rows[op][n]) for n in sizes] for op, label in calls.items()]
    parts = re.findall(r"^# 8 B all_reduce, (.*?)\s{2,}([\d.]+) us$", src, re.M)
    lines = table(["µs per call", *map(size, sizes)], out)
    lines += ["", *table(["8 B all-reduce through", "µs per call"], [[p, t] for p, t in parts])]
    return lines + ["", made_from([name], VM)]


def p2p() -> list[str]:
    name = "p2p_vs_mpi-2ranks.json"
    rows = rows_by(name, "op")
    sizes, out = sorted({n for _, n in rows}), []
    for op in ("sendrecv", "all_to_all"):
        ours, mpi, nocma = [f"{op}: ours"], [f"{op}: MPI"], [f"{op}: MPI without CMA"]
        for n in sizes:
            r = rows[op, n]
            cell = num(r["api_us"])
            if n >= MiB:
                cell += f" ({gbs(r['api_busbw_GBs'])})"
            ours.append(cell)
            mpi.append(f"{num(r['mpi_us'])} ({ratio(r['mpi_us'] / r['api_us'])})")
            nocma.append(f"{num(r['mpi_nocma_us'])} ({ratio(r['mpi_nocma_us'] / r['api_us'])})")
        out += [ours, mpi, nocma]
    return table(["µs per call", *map(size, sizes)], out) + ["", made_from([name], VM)]


def core_placement() -> list[str]:
    """The three placements the time series shows, by cache-line round trip: each row the
    median of the samples in its class."""
    name = "core_placement.txt"
    samples = [
        tuple(map(float, line.split()[1:4]))
        for line in text(name).splitlines()
        if line.strip() and not line.startswith("#")
    ]
    classes = (
        ("sharing a cache", 0, 80),
        ("one socket", 80, 200),
        ("apart", 200, float("inf")),
    )
    out = []
    for label, lo, hi in classes:
        got = [s for s in samples if lo <= s[0] < hi]
        trip, cached, streamed = (statistics.median(col) for col in zip(*got))
        out.append([label, str(len(got)), f"{trip:.0f} ns", gbs(cached), gbs(streamed)])
    head = ["placement", "samples", "cache-line round trip", "hand-over, ordinary stores",
            "non-temporal stores"]  # fmt: skip
    return table(head, out) + ["", made_from([name], VM + ", one core writing, the other reading")]


def slot_stores() -> list[str]:
    name = "slot_stores-2ranks.txt"
    found = re.findall(
        r"^# (\d+) bytes: auto ([\d.]+)x cached, ([\d.]+)x streamed", text(name), re.M
    )
    out = [[size(int(n)), f"{c}×", f"{s}×"] for n, c, s in found]
    head = ["all-reduce, 2 ranks, a minute each", "auto against cached", "auto against streamed"]
    return table(head, out) + ["", made_from([name], VM)]


def staging_ceiling() -> list[str]:
    name = "staging_ceiling.txt"
    blocks = re.findall(r"^# 2 threads, ([\d.]+) MiB.*\n#.*\n((?:  \S.*\n?)+)", text(name), re.M)
    schedules: dict[str, dict[str, str]] = {}
    for mib, body in blocks:
        for line in body.splitlines():
            label, _best, _median, of_bound = line.split()
            schedules.setdefault(label, {})[mib] = of_bound
    sizes = [mib for mib, _ in blocks]
    labels = {
        "nt-copy": "non-temporal copy (the bound)",
        "ring": "staged ring",
        "one-shot": "each rank reduces the whole array",
        "cma": "peer's input read with cross-memory attach",
    }
    out = [[labels.get(k, k)] + [v[m] for m in sizes] for k, v in schedules.items()]
    head = ["2 threads, float32, best of 8", *(f"{float(m):.0f} MiB" for m in sizes)]
    return table(head, out) + ["", made_from([name], VM)]


def hierarchical() -> list[str]:
    name = "hierarchical-2x2.json"
    rows = {r["bytes"]: r for r in load_json(name)["rows"]}
    out = []
    for n in (8, 2 * KiB, 32 * KiB, 128 * KiB, 2 * MiB, 32 * MiB):
        r = rows[n]
        if n < MiB:
            cells = [us(r["hier_us"]), us(r["ring_us"]), us(r["mpi_us"])]
        else:
            cells = [gbs(r["hier_busbw_GBs"]), gbs(r["ring_busbw_GBs"]), gbs(r["mpi_busbw_GBs"])]
        vs = [ratio(r["ring_us"] / r["hier_us"]), ratio(r["mpi_us"] / r["hier_us"])]
        out.append([size(n), *cells, *vs])
    head = ["size", "hierarchical", "flat ring over MPI", "MPI_Allreduce", "vs ring", "vs MPI"]
    return table(head, out) + ["", made_from([name], VM + ", 4 ranks as 2 nodes of 2")]


def p2p_across_nodes() -> list[str]:
    name = "p2p_across_nodes-2ranks.json"
    rows = rows_by(name, "pattern")
    sizes, out = sorted({n for _, n in rows}), []
    for pattern in ("sendrecv", "inflight"):
        out.append([f"{pattern}: ours"] + [num(rows[pattern, n]["ours_us"]) for n in sizes])
        out.append(
            [f"{pattern}: MPI"]
            + [
                f"{num(rows[pattern, n]['mpi_us'])} ({ratio(rows[pattern, n]['ratio'])})"
                for n in sizes
            ]
        )
    machine = VM + ", 2 ranks as 2 emulated nodes"
    return table(["µs per iteration", *map(size, sizes)], out) + ["", made_from([name], machine)]


def check_across_nodes() -> list[str]:
    files = ["check_across_nodes_2x1.json", "check_across_nodes_2x2.json"]
    cells = [("all_reduce", 8), ("all_reduce", 64 * KiB), ("all_reduce", MiB), ("broadcast", 8),
             ("reduce", 8)]  # fmt: skip
    out = []
    for name, label in zip(files, ["2 nodes × 1 rank", "2 nodes × 2 ranks"]):
        rows = rows_by(name, "collective")
        out.append(
            [label]
            + [f"{num(rows[c]['checked_us'])} ({num(rows[c]['unchecked_us'])})" for c in cells]
        )
    head = ["µs per call, checked (unchecked)"]
    head += [f"{c.replace('_', '-')} {size(n)}" for c, n in cells]
    return table(head, out) + ["", made_from(files, VM + ", nodes emulated")]


def elastic_recovery() -> list[str]:
    name = "elastic_recovery-4ranks.txt"
    src = text(name)
    elastic, restart = src.split("restart (")

    def grab(part, what):
        return need(rf"^  {what}\s+(.*)$", part, name).group(1).strip()

    out = [
        ["undisturbed job", grab(elastic, "undisturbed job"), grab(restart, "undisturbed job")],
        [
            "rank 2 killed at step 40",
            grab(elastic, "rank 2 killed at step 40"),
            grab(restart, "rank 2 killed at step 40"),
        ],
        [
            "death → survivors' next completed step",
            grab(elastic, "death -> next completed step"),
            "—",
        ],
        ["replacement taken in", grab(elastic, "replacement taken in"), "—"],
    ]
    head = ["4 ranks, medians of 3 runs", "elastic (`examples.elastic`, 120 steps)",
            "restart (`examples.train`, `--max-restarts 1`)"]  # fmt: skip
    return table(head, out) + ["", made_from([name], VM)]


def elastic_nodes() -> list[str]:
    name = "elastic_nodes-2x2.txt"
    src = text(name)

    def grab(what):
        return need(rf"^{re.escape(what)} (.*)$", src, name).group(1)

    out = [
        [
            "elastic launcher, both ranks of node 1 killed",
            grab("launcher, node 1 lost: survivors' next step"),
            grab("launcher, node 1 lost: world of 4 again"),
        ],
        [
            "torchrun, rank 2 killed, its agent stops rank 3",
            grab("torchrun, rank 2 lost (its agent stops rank 3): survivors' next step"),
            "—",
        ],
    ]
    head = ["2 nodes × 2 ranks, medians of 3", "death → survivors' next step",
            "death → world of 4 again"]  # fmt: skip
    return table(head, out) + ["", made_from([name], VM + ", 2 namespace nodes")]


def trace_overhead() -> list[str]:
    name = "trace_overhead-2ranks.txt"
    out = []
    for line in text(name).splitlines():
        values = line.split()
        if values and values[0].isdigit():
            n, untraced, traced, added, _ = values
            out.append([size(int(n)), f"{untraced} µs", f"{traced} µs", f"{added} µs"])
    head = ["all-reduce float32, 2 ranks", "untraced", "traced", "added"]
    return table(head, out) + ["", made_from([name], VM)]


def flight_overhead() -> list[str]:
    name = "flight_overhead-2ranks.txt"
    out = []
    for line in text(name).splitlines():
        values = line.split()
        if len(values) == 5 and values[0] in ("all_reduce", "broadcast"):
            call, off, on, added, share = values
            out.append([call.replace("_", "-"), f"{off} µs", f"{on} µs", f"{added} µs", share])
    need(r"^all_reduce ", text(name), name)
    head = ["8 B float32, 2 ranks", "recorder off", "on (default)", "added", "share"]
    return table(head, out) + ["", made_from([name], VM)]


def reproducible_cost() -> list[str]:
    """All-reduce times by default and in reproducible mode, 2 and 4 ranks."""
    out = []
    names = [f"reproducible_cost-{n}ranks.txt" for n in (2, 4)]
    for n, name in zip((2, 4), names):
        need(r"reproducible", text(name), name)
        for line in text(name).splitlines():
            v = line.split()
            if len(v) == 8 and v[1] in ("B", "MiB"):
                label, kind, a, algo_a, b, algo_b, r = f"{v[0]} {v[1]}", *v[2:]
                out.append([str(n), label, kind, f"{a} µs ({algo_a})", f"{b} µs ({algo_b})", r])
    head = ["ranks", "all-reduce float32", "arrays", "default", "reproducible", "ratio"]
    return table(head, out) + ["", made_from(names, VM)]


def small_shm_slots() -> list[str]:
    """All-reduce times with the default slots against the 32 KiB slots 8 ranks take in a
    64 MB /dev/shm: the file holds the two sweeps one after the other."""
    name = "small_shm_slots-2ranks.txt"
    runs: list[dict] = []
    for line in text(name).splitlines():
        if line.startswith("# PYCOLL_STAGING_BYTES="):
            runs.append({})
        values = line.split()
        if runs and values and values[0].isdigit() and len(values) >= 6:
            runs[-1][int(values[0])] = float(values[5])  # out-of-place time, µs
    need(r"^# PYCOLL_STAGING_BYTES=32768", text(name), name)
    default, small = runs
    out = [
        [size(n), us(default[n]), us(small[n]), ratio(small[n] / default[n])]
        for n in sorted(default)
    ]
    head = ["all-reduce float32, 2 ranks", "256 KiB slots", "32 KiB slots", "slower by"]
    return table(head, out) + ["", made_from([name], VM)]


def dp_vs_ddp() -> list[str]:
    name = "dp_vs_ddp.json"
    data = load_json(name)
    out = [
        [
            str(r["ranks"]),
            r["mode"],
            f"{r['step_ms']:.1f}",
            f"{r['rank0_sent_mib'] + r['rank0_received_mib']:.1f}",
            f"{r['others_sent_mib'] + r['others_received_mib']:.1f}",
        ]
        for r in data["rows"]
    ]
    head = ["ranks", "mode", "step (ms)", "rank 0 sent + received (MiB/step)",
            "other ranks (MiB/step)"]  # fmt: skip
    return table(head, out) + ["", f"{data['title']}.", "", made_from([name], VM)]


def model_scaling() -> list[str]:
    name = "model.json"
    data = load_json(name)
    rows = {(r["gpus"], r["bytes"]): r for r in data["scaling"]}
    out = []
    for gpus in sorted({g for g, _ in rows}):
        small, large = rows[gpus, 8], rows[gpus, GiB]
        out.append(
            [str(gpus)]
            + [us(small[f"{a}_us"]) for a in ("ring", "tree", "hierarchical")]
            + [gbs(large[f"{a}_busbw"]) for a in ("ring", "tree", "hierarchical")]
        )
    head = ["GPUs", "8 B: ring", "tree", "hierarchical", "1 GiB busbw: ring", "tree",
            "hierarchical"]  # fmt: skip
    check = data["nccl_check"]
    notes = [
        f"Largest calibration error on the VM: {data['calibration_worst_error']:.0%}. "
        f"8-GPU ring all-reduce against NCCL's published figures: busbw at 1 GiB "
        f"{check['busbw_GBs']:.0f} GB/s (published 360–370), latency at 8 B "
        f"{check['latency_us']:.1f} µs (published about 15).",
    ]
    return table(head, out) + ["", *notes, "", made_from([name], MODEL)]


def gpu_after() -> tuple[str, str]:
    """The 'after' section of the device-checks file: the latest code measured on a GPU."""
    name = "gpu_device_checks-h200-ab.txt"
    src = text(name)
    m = need(r"^#\s+after\s+([0-9a-f]+)", src, name)
    return m.group(1), need(r"^== after\n(.*?)(?=^== |\Z)", src, name, re.M | re.S).group(1)


def gpu_device_checks() -> list[str]:
    name = "gpu_device_checks-h200-ab.txt"
    commit, section = gpu_after()
    out = []
    for block in re.split(r"(?=^# \d+ ranks on )", section, flags=re.M)[1:]:
        ranks = need(r"^# (\d+) ranks on", block, name).group(1)
        floor = float(need(r"launch\+sync ([\d.]+) us", block, name).group(1))
        graph = float(need(r"CUDA graph of \d+, per call: ([\d.]+) us", block, name).group(1))
        rows = {}
        body = need(r"^## all_reduce .*\n.*\n((?: *\d+ .*\n?)+)", block, name).group(1)
        for line in body.splitlines():
            v = line.split()
            rows[int(v[0])] = v
        small, mid, large = rows[8], rows[2 * MiB], rows[128 * MiB]
        out.append(
            [
                f"{ranks} ranks",
                f"{small[1]} / {small[2]} µs",
                us(graph),
                us(float(mid[1])),
                us(float(large[2])),
                f"{large[3]} GB/s",
                large[7],
                us(floor),
            ]
        )
    head = ["all-reduce, kernel mode (MPS)", "8 B sync / b2b", "8 B in a replayed graph",
            "2 MiB sync", "128 MiB b2b", "busbw at 128 MiB", "of the bound",
            "launch+sync floor"]  # fmt: skip
    costs = re.findall(r"^(\S+)\s+wall\s+([\d.]+) us/call\s+cpu\s+([\d.]+) us/call", section, re.M)
    calls = [[f"`{who}`", f"{wall} µs", f"{cpu} µs"] for who, wall, cpu in costs]
    machine = f"one NVIDIA H200 shared by the ranks (driver 580.159.04, CUDA 13.0), commit {commit}"
    return (
        table(head, out)
        + ["", *table(["8 B all-reduce, 2000 calls back to back", "wall", "CPU"], calls)]
        + ["", made_from([name], machine)]
    )


TABLES = {
    "allreduce-vs-mpi": allreduce_vs_mpi,
    "sweep-all-reduce": lambda: sweep(
        "bench-all_reduce-2ranks.json", SWEEP_ALL_REDUCE, "all-reduce"
    ),
    "sweep-all-reduce-shared": lambda: sweep(
        "bench-all_reduce-shared-2ranks.json", SWEEP_SHARED, "all-reduce, shared buffers"
    ),
    "sweep-all-reduce-contention": lambda: sweep(
        "bench-all_reduce-contention-2ranks.json", SWEEP_CONTENTION, "all-reduce, contention"
    ),
    "sweep-all-gather": lambda: sweep("bench-all_gather-2ranks.json", SWEEP_GATHER, "all-gather"),
    "sweep-broadcast": lambda: sweep("bench-broadcast-2ranks.json", SWEEP_GATHER, "broadcast"),
    "sweep-reduce-scatter": lambda: sweep(
        "bench-reduce_scatter-2ranks.json", SWEEP_SCATTER, "reduce-scatter"
    ),
    "sweep-shared-others": shared_others,
    "core-placement": core_placement,
    "slot-stores": slot_stores,
    "staging-ceiling": staging_ceiling,
    "call-cost": call_cost,
    "ddp-vs-torch": ddp_vs_torch,
    "torch-backend": torch_backend,
    "p2p": p2p,
    "hierarchical": hierarchical,
    "p2p-across-nodes": p2p_across_nodes,
    "check-across-nodes": check_across_nodes,
    "elastic-recovery": elastic_recovery,
    "elastic-nodes": elastic_nodes,
    "trace-overhead": trace_overhead,
    "flight-overhead": flight_overhead,
    "reproducible-cost": reproducible_cost,
    "small-shm-slots": small_shm_slots,
    "dp-vs-ddp": dp_vs_ddp,
    "model-scaling": model_scaling,
    "gpu-device-checks": gpu_device_checks,
}


def tables() -> dict[str, list[str]]:
    return {name: make() for name, make in TABLES.items()}


def rewrite(page: str, made: dict[str, list[str]]) -> str:
    """`page` with each of these tables' blocks (`<!-- perf-table NAME -->`) replaced by
    `made`'s: gpu_tables.py's rewrite, for the other kind of marker."""
    return gpu_tables.rewrite(page, made, "perf-table")


def render(page: str) -> str:
    """The page with every table, CPU and GPU, written from its files."""
    return gpu_tables.rewrite(rewrite(page, tables()), gpu_tables.tables())


def main(argv=None) -> int:
    description = __doc__.split("\n\n")[0]
    args = gpu_tables.page_options(argv, description, "rewrite docs/performance.md's tables")
    if not (args.write or args.check):
        for name, lines in tables().items():
            print(f"<!-- perf-table {name} -->")
            print("\n".join(lines))
            print()
        return 0
    stale = f"{PAGE.relative_to(ROOT)}'s tables differ from their files: run perf_page.py --write"
    return gpu_tables.update_page(render, args.write, stale)


if __name__ == "__main__":
    sys.exit(main())
