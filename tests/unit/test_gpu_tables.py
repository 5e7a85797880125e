"""The performance page's GPU tables come from the kit's result files
(benchmarks/gpu_tables.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.unit import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def load():
    return load_benchmark("gpu_tables")


def test_the_page_tables_match_their_files():
    assert load().main(["--check"]) == 0


def test_a_row_typed_by_hand_is_found():
    t = load()
    page = (ROOT / "docs/performance.md").read_text()
    tampered = page.replace("| 83.2 GB/s | 7.8% |", "| 93.2 GB/s | 7.8% |", 1)
    assert tampered != page
    assert t.rewrite(tampered, t.tables()) == page


def test_times_as_the_tables_write_them():
    # Hand-worked: below 100 µs one decimal, below 1 ms whole µs, then 3 significant figures
    # in ms, whole ms from 100 ms.
    t = load()
    cases = {32.2: "32.2 µs", 683.7: "684 µs", 1613.6: "1.61 ms", 51454.9: "51.5 ms",
             102400.4: "102 ms", 178821.1: "179 ms"}  # fmt: skip
    for value, text in cases.items():
        assert t.us(value) == text, (value, t.us(value))
    assert t.pair(32.2, 20.1) == "32.2 / 20.1 µs"
    assert t.pair(27.7, 102400.4) == "27.7 µs / 102 ms"


def test_the_rows_read_the_right_columns(tmp_path):
    t = load()
    f = t.parse(ROOT / "benchmarks/results/gpu_bench-h200-2ranks-host.txt")
    assert (f.ranks, f.sync, f.mps, f.commit) == (2, "stepped", False, "c77d9ff")  # "host" there
    row = f.all_reduce[128 << 20]
    # 134217728: sync 50335.1, b2b 51454.9, busbw 2.61, staged 104091.2, of bound 0.3%
    assert (row["sync us"], row["b2b us"], row["busbw"]) == (50335.1, 51454.9, 2.61)
    assert (row["staged us"], row["of bound"]) == (104091.2, 0.3)
    bad = tmp_path / "gpu_bench-x.txt"
    bad.write_text("## all_reduce float32\n")
    with pytest.raises(ValueError, match="GPU and driver"):
        t.parse(bad)
