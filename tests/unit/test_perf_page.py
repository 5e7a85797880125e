"""The performance page's tables come from the result files (benchmarks/perf_page.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness.unit import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"


def load():
    return load_benchmark("perf_page")


def test_the_page_matches_its_files():
    assert load().main(["--check"]) == 0


def test_every_table_has_its_block_and_every_block_a_table():
    on_page = re.findall(r"<!-- perf-table (\S+) -->", PAGE.read_text())
    assert sorted(on_page) == sorted(load().TABLES), on_page
    assert len(on_page) == len(set(on_page)), "a table's block appears twice"


def test_a_cell_typed_by_hand_is_found():
    t = load()
    page = PAGE.read_text()
    # The 64 KiB all-reduce against MPI_Allreduce (allreduce_vs_mpi-2ranks.json: 7.0915 µs).
    tampered = page.replace("| 64 KiB | 7.09 µs", "| 64 KiB | 6.09 µs", 1)
    assert tampered != page
    assert t.render(tampered) == page


def test_every_table_names_its_files_and_machine():
    t = load()
    for name, lines in t.tables().items():
        source = lines[-1]
        assert source.startswith("Made by `benchmarks/perf_page.py` from `"), (name, source)
        for f in re.findall(r"`([^`]+)`", source.split(" from ", 1)[1].split("; measured")[0]):
            assert (t.RESULTS / f).is_file(), (name, f)
        assert "; measured on " in source, (name, source)


def test_every_plot_is_on_the_page():
    page = PAGE.read_text()
    plots = sorted(p.name for p in (ROOT / "benchmarks/results").glob("*.png"))
    assert plots
    missing = [p for p in plots if f"](../benchmarks/results/{p})" not in page]
    assert not missing, missing


def test_numbers_as_the_page_writes_them():
    # Hand-worked: three significant figures, at most two decimals, whole numbers from 100;
    # ratios below 1 in bold with three decimals.
    t = load()
    assert [t.us(v) for v in (1.6954, 10.902, 181.56, 1239.23, 12196.04, 102400.4)] == [
        "1.70 µs", "10.9 µs", "182 µs", "1.24 ms", "12.2 ms", "102 ms",
    ]  # fmt: skip
    assert [t.ratio(v) for v in (2.1537, 261.58, 1320.54, 0.99795, 0.2486)] == [
        "2.15×", "262×", "1321×", "**0.998×**", "**0.249×**",
    ]  # fmt: skip
    assert [t.size(n) for n in (8, 4096, 65536, 1 << 20, 3 << 20, 1 << 30)] == [
        "8 B", "4 KiB", "64 KiB", "1 MiB", "3 MiB", "1 GiB",
    ]  # fmt: skip
    assert (t.percent(0.004), t.percent(0.5296), t.percent(1.6)) == ("<1%", "53%", "160%")


def test_a_missing_block_is_named(tmp_path):
    t = load()
    with pytest.raises(ValueError, match="allreduce-vs-mpi"):
        t.rewrite("# no tables\n", {"allreduce-vs-mpi": ["| a |"]})
