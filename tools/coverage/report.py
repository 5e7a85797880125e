"""Line coverage of the test suite: pycollectives/ by module (coverage.py, every rank's data
combined) and csrc/ by folder (gcov counts of the instrumented build, read with gcovr).

    python tools/coverage/report.py BUILD_DIR [--json FILE]

Run by ``make coverage`` after the suite ran under coverage; prints two tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_by_module() -> list[tuple[str, int, int]]:
    """(module, lines, lines run) from coverage.py's combined data."""
    out = subprocess.run(
        [sys.executable, "-m", "coverage", "json", "-q", "-o", "-"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    files = json.loads(out.stdout)["files"]
    rows = []
    for path, data in sorted(files.items()):
        s = data["summary"]
        name = str(Path(path).relative_to("pycollectives")).removesuffix(".py").replace("/", ".")
        rows.append((name, s["num_statements"], s["covered_lines"]))
    return rows


def calls_the_cuda_runtime(source: Path) -> bool:
    """Code that runs only with a CUDA device (the _cuda module's runtime calls), apart from
    the device code that the emulated device runs on the CPU (step kernel, planner)."""
    text = source.read_text(errors="replace")
    return any(word in text for word in ("cuda_runtime", "cudaError_t", "cudaStream_t"))


def native_by_folder(build: Path) -> list[tuple[str, int, int]]:
    """(csrc folder, lines, lines run) from the .gcda files under `build`. A line counts once,
    however many template instances contain it (--merge-lines), and as run if any of them ran
    it."""
    out = subprocess.run(
        [sys.executable, "-m", "gcovr", "--root", str(ROOT), "--filter", str(ROOT / "csrc"),
         "--merge-lines", "--json-summary", "-", "--gcov-ignore-errors=no_working_dir_found",
         # a count a racing thread left negative still says the line ran
         "--gcov-ignore-parse-errors=negative_hits.warn_once_per_file", str(build)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    folders: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for f in json.loads(out.stdout)["files"]:
        parts = Path(f["filename"]).parts  # csrc/<folder>/<file> or csrc/<file>
        folder = parts[1] if len(parts) > 2 else "(top)"
        if folder == "cuda" and calls_the_cuda_runtime(ROOT / f["filename"]):
            folder = "cuda, needs a GPU"
        folders[folder][0] += f["line_total"]
        folders[folder][1] += f["line_covered"]
    return [(k, v[0], v[1]) for k, v in sorted(folders.items())]


def table(title: str, rows: list[tuple[str, int, int]]) -> str:
    total, run = sum(r[1] for r in rows), sum(r[2] for r in rows)
    width = max(len(r[0]) for r in rows + [("total", 0, 0)])
    lines = [f"{title:<{width}} {'lines':>7} {'run':>7} {'cover':>6}"]
    for name, n, k in rows + [("total", total, run)]:
        pct = 100.0 * k / n if n else 100.0
        lines.append(f"{name:<{width}} {n:>7} {k:>7} {pct:>5.1f}%")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path, help="the instrumented build folder")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    py, native = python_by_module(), native_by_folder(args.build)
    print(table("pycollectives/", py))
    print()
    print(table("csrc/", native))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": py, "native": native}, f, indent=1)


if __name__ == "__main__":
    main()
