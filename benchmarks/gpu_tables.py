"""The GPU tables of docs/performance.md, made from the result files the GPU kit leaves
(tools/gpu/run.sh, `result`: benchmarks/results/gpu_bench-<gpu>-<n>ranks-<mode>.txt, headed
with the GPU, the driver and the commit). A table's rows are never typed by hand: copy the
kit's files into benchmarks/results/, name them in TABLES, and rewrite the page
(benchmarks/perf_page.py --write rewrites these tables with the page's others).

    python benchmarks/gpu_tables.py            # prints every table
    python benchmarks/gpu_tables.py --write    # puts them into the page, between their markers
    python benchmarks/gpu_tables.py --check    # exit 1 where the page differs (a test runs it)

Each table sits in docs/performance.md between `<!-- gpu-table NAME -->` and
`<!-- end gpu-table -->`, indented as its marker is.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"

# name -> the files of its rows, in order.
TABLES = {
    "h200-all-reduce": [
        "gpu_bench-h200-2ranks-mps.txt",
        "gpu_bench-h200-4ranks-mps.txt",
        "gpu_bench-h200-2ranks-host.txt",
    ],
}

MiB = 1 << 20
# gpu_bench.py's columns, in order.
COLUMNS = ["bytes", "sync us", "b2b us", "busbw", "staged us", "nccl us", "bound us", "of bound",
           "x floor", "staged/sync", "nccl/sync"]  # fmt: skip


@dataclass
class BenchFile:
    """What a table cites of one gpu_bench.py result file."""

    name: str
    gpu: str
    driver: str
    commit: str
    ranks: int
    sync: str
    mps: bool
    launch_sync_floor_us: float
    all_reduce: dict[int, dict[str, float]]  # bytes -> column -> value


def parse(path: Path) -> BenchFile:
    """Reads a gpu_bench.py result file with the kit's header; raises ValueError naming what is
    missing."""
    text = path.read_text()

    def need(pattern, what):
        m = re.search(pattern, text, re.M)
        if m is None:
            raise ValueError(f"{path.name}: no {what}")
        return m

    gpu, driver = need(r"^# (NVIDIA [^(,]+?) \(.*?driver ([0-9.]+)", "GPU and driver line").groups()
    commit = need(r"^# commit ([0-9a-f]+)", "commit line").group(1)
    command = need(r"^\$ (.*)$", "command line").group(1)
    ranks, sync = need(r"^# (\d+) ranks on .*sync=(\w+)", "ranks line").groups()
    sync = {"host": "stepped"}.get(sync, sync)  # stepped mode's old name, in older files
    floor = float(need(r"^# floors: launch\+sync ([0-9.]+) us", "floors line").group(1))
    block = need(r"^## all_reduce .*\n(.*\n)((?: *\d+ .*\n?)+)", "all_reduce table")
    if block.group(1).split() != " ".join(COLUMNS).split():
        raise ValueError(f"{path.name}: the all_reduce table's columns are not {COLUMNS}")
    rows = {}
    for line in block.group(2).splitlines():
        values = line.split()
        row = dict(zip(COLUMNS, values))
        rows[int(values[0])] = {k: float(v.rstrip("%")) for k, v in row.items() if k != "bytes"}
    return BenchFile(
        name=path.name,
        gpu=gpu.strip(),
        driver=driver,
        commit=commit,
        ranks=int(ranks),
        sync=sync,
        mps="MPS" in command,
        launch_sync_floor_us=floor,
        all_reduce=rows,
    )


def us(value: float) -> str:
    """A time in µs as the tables write it: 32.2 µs, 684 µs, 1.61 ms, 51.5 ms, 102 ms."""
    if value >= 1000:
        ms = value / 1000
        return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"
    return f"{value:.1f} µs" if value < 100 else f"{value:.0f} µs"


def pair(a: float, b: float) -> str:
    """Two times of one unit: "32.2 / 20.1 µs"."""
    first, unit = us(a).rsplit(" ", 1)
    second, unit_b = us(b).rsplit(" ", 1)
    return f"{first} / {second} {unit}" if unit == unit_b else f"{us(a)} / {us(b)}"


def all_reduce_table(files: list[BenchFile]) -> list[str]:
    """The all-reduce table: a row per file."""
    lines = [
        "| all-reduce | 8 B sync / b2b | 2 MiB sync | 128 MiB b2b | busbw at 128 MiB "
        "| of the bound | launch+sync floor | staged 8 B / 128 MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in files:
        small, mid, large = f.all_reduce[8], f.all_reduce[2 * MiB], f.all_reduce[128 * MiB]
        mode = f"{f.sync} mode" + (" (MPS)" if f.mps else "")
        lines.append(
            f"| {f.ranks} ranks, {mode} | {pair(small['sync us'], small['b2b us'])} "
            f"| {us(mid['sync us'])} | {us(large['b2b us'])} | {large['busbw']:.1f} GB/s "
            f"| {large['of bound']:.1f}% | {us(f.launch_sync_floor_us)} "
            f"| {us(small['staged us'])} / {us(large['staged us'])} |"
        )
    lines += ["", f"Made by `benchmarks/gpu_tables.py` from {sources(files)}."]
    return lines


def sources(files: list[BenchFile]) -> str:
    """Where a table's rows come from: the files, grouped by GPU, driver and commit."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for f in files:
        groups.setdefault((f.gpu, f.driver, f.commit), []).append(f"`{f.name}`")
    return "; ".join(
        f"{', '.join(names)} ({gpu}, driver {driver}, commit {commit})"
        for (gpu, driver, commit), names in groups.items()
    )


