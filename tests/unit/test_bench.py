"""The benchmark CLI in one process: parsing, busbw formulas, the table, rounds, the bound,
and the peers' set-up."""

import importlib.util
import math
import re
from pathlib import Path

import pytest

from pycollectives.bench import formulas as F
from pycollectives.bench import report
from pycollectives.bench.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]


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
        ["--rounds", "0"],
        ["-T", "-1"],
        ["-T", "0.1", "-w", "0"],
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


def test_gpu_bound_by_hand():
    """Two ranks share a GPU whose copies move 4 TB/s of traffic (read + write), so each rank,
    copying while the other does, gets 1000 GB/s of copy bandwidth (2 TB/s of traffic). A
    128 MiB all-reduce: one rank reads 128 MiB and writes 128 MiB, 268435456 B at 2e12 B/s =
    134.2 us; the same as both ranks' 536870912 B over the whole GPU's 4e12 B/s. (gpu_bench
    once divided both ranks' traffic by one rank's share: 268.4 us, n times too lenient.)"""
    mib128 = 128 << 20
    assert F.bound_traffic("all_reduce", mib128, 2) == 268435456
    assert F.bound_time("all_reduce", mib128, 2, 1000.0) == pytest.approx(134.217728e-6)
    assert F.bound_time("all_reduce", mib128, 2, 1000.0) == pytest.approx(2 * 2 * mib128 / 4e12)
    # All-gather of 64 MiB gathered on 4 ranks sharing the GPU (500 GB/s copy each): one rank
    # writes 64 MiB and reads its own 16 MiB, 83886080 B at 1e12 B/s of traffic = 83.9 us.
    assert F.bound_time("all_gather", 64 << 20, 4, 500.0) == pytest.approx(83.88608e-6)


def test_gpu_bench_ratios_by_hand():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from pycollectives.bench.gpu import Floors

    row = {"size": 128 << 20, "sync": 2e-3, "b2b": 1.34217728e-3, "staged": 0.1,
           "nccl": float("nan")}  # fmt: skip
    got = bench.derived("all_reduce", row, 2, 1000.0, Floors(10e-6, 3e-6, 5e-6))
    assert got["bound"] == pytest.approx(134.217728e-6)
    assert got["of_bound"] == pytest.approx(0.1)  # bound / back-to-back time
    assert got["x_floor"] == pytest.approx(200)  # synchronised call / launch+sync floor
    assert got["staged_ratio"] == pytest.approx(50)
    assert math.isnan(got["nccl_ratio"])
    # busbw, nccl-tests' way: 128 MiB / 1.342 ms = 100 GB/s algbw, x 2(n-1)/n = 1 for 2 ranks.
    assert got["busbw"] == pytest.approx(100.0)
    assert bench.counts("all_gather", 64 << 20, 4) == (4 << 20, 16 << 20)
    assert bench.counts("all_reduce", 8, 4) == (2, 2)
    # Reduce-scatter of 64 MiB on 4 ranks: each gives all 16 Mi elements, gets its 4 Mi; one
    # rank reads 64 MiB and writes its 16 MiB, 83886080 B, as all-gather's mirror.
    assert bench.counts("reduce_scatter", 64 << 20, 4) == (16 << 20, 4 << 20)
    assert F.bound_time("reduce_scatter", 64 << 20, 4, 500.0) == pytest.approx(83.88608e-6)


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


def test_rounds_keep_each_sizes_best_time_for_ours_and_each_peer():
    from pycollectives.bench.main import best_of

    nan = float("nan")

    def row(size, oop, ip, peer, beside, wrong=0):
        return {
            "size": size,
            "oop": {"time_us": oop, "wrong": wrong},
            "ip": {"time_us": ip, "wrong": 0},
            "compare": {
                "mpi": {"time_us": peer, "ours_us": beside, "wrong": wrong},
                "x": {"skipped": "why"},
            },
        }

    a = {"all_reduce": [row(8, 5.0, 4.0, 9.0, 3.5), row(64, 7.0, nan, 6.0, 9.0, wrong=1)]}
    b = {"all_reduce": [row(8, 3.0, 6.0, 12.0, 2.0), row(64, 8.0, nan, 4.0, 8.0)]}
    small, large = best_of([a, b])["all_reduce"]
    assert (small["oop"]["time_us"], small["ip"]["time_us"]) == (3.0, 4.0)
    assert small["compare"]["mpi"]["time_us"] == 9.0
    # The peer's best against the best of ours timed beside it, not against our row's time.
    assert small["compare"]["mpi"]["ours_us"] == 2.0
    assert small["compare"]["mpi"]["ratio"] == pytest.approx(4.5)
    assert large["oop"]["time_us"] == 7.0 and large["oop"]["wrong"] == 1  # every round's count
    assert large["compare"]["mpi"]["ratio"] == pytest.approx(4.0 / 8.0)
    assert large["compare"]["mpi"]["wrong"] == 1
    assert small["compare"]["x"] == {"skipped": "why"}
    assert a["all_reduce"][0]["oop"]["time_us"] == 5.0  # the rounds are left as they were


