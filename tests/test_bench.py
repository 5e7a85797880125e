"""The benchmark CLI: parsing, formulas, the table, -c, JSON and the plot."""

import importlib.util
import json
import os
import re

import pytest
from mpi_harness import run_mpi

from pycollectives.bench import cli, report
from pycollectives.bench import formulas as F
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
    r"\s+(\d+)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+(\d+)$",  # nan: no in-place form
    re.M,
)


def bench(tmp_path, *extra, coll="all_reduce", env=None, returncodes=(0,), timeout=120):
    out = tmp_path / "rows.json"
    stdout = run_mpi(
        2,
        "run_module.py",
        "pycollectives.bench",
        coll,
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
        timeout=timeout,
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
        mpi = r["compare"]["mpi"]  # against ours timed again beside the peer
        assert mpi["ours_us"] > 0 and mpi["ratio"] == pytest.approx(mpi["time_us"] / mpi["ours_us"])
    assert "Out of bounds values : 0 OK" in stdout
    assert data["meta"]["ranks"] == 2


def test_check_counts_a_planted_wrong_element(tmp_path):
    stdout, data = bench(
        tmp_path, "--compare", "mpi", env={"PYCOLL_BENCH_CORRUPT": "1"}, returncodes=(1,)
    )
    assert all(r["oop"]["wrong"] >= 1 and r["ip"]["wrong"] >= 1 for r in data["rows"])
    assert "FAILED" in stdout
    # Peers' results are checked the same way, and a wrong one is marked in their column.
    assert all(r["compare"]["mpi"]["wrong"] >= 1 for r in data["rows"])
    assert stdout.count("x WRONG") == len(data["rows"])


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


def test_rounds_run_end_to_end(tmp_path):
    stdout, data = bench(tmp_path, "--compare", "mpi", "--rounds", "2")
    assert "best of 2 rounds" in stdout and data["meta"]["args"]["rounds"] == 2
    assert len(ROW.findall(stdout)) == len(data["rows"]) == 5
    assert all(r["compare"]["mpi"]["wrong"] == 0 for r in data["rows"])


def test_time_per_size_runs_short_calls_more_often(tmp_path):
    # -n 3, but every size timed for 20 ms: microsecond calls run hundreds of times, for ours
    # and the peer alike, never past the cap. The pace is the median of 5 warm-up calls: a
    # single one, descheduled on a loaded machine, once made the peer run 54 calls.
    stdout, data = bench(tmp_path, "--compare", "mpi", "-T", "0.02", "-w", "5")
    assert "each size timed for at least 0.02 s" in stdout
    small = data["rows"][0]
    for entry in (small["oop"], small["ip"], small["compare"]["mpi"]):
        assert 100 < entry["iters"] <= cli.MAX_ITERS, entry
    assert all(r["oop"]["wrong"] == 0 for r in data["rows"])
    _, plain = bench(tmp_path)
    assert {r["oop"]["iters"] for r in plain["rows"]} == {3}


def test_shared_buffers_run_checked_for_ours_and_the_peer(tmp_path):
    env = {"PYCOLL_DEBUG": "INFO", "PYCOLL_SHARED_BYTES": "0"}
    stdout, data = bench(tmp_path, "--shared", "--compare", "mpi", env=env)
    assert "buffers from Communicator.empty" in stdout and data["meta"]["args"]["shared"]
    assert all(r["oop"]["wrong"] == r["compare"]["mpi"]["wrong"] == 0 for r in data["rows"])


def test_comparison_reports_the_fraction_of_the_bound():
    row = {
        "size": 1 << 20,
        "oop": {"time_us": 200.0},
        "bound": {"time_us": 150.0},
        "compare": {"mpi": {"ratio": 2.0, "wrong": 0}, "gloo": {"skipped": "no gloo"}},
    }
    text = report.comparison([row], ["mpi", "gloo"], 10.0)
    line = next(x for x in text.splitlines() if x.split()[:1] == [str(1 << 20)])
    assert line.split() == [str(1 << 20), "200.00", "150.00", "75%", "2.00x", "n/a"]
    assert "# gloo: no gloo" in text


def _spinners():
    """Pids of processes running contention.SPIN."""
    from pycollectives.bench.contention import SPIN

    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if SPIN.encode() in f.read():
                    pids.append(int(d))
        except OSError:
            pass
    return pids


def test_contention_runs_busy_processes_and_leaves_none(tmp_path):
    stdout, data = bench(tmp_path, "-e", "64", "--contention", "--compare", "mpi")
    assert "2 busy processes beside the ranks" in stdout or "busy processes beside" in stdout
    assert data["meta"]["args"]["contention"] is True
    assert all(r["oop"]["wrong"] == 0 and r["compare"]["mpi"]["wrong"] == 0 for r in data["rows"])
    assert _spinners() == []


ORPHAN = """
import sys, time
from pycollectives.bench.contention import Contention
class One:  # a single rank, no MPI
    rank = 0
    def Barrier(self):
        pass
busy = Contention(One(), 2).__enter__()
print(*[p.pid for p in busy.procs], flush=True)
time.sleep(60)
"""


def test_contention_processes_die_with_their_rank():
    import signal
    import subprocess
    import sys
    import time

    rank = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in rank.stdout.readline().split()]
    assert len(pids) == 2 and sorted(_spinners()) == sorted(pids)
    rank.send_signal(signal.SIGKILL)  # no __exit__: the kernel must end them
    rank.wait()
    deadline = time.monotonic() + 10
    while _spinners() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _spinners() == []