def tables() -> dict[str, list[str]]:
    return {
        name: all_reduce_table([parse(RESULTS / f) for f in files])
        for name, files in TABLES.items()
    }


def rewrite(page: str, made: dict[str, list[str]], kind: str = "gpu-table") -> str:
    """`page` with each table's block (between `<!-- KIND NAME -->` and `<!-- end KIND -->`)
    replaced by `made`'s, at the marker's indentation. perf_page.py writes its tables with it
    too."""
    for name, lines in made.items():
        pattern = re.compile(
            rf"^( *)<!-- {kind} {re.escape(name)} -->\n.*?^ *<!-- end {kind} -->$", re.M | re.S
        )
        m = pattern.search(page)
        if m is None:
            raise ValueError(f"{PAGE.name} has no <!-- {kind} {name} --> block")
        pad = m.group(1)
        body = "\n".join(pad + line if line else "" for line in lines)
        block = f"{pad}<!-- {kind} {name} -->\n{body}\n{pad}<!-- end {kind} -->"
        page = page[: m.start()] + block + page[m.end() :]
    return page


def page_options(argv, description: str, write_help: str) -> argparse.Namespace:
    """The options of a script that writes the page's tables (this one, perf_page.py): --write
    or --check, or neither to print the tables."""
    ap = argparse.ArgumentParser(description=description)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=write_help)
    group.add_argument("--check", action="store_true", help="exit 1 where the page differs")
    return ap.parse_args(argv)


def update_page(render, write: bool, stale: str) -> int:
    """Rewrites the page as `render(page)` returns it (`write`), or else prints `stale` and
    returns 1 where the page differs from that."""
    page = PAGE.read_text()
    new = render(page)
    if write:
        PAGE.write_text(new)
        return 0
    if new != page:
        print(stale)
        return 1
    return 0


def main(argv=None) -> int:
    args = page_options(argv, __doc__.split("\n\n")[0], "rewrite the page's GPU tables")
    made = tables()
    if not (args.write or args.check):
        for name, lines in made.items():
            print(f"<!-- gpu-table {name} -->")
            print("\n".join(lines))
        return 0
    stale = "docs/performance.md's GPU tables differ from their files: run gpu_tables.py --write"
    return update_page(lambda page: rewrite(page, made), args.write, stale)


if __name__ == "__main__":
    sys.exit(main())