def test_comparison_reports_the_fraction_of_the_bound():
    # Ours: bound 150 us / 200 us = 75%. MPI: 2.0x ours re-timed, its own 600 us = 25% of the
    # bound; oneCCL at 30000 us: under 1%.
    row = {
        "size": 1 << 20,
        "oop": {"time_us": 200.0},
        "bound": {"time_us": 150.0},
        "compare": {
            "mpi": {"ratio": 2.0, "wrong": 0, "time_us": 600.0},
            "oneccl": {"ratio": 150.0, "wrong": 0, "time_us": 30000.0},
            "gloo": {"skipped": "no gloo"},
        },
    }
    text = report.comparison([row], ["mpi", "oneccl", "gloo"], 10.0)
    line = next(x for x in text.splitlines() if x.split()[:1] == [str(1 << 20)])
    assert line.split() == [
        str(1 << 20), "200.00", "150.00", "75%", "2.00x", "25%", "150.00x", "<1%", "n/a"
    ]  # fmt: skip
    assert "# gloo: no gloo" in text


def test_oneccl_says_which_packages_are_missing(tmp_path):
    from pycollectives.bench import oneccl

    with pytest.raises(oneccl.Unusable) as e:
        oneccl.locate(str(tmp_path))
    msg = str(e.value)
    assert "oneccl-cpu-devel" in msg and "oneccl-cpu " in msg and "intel-cmplr-lib-rt" in msg
    (tmp_path / "include" / "oneapi").mkdir(parents=True)
    (tmp_path / "include" / "oneapi" / "ccl.hpp").write_text("")
    with pytest.raises(oneccl.Unusable) as e:
        oneccl.locate(str(tmp_path))
    assert "oneccl-cpu-devel" not in str(e.value)


def test_cuda_device_and_nccl_are_accepted():
    a = parse_args(["--device", "cuda", "--compare", "nccl,mpi", "-d", "float16"])
    assert (a.device, a.compare, a.datatype) == ("cuda", ["nccl", "mpi"], "float16")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--compare", "nccl"], "--compare nccl needs --device cuda"),
        (["--device", "cpu", "--compare", "mpi,nccl"], "--compare nccl needs --device cuda"),
        (["--device", "cuda", "--compare", "gloo"], "--compare gloo runs on host arrays"),
        (["--device", "cuda", "--compare", "oneccl"], "--compare oneccl runs on host arrays"),
        (["--device", "cuda", "--compare", "deepspeed"], "runs on host arrays"),
    ],
)
def test_peers_for_the_other_device_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and says in err


class OneRank:
    """Just enough of an mpi4py communicator for one rank."""

    rank, size = 0, 1

    def bcast(self, v):
        return v

    def allgather(self, v):
        return [v]

    def Barrier(self):
        pass


@pytest.mark.parametrize("failures, ok", [(1, True), (3, False)])
def test_gloo_set_up_is_tried_again_after_a_failed_mesh(monkeypatch, failures, ok):
    # Gloo's mesh set-up failed once in a sweep, right after the previous round's group had
    # closed ("Connection closed by peer"), and took the whole sweep down.
    dist = pytest.importorskip("torch.distributed")
    from pycollectives.bench import peers

    tried = []

    def init(backend, init_method, rank, world_size):
        tried.append(init_method)
        if len(tried) <= failures:
            raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    g = peers.Gloo(OneRank())
    assert len(tried) == min(failures + 1, 3) and len(set(tried)) == len(tried)
    if ok:
        assert g.reason is None and "gloo" in g.what
    else:
        assert "gloo set-up failed 3 times: Gloo connectFullMesh failed" in g.reason
        assert g.runner("all_reduce", "sum", 0, None) == g.reason


