"""The benchmark CLI: parsing, formulas, the table, -c, JSON and the plot."""

import json
import re

import pytest
from mpi_harness import run_mpi

from pycollectives.bench import formulas as F
from pycollectives.bench import report
from pycollectives.bench.cli import parse_args


def test_sizes_and_suffixes():
    assert [F.parse_size(s) for s in ("8", "64K", "16M", "1G", "2kb")] == [
        8,
        65536,
        16 << 20,
        1 << 30,
        2048,
    ]
    assert F.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert F.sizes(1000, 5000, 3) == [1000, 3000]
    with pytest.raises(ValueError):
        F.parse_size("lots")


@pytest.mark.parametrize(
    "argv",
    [
        ["-b", "huge"],
        ["-b", "1M", "-e", "1K"],
        ["-f", "1"],
        ["-o", "avg", "-d", "int32"],
        ["--compare", "carrier"],
        ["reduce_gather"],
        ["-n", "0"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_parse_defaults_and_options():
    a = parse_args(
        [
            "all_gather",
            "-b",
            "1K",
            "-e",
            "1M",
            "-f",
            "4",
            "-c",
            "1",
            "--compare",
            "mpi,gloo",
            "-d",
            "float16",
            "--algo",
            "ring",
        ]
    )
    assert (a.collective, a.minbytes, a.maxbytes, a.stepfactor, a.check) == (
        "all_gather",
        1024,
        1 << 20,
        4.0,
        1,
    )
    assert a.compare == ["mpi", "gloo"] and a.datatype == "float16" and a.algo == "ring"


def test_busbw_formulas_by_hand():
    # 1e6 bytes in 1 ms = 1 GB/s algbw.
    assert F.algbw(10**6, 1e-3) == pytest.approx(1.0)
    assert F.busbw("all_reduce", 4, 10**6, 1e-3) == pytest.approx(1.5)  # 2(n-1)/n
    assert F.busbw("all_gather", 4, 10**6, 1e-3) == pytest.approx(0.75)  # (n-1)/n
    assert F.busbw("reduce_scatter", 2, 10**6, 1e-3) == pytest.approx(0.5)
    assert F.busbw("broadcast", 8, 10**6, 1e-3) == pytest.approx(1.0)
    assert F.busbw("reduce", 8, 10**6, 1e-3) == pytest.approx(1.0)
    assert F.bound_traffic("all_reduce", 100, 4) == 200
    assert F.bound_traffic("reduce", 100, 4) == 500
    assert F.bound_traffic("all_gather", 100, 4) == 125
    # 2 GB of traffic at 1 GB/s copy bandwidth (2 GB/s of traffic): 1 s.
    assert F.bound_time("all_reduce", 10**9, 2, 1.0) == pytest.approx(1.0)


def test_table_row_has_the_nccl_tests_columns():
    row = {
        "size": 1024,
        "count": 256,
        "type": "float32",
        "redop": "sum",
        "root": -1,
        "oop": {"time_us": 3.5, "algbw": 0.29, "busbw": 0.29, "wrong": 0},
        "ip": {"time_us": 3.1, "algbw": 0.33, "busbw": 0.33, "wrong": 2},
    }
    cols = report.table_row(row).split()
    assert cols == [
        "1024",
        "256",
        "float32",
        "sum",
        "-1",
        "3.50",
        "0.29",
        "0.29",
        "0",
        "3.10",
        "0.33",
        "0.33",
        "2",
    ]
    assert "FAILED" in report.footer([row]) and "2" in report.footer([row])


ROW = re.compile(
    r"^\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
    r"\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$",
    re.M,
)


def bench(tmp_path, *extra, env=None, returncodes=(0,)):
    out = tmp_path / "rows.json"
    stdout = run_mpi(
        2,
        "run_module.py",
        "pycollectives.bench",
        "all_reduce",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "-c",
        "1",
        "--json",
        str(out),
        *extra,
        env=env,
        returncodes=returncodes,
        timeout=120,
    )
    return stdout, json.loads(out.read_text())


def test_json_matches_the_table_and_check_passes(tmp_path):
    stdout, data = bench(tmp_path, "--compare", "mpi")
    rows = ROW.findall(stdout)
    assert len(rows) == len(data["rows"]) == 5  # 8, 64, 512, 4K, 32K
    for printed, r in zip(rows, data["rows"]):
        assert int(printed[0]) == r["size"] and int(printed[1]) == r["count"]
        assert float(printed[5]) == pytest.approx(r["oop"]["time_us"], abs=0.006)
        assert float(printed[7]) == pytest.approx(r["oop"]["busbw"], abs=0.006)
        assert int(printed[8]) == r["oop"]["wrong"] == 0
        assert "ratio" in r["compare"]["mpi"]
    assert "Out of bounds values : 0 OK" in stdout
    assert data["meta"]["ranks"] == 2


def test_check_counts_a_planted_wrong_element(tmp_path):
    stdout, data = bench(tmp_path, env={"PYCOLL_BENCH_CORRUPT": "1"}, returncodes=(1,))
    assert all(r["oop"]["wrong"] >= 1 and r["ip"]["wrong"] >= 1 for r in data["rows"])
    assert "FAILED" in stdout


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    bench(tmp_path, "--compare", "mpi", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