# -- oneCCL and DeepSpeed as peers --------------------------------------------------------------


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


def test_peers_that_cannot_run_say_why_in_their_column(tmp_path):
    # An empty prefix for oneCCL's packages and a DeepSpeed that cannot be imported.
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("raise ImportError('no deepspeed')\n")
    env = {"PYTHONPATH": str(tmp_path), "PYCOLL_ONECCL_PREFIX": str(tmp_path / "none")}
    stdout, data = bench(tmp_path, "-e", "64", "--compare", "oneccl,deepspeed", env=env)
    for r in data["rows"]:
        assert "not installed" in r["compare"]["oneccl"]["skipped"]
        assert "no deepspeed" in r["compare"]["deepspeed"]["skipped"]
    assert "# oneccl: not installed: oneccl-cpu-devel" in stdout


def _installed(*modules):
    return all(importlib.util.find_spec(m) for m in modules)


def _oneccl_installed():
    from pycollectives.bench import oneccl

    try:
        oneccl.locate()
        return True
    except oneccl.Unusable:
        return False


@pytest.mark.skipif(
    not _oneccl_installed(), reason="oneCCL packages not installed (make test does)"
)
def test_oneccl_peer_is_checked_against_numpy(tmp_path):
    stdout, data = bench(tmp_path, "-e", "64K", "-f", "64", "--compare", "oneccl", coll="all")
    ran = {r["collective"] for r in data["rows"] if "ratio" in r["compare"]["oneccl"]}
    assert {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"} <= ran
    assert all(r["compare"]["oneccl"].get("wrong", 0) == 0 for r in data["rows"])
    assert "oneCCL 2022" in data["meta"]["peers"]["oneccl"]


@pytest.mark.skipif(not _installed("deepspeed", "torch"), reason="deepspeed not installed")
def test_deepspeed_peer_runs_its_shared_memory_all_reduce(tmp_path):
    # The first run builds DeepSpeed's op (about a minute on 2 cores); later runs load it.
    stdout, data = bench(tmp_path, "-e", "1M", "-f", "32", "--compare", "deepspeed", timeout=400)
    what = data["meta"]["peers"]["deepspeed"]
    assert "shm all-reduce (deepspeed_shm_comm) active" in what, what
    assert all(r["compare"]["deepspeed"]["wrong"] == 0 for r in data["rows"])
    assert all("ratio" in r["compare"]["deepspeed"] for r in data["rows"])


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    bench(tmp_path, "--compare", "mpi", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- --device cuda ----------------------------------------------------------------------------


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


def _bench_can_use_cuda() -> bool:
    from pycollectives.cuda import cuda_available

    return cuda_available()[0] and importlib.util.find_spec("cupy") is not None


def test_cuda_without_a_usable_gpu_fails_with_one_line(tmp_path):
    if _bench_can_use_cuda():
        pytest.skip("CUDA and cupy are usable here (test_cuda_on_a_gpu runs instead)")
    out = tmp_path / "rows.json"
    stdout, stderr = run_mpi(
        2,
        "run_module.py",
        "pycollectives.bench",
        "--device",
        "cuda",
        "--compare",
        "nccl,mpi",
        "-e",
        "64K",
        "--json",
        str(out),
        with_stderr=True,
        returncodes=(2,),
        timeout=120,
    )
    said = [ln for ln in (stdout + stderr).splitlines() if ln.strip()]
    assert "Traceback" not in stdout + stderr
    assert len(said) == 1, said  # rank 0 says it, once
    assert said[0].startswith("pycoll-bench: --device cuda cannot run: ranks 0, 1: ")
    from pycollectives.cuda import cuda_available

    ok, why = cuda_available()
    assert (why if not ok else "cupy is not installed") in said[0]
    assert not out.exists()  # refused before anything ran


# A stand-in for cupy whose "device" arrays are numpy arrays (the communicator then takes its
# host path): it runs --device cuda's plumbing without a GPU: buffers made, filled and read
# back through cupy's calls, timing with stream synchronisation, the copy bound, host-staged
# MPI, NCCL's refusal where cupy has no NCCL, and the report.
FAKE_CUPY = """
import numpy as np

__version__ = "0.0-fake"
float32, uint8 = np.float32, np.uint8


class _Pointer:
    def __init__(self, a):
        self.a = a
        self.ptr = a.__array_interface__["data"][0]

    def copy_from_device(self, src, size):
        self.a.view(np.uint8)[:size] = src.a.view(np.uint8)[:size]


class ndarray(np.ndarray):
    @property
    def data(self):
        return _Pointer(self)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            return np.array(self)
        out[...] = self
        return out

    def set(self, arr, stream=None):
        assert isinstance(arr, np.ndarray) and arr.shape == self.shape, (arr, self.shape)
        self[...] = arr


def empty(n, dtype=float):
    return np.empty(n, np.dtype(dtype)).view(ndarray)


def ones(n, dtype=float):
    return np.ones(n, np.dtype(dtype)).view(ndarray)


def asnumpy(a):
    return np.array(a)


class _Pool:
    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


from cupy import cuda  # noqa: E402
"""

FAKE_CUPY_CUDA = """
import types

syncs = []


class Device:
    def __init__(self, i):
        self.id = i

    def use(self):
        pass


class _Stream:
    ptr = 0

    def synchronize(self):
        syncs.append(1)


def get_current_stream():
    return _Stream()


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    getDeviceProperties=lambda i: {"name": b"Fake GPU"},
    memGetInfo=lambda: (64 << 20, 80 << 30),
    deviceSynchronize=lambda: None,
)
"""

FAKE_CUPY_NCCL = "available = False\n"

FAKE_RUN = """
import sys

import pycollectives.bench.gpu as gpu
from pycollectives.bench.main import main

gpu.cuda_status = lambda: ("ok", "")  # the fake GPU is usable

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    from cupy.cuda import syncs

    print(f"stream synchronisations: {len(syncs)}")
    sys.exit(rc)
"""


def test_cuda_plumbing_with_a_fake_cupy(tmp_path):
    fake = tmp_path / "fake"
    (fake / "cupy" / "cuda").mkdir(parents=True)
    (fake / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    (fake / "cupy" / "cuda" / "__init__.py").write_text(FAKE_CUPY_CUDA)
    (fake / "cupy" / "cuda" / "nccl.py").write_text(FAKE_CUPY_NCCL)
    (fake / "fake_gpu_bench.py").write_text(FAKE_RUN)
    out = tmp_path / "rows.json"
    paths = [str(fake), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    stdout = run_mpi(
        2,
        "run_module.py",
        "fake_gpu_bench",
        "all",
        "--device",
        "cuda",
        "--compare",
        "nccl,mpi",
        "-b",
        "64",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "-c",
        "1",
        "-d",
        "int32",
        "--json",
        str(out),
        env=env,
        timeout=120,
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    cuda = F.collectives_for("cuda")
    assert {r["collective"] for r in rows} == set(cuda)
    assert len(ROW.findall(stdout)) == len(rows) == 3 * len(cuda)  # 64 B, 512 B, 4K
    assert all(r["oop"]["wrong"] == r["ip"]["wrong"] == 0 for r in rows)
    assert all("ratio" in r["compare"]["mpi"] for r in rows)  # host-staged MPI ran
    nccl = {r["compare"]["nccl"]["skipped"] for r in rows}
    assert len(nccl) == 1 and "cupy 0.0-fake found no NCCL library" in nccl.pop()
    meta = data["meta"]
    assert meta["gpus"] == ["Fake GPU"] and meta["devices"] == [0, 0]
    assert meta["copy_bw_GBs"] > 0 and meta["peers"]["nccl"].startswith("cupy 0.0-fake")
    assert "GPU memory copy bandwidth per rank" in stdout
    assert "# mpi: mpi4py through host memory" in stdout
    assert "Out of bounds values : 0 OK" in stdout
    syncs = int(re.search(r"stream synchronisations: (\d+)", stdout).group(1))
    assert syncs >= 2 * len(rows) * 2  # ours (out of place, in place): after warm-up and timing


@pytest.mark.gpu
def test_cuda_on_a_gpu(tmp_path):
    """The real thing (``make gpu-test``): every collective on cupy arrays, checked, against
    NCCL (or NCCL's reason for not running) and host-staged MPI."""
    from pycollectives.cuda import cuda_status

    state, why = cuda_status()
    if state == "broken":
        pytest.fail(f"a GPU is present but CUDA cannot use it: {why}", pytrace=False)
    if not _bench_can_use_cuda():
        pytest.skip(why or "cupy is not installed")
    out = tmp_path / "rows.json"
    stdout = run_mpi(
        2,
        "run_module.py",
        "pycollectives.bench",
        "all",
        "--device",
        "cuda",
        "--compare",
        "nccl,mpi",
        "-b",
        "8",
        "-e",
        "4M",
        "-f",
        "64",
        "-n",
        "5",
        "-w",
        "2",
        "-c",
        "1",
        "--json",
        str(out),
        timeout=300,
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["collective"] for r in rows} == set(F.collectives_for("cuda"))
    assert all(r["oop"]["wrong"] == r["ip"]["wrong"] == 0 for r in rows)
    assert all(r["oop"]["time_us"] > 0 and r["bound"]["time_us"] > 0 for r in rows)
    assert all("ratio" in r["compare"]["mpi"] for r in rows)
    assert all(set(r["compare"]["nccl"]) & {"ratio", "skipped"} for r in rows)
    assert data["meta"]["cuda_sync"] in ("kernel", "host") and data["meta"]["copy_bw_GBs"] > 0
    assert "Out of bounds values : 0 OK" in stdout


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


def test_a_failure_on_one_rank_ends_the_job(tmp_path):
    # torch raising on rank 1 only, when the gloo peer opens: before, rank 1 left with a
    # traceback while rank 0 waited for it in its next MPI call, and the sweep hung.
    # Rank 0 gets a torch whose gloo sets up at once and then waits for rank 1 to agree.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import os\n"
        "if os.environ.get('PMI_RANK') == '1':\n"
        "    raise RuntimeError('planted failure on rank 1')\n"
        "__version__ = 'fake'\n"
    )
    (fake / "distributed.py").write_text(
        "def is_gloo_available():\n    return True\n"
        "def init_process_group(*args, **kwargs):\n    pass\n"
        "def destroy_process_group():\n    pass\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    out = tmp_path / "rows.json"
    stdout, stderr = run_mpi(
        2,
        "run_module.py",
        "pycollectives.bench",
        "-e",
        "64",
        "--compare",
        "gloo",
        "--json",
        str(out),
        env=env,
        with_stderr=True,
        returncodes=tuple(range(1, 256)),
        timeout=60,
    )
    assert "planted failure on rank 1" in stderr
    assert not out.exists()