def test_gpu_python_cost_runs_without_a_gpu():
    """benchmarks/gpu_python_cost.py stands in for the native CUDA module and cupy: it runs
    (and so keeps running) on a machine without a GPU."""
    import subprocess
    import sys

    script = ROOT / "benchmarks" / "gpu_python_cost.py"
    proc = subprocess.run([sys.executable, str(script), "--calls", "200"], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for layer in ("Communicator", "CudaComm"):
        assert re.search(rf"^{layer} +[0-9.]+ us/call$", proc.stdout, re.M), proc.stdout


def test_a_cupy_call_crosses_into_native_code_once():
    """benchmarks/call_path.py: a blocking cupy all-reduce (cupy and the CUDA module stood in
    for, the device the emulated module's) takes the one-step path as a numpy one does: one
    Python frame of the package, one crossing into native code."""
    import subprocess
    import sys

    pytest.importorskip("pycollectives._emu")
    script = ROOT / "benchmarks" / "call_path.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for case in ("numpy all_reduce", "cupy all_reduce"):
        assert re.search(rf"^{case}.* 1 frames +1 crossings$", proc.stdout, re.M), proc.stdout


class SlowerPeer:
    """One rank's view of a 2-rank job whose other rank took `peer_s` seconds per call: a
    Barrier that counts itself, and allreduce(MAX) against the peer's figure."""

    def __init__(self, peer_s):
        self.peer_s, self.barriers = peer_s, 0

    def Barrier(self):
        self.barriers += 1

    def allreduce(self, value, op):
        return max(value, self.peer_s)


def test_per_call_times_back_to_back_calls_and_reports_the_slowest_rank():
    from pycollectives.bench.timing import per_call, time_back_to_back

    calls, synced = [], []
    mpi = SlowerPeer(peer_s=0.25)
    t = per_call(mpi, lambda: calls.append(1), 10, sync=lambda: synced.append(1), warmup=3)
    # 3 warm-up calls and 10 timed ones; the queue waited for after each batch; one barrier.
    assert (len(calls), len(synced), mpi.barriers) == (13, 2, 1)
    assert t == 0.25  # this rank's calls took microseconds: the slower peer's figure counts
    assert per_call(SlowerPeer(peer_s=0.0), lambda: None, 4) < 0.01
    assert time_back_to_back(SlowerPeer(peer_s=0.5), lambda: None, lambda: None, 4) == 0.5


def test_choices_by_hand():
    # Forced algorithms' times: ring 1.20, tree 1.50, direct 0.80 us at 4 KiB: direct is
    # fastest; auto picked ring (1.20 / 0.80 = 1.50 of the fastest) and the model direct
    # (1.00). At 1 MiB ring is fastest, auto ring (1.00), the model tree (1.30 / 1.00); a size
    # where nothing was measured is left out. The ratios to ours beside each (here all 1.0)
    # play no part.
    def row(size, **times):
        return {"collective": "all_reduce", "size": size,
                "compare": {n: {"ratio": 1.0, "time_us": v} for n, v in times.items()}}  # fmt: skip

    skipped = {"collective": "all_reduce", "size": 8, "compare": {"ring": {"skipped": "why"}}}
    rows = [row(4096, ring=1.2, tree=1.5, direct=0.8), row(1 << 20, ring=1.0, tree=1.3), skipped]
    asked = []

    def algorithm_for(coll, nbytes):
        asked.append((coll, nbytes))
        return "ring"

    model = {4096: "direct", 1 << 20: "tree"}
    text = report.choices(rows, ["ring", "tree", "direct"], algorithm_for, 2,
                          {"model": lambda c, size, n: model[size]})  # fmt: skip
    lines = [line.split() for line in text.splitlines() if not line.startswith("#")]
    assert lines == [["4096", "direct", "ring", "1.50", "direct", "1.00"],
                     ["1048576", "ring", "ring", "1.00", "tree", "1.30"]]  # fmt: skip
    # Within 10% of the fastest: auto at 1 MiB only (1.50, 1.00), the model at 4 KiB only.
    assert text.splitlines()[-1] == "# within 10% of the fastest: auto 1/2, model 1/2"
    assert asked == [("all_reduce", 4096), ("all_reduce", 1 << 20)]
    # The choice is asked for the bench's input (all-gather's is one rank's block); the model
    # takes one rank's block of all-gather and reduce-scatter.
    assert report._sizes("all_gather", 4096, 4) == (1024, 1024)
    assert report._sizes("reduce_scatter", 4096, 4) == (4096, 1024)
    assert report._sizes("all_reduce", 4096, 4) == (4096, 4096)
