"""The benchmark CLI: parsing, formulas, the table, -c, JSON and the plot."""

import importlib.util
import json
import os
import re

import pytest
from harness.launch import run_mpi

from pycollectives.bench import cli
from pycollectives.bench import formulas as F
from pycollectives.ops import ALGORITHMS_FOR

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
    # Peers' results are checked the same way, and a wrong one is marked in their column
    # (after its ratio and its share of the bound).
    assert all(r["compare"]["mpi"]["wrong"] >= 1 for r in data["rows"])
    marked = [line for line in stdout.splitlines() if re.search(r"x +\S+% WRONG$", line)]
    assert len(marked) == len(data["rows"]), stdout


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


@pytest.mark.skipif(not _installed("torch"), reason="torch not installed")
def test_gloo_peer_is_checked_against_numpy(tmp_path):
    stdout, data = bench(tmp_path, "-e", "64K", "-f", "64", "--compare", "gloo", coll="all")
    ran = {r["collective"] for r in data["rows"] if "ratio" in r["compare"]["gloo"]}
    assert {"all_reduce", "all_gather", "broadcast", "reduce", "all_to_all", "gather"} <= ran, ran
    assert all(r["compare"]["gloo"].get("wrong", 0) == 0 for r in data["rows"])
    for r in data["rows"]:
        if r["collective"] not in ran:  # gloo has no reduce-scatter: said so, not timed
            assert r["compare"]["gloo"]["skipped"], r
    assert "gloo" in data["meta"]["peers"]["gloo"]


@pytest.mark.skipif(not _installed("deepspeed", "torch"), reason="deepspeed not installed")
def test_deepspeed_peer_runs_its_shared_memory_all_reduce(tmp_path):
    # make test builds DeepSpeed's op ahead (the Makefile's .peer-ops); without that the first
    # run builds it (about a minute on 2 cores), later runs load it.
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


def _bench_can_use_cuda() -> bool:
    from pycollectives.backends.cuda import cuda_available

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
    from pycollectives.backends.cuda import cuda_available

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


def run_cuda_sweep(module: str, out, *options: str, **kw) -> tuple[str, dict]:
    """`module` (pycoll-bench, or a script that runs it) on 2 ranks: every collective on CUDA
    arrays against NCCL and host-staged MPI, with `options` (sizes, iterations); its stdout
    and the JSON it wrote to `out`."""
    compare = ("all", "--device", "cuda", "--compare", "nccl,mpi")
    stdout = run_mpi(2, "run_module.py", module, *compare, *options, "--json", str(out), **kw)
    return stdout, json.loads(out.read_text())


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
    sweep = ("-b", "64", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "-c", "1", "-d", "int32")
    stdout, data = run_cuda_sweep("fake_gpu_bench", out, *sweep, env=env, timeout=120)
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
    from pycollectives.backends.cuda import cuda_status

    state, why = cuda_status()
    if state == "broken":
        pytest.fail(f"a GPU is present but CUDA cannot use it: {why}", pytrace=False)
    if not _bench_can_use_cuda():
        pytest.skip(why or "cupy is not installed")
    out = tmp_path / "rows.json"
    sweep = ("-b", "8", "-e", "4M", "-f", "64", "-n", "5", "-w", "2", "-c", "1")
    stdout, data = run_cuda_sweep("pycollectives.bench", out, *sweep, timeout=300)
    rows = data["rows"]
    assert {r["collective"] for r in rows} == set(F.collectives_for("cuda"))
    assert all(r["oop"]["wrong"] == r["ip"]["wrong"] == 0 for r in rows)
    assert all(r["oop"]["time_us"] > 0 and r["bound"]["time_us"] > 0 for r in rows)
    assert all("ratio" in r["compare"]["mpi"] for r in rows)
    assert all(set(r["compare"]["nccl"]) & {"ratio", "skipped"} for r in rows)
    assert data["meta"]["cuda_sync"] in ("kernel", "stepped") and data["meta"]["copy_bw_GBs"] > 0
    assert "Out of bounds values : 0 OK" in stdout


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


def test_forced_algorithms_beside_the_automatic_choice(tmp_path):
    # --compare ring,tree,direct: each algorithm forced and checked (-c 1) beside auto, then,
    # for the collectives with a choice, per size the fastest, auto's choice, the shipped
    # table's and the model's, each against the fastest, and how often each is within 10%.
    stdout, data = bench(tmp_path, "-e", "4K", "--compare", "ring,tree,direct", coll="all")
    for r in data["rows"]:
        coll = r["collective"]
        for name in ("ring", "tree", "direct"):
            entry = r["compare"][name]
            have = name in ALGORITHMS_FOR.get(coll, ())
            assert ("ratio" in entry) == have and entry.get("wrong", 0) == 0, (coll, name, entry)
            if not have:
                assert entry["skipped"] == f"{coll} has no {name}"
    chosen = [r for r in data["rows"] if len(ALGORITHMS_FOR.get(r["collective"], ())) > 1]
    tables = stdout.split("# the algorithm each size gets")[1:]
    assert len(tables) == len({r["collective"] for r in chosen}), stdout
    algo = r"(ring|tree|direct)\s+([\d.]+)"
    picked = re.findall(
        rf"^\s+(\d+)\s+(ring|tree|direct)\s+{algo}\s+{algo}\s+{algo}$", stdout, re.M
    )
    assert len(picked) == len(chosen) > 0, stdout
    assert all(float(r) >= 1.0 for p in picked for r in p[3::2]), picked
    sizes = len(chosen) // len(tables)
    near = re.findall(rf"# within 10% of the fastest: auto \d+/{sizes}, shipped \d+/{sizes}, "
                      rf"model \d+/{sizes}$", stdout, re.M)  # fmt: skip
    assert len(near) == len(tables), stdout
