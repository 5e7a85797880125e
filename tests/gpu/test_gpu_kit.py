"""The GPU run kit (tools/gpu/), checked without a GPU: the scripts parse, run.sh refuses a
missing OUTDIR, each call's stage limits fit its share of the GPU time, a stage at its limit
ends with everything it started and the clean-up stops an MPS daemon it left, and git ignores
the wheels."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "tools" / "gpu"
SCRIPTS = ["run.sh", "fetch_wheels.sh", "stages.sh"]


def bash(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script):
    proc = bash("-n", str(KIT / script))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "args", [(), ("a", "b"), ("--dry-run",), ("--call", "third", "out"), ("--call",)]
)
def test_run_without_outdir_prints_usage(args):
    proc = bash(str(KIT / "run.sh"), *args)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr


@pytest.mark.parametrize(
    "call, stages, budget",
    [
        ("first", ["env", "build", "paths", "figures"], 300),
        ("second", ["env", "build", "bench-2", "bench-mps", "gpu"], 300),
        ("all", ["env", "build", "bench-2", "bench-mps", "train", "gpu"], 570),
    ],
)
def test_dry_run_fits_its_call(tmp_path, call, stages, budget):
    # A GPU comes with 15 minutes of machine time: each of the two calls fits 5 minutes,
    # limits plus grace; "all" (by hand) one 10-minute remote command.
    out = tmp_path / "out"
    args = () if call == "first" else ("--call", call)
    proc = bash(str(KIT / "run.sh"), "--dry-run", *args, str(out))
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()[:-1]] == stages
    total = int(re.search(r"^total\s+(\d+)s", proc.stdout, re.M).group(1))
    assert total <= budget, proc.stdout
    # Summary plus one log per stage: a remote runner brings back at most 8 files.
    assert len(stages) + 1 <= 8
    assert not out.exists()  # a dry run writes nothing


def test_second_call_runs_the_gpu_tests_the_first_did_not():
    first = bash(str(KIT / "run.sh"), "--dry-run", "/tmp/x").stdout
    second = bash(str(KIT / "run.sh"), "--dry-run", "--call", "second", "/tmp/x").stdout
    paths = re.search(r"^paths .* -k (.*)$", first, re.M).group(1)
    assert re.search(r"^gpu .* -k not \(" + re.escape(paths) + r"\)$", second, re.M), second


STAGES_SH = KIT / "stages.sh"


def test_stage_at_its_limit_ends_with_everything_it_started(tmp_path):
    # A stage's command whose child starts a grandchild (mpiexec's ranks) and runs over: the
    # whole session goes at the limit, not only the command `timeout` would have signalled.
    pids = tmp_path / "pids"
    script = f"""
        . {STAGES_SH}
        run_limited 1 1 bash -c 'sleep 300 & echo $! > {pids}; bash -c "sleep 300" & wait'
        echo "rc=$?"
    """
    start = time.monotonic()
    proc = bash("-c", script)
    assert proc.returncode == 0, proc.stderr
    assert "rc=124" in proc.stdout, proc.stdout
    assert time.monotonic() - start < 10
    pid = int(pids.read_text())
    time.sleep(0.2)
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )
    # A command that ends in time returns its status, and what it left running goes too.
    script = f"""
        . {STAGES_SH}
        run_limited 30 1 bash -c 'sleep 300 & echo $! > {pids}; exit 3'
        echo "rc=$?"
    """
    proc = bash("-c", script)
    assert "rc=3" in proc.stdout, proc.stdout
    time.sleep(0.2)
    pid = int(pids.read_text())
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


FAKE_MPS = r"""#!/usr/bin/env bash
# Stands in for nvidia-cuda-mps-control: -d starts a "daemon" (a sleep that keeps the pipe
# directory in its environment, as MPS's do); "quit" on stdin stops it, unless NO_QUIT is set.
if [ "${1:-}" = -d ]; then
  setsid sleep 300 </dev/null >/dev/null 2>&1 &
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read -r what
echo "$what" >> "$CUDA_MPS_PIPE_DIRECTORY/../said"
[ -n "${NO_QUIT:-}" ] && exit 0
for p in /proc/[0-9]*; do
  env=$(tr '\0' '\n' < "$p/environ" 2>/dev/null)
  grep -qxF "CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY" <<< "$env" &&
    [ "$(cat "$p/comm" 2>/dev/null)" = sleep ] && kill "${p#/proc/}"
done
exit 0
"""


@pytest.mark.parametrize("quits", [True, False])
def test_clean_up_stops_the_mps_daemon_a_stage_left(tmp_path, quits):
    # A stage that started an MPS daemon and was killed before its `quit`: the clean-up after
    # it asks the daemon to quit, and kills it when it does not, then removes its directory
    # and the segments of ranks that are gone.
    bin_dir, tmp, shm = tmp_path / "bin", tmp_path / "tmp", tmp_path / "shm"
    for d in (bin_dir, tmp, shm):
        d.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    (shm / "pycoll-emu-123").write_text("")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp), "KIT_SHM_DIR": str(shm),
           "KIT_MPS_QUIT_S": "1"}  # fmt: skip
    if not quits:
        env["NO_QUIT"] = "1"
    script = f"""
        . {STAGES_SH}
        run_limited 1 1 bash -c '
          dir=$(mktemp -d "$TMPDIR/pycoll-mps-XXXXXX")
          export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe
          mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
          nvidia-cuda-mps-control -d
          sleep 300
          echo quit | nvidia-cuda-mps-control'
        echo "rc=$?"
        clean_up_stage
    """
    proc = bash("-c", script, env=env)
    assert "rc=124" in proc.stdout, proc.stdout + proc.stderr
    killed = 0 if quits else 1
    assert (
        f"clean-up: 1 MPS daemon(s) asked to quit, {killed} MPS process(es) killed, "
        "1 shared-memory segment(s) removed"
    ) in proc.stdout, proc.stdout + proc.stderr
    assert list(tmp.iterdir()) == [] and list(shm.iterdir()) == []
    out = subprocess.run(["pgrep", "-f", "^sleep 300$"], capture_output=True, text=True)
    leftover = [p for p in out.stdout.split() if str(tmp) in _environ(p)]
    assert leftover == [], leftover
    # Nothing left: the clean-up says nothing.
    proc = bash("-c", f". {STAGES_SH}; clean_up_stage", env=env)
    assert proc.stdout == "", proc.stdout


def _gone(pid: int) -> bool:
    try:  # a zombie is gone too: only its parent's wait is missing
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _environ(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_extra_stages_run_only_when_asked(tmp_path):
    proc = bash(str(KIT / "run.sh"), "--dry-run", str(tmp_path / "out"),
                env={"STAGES": "build bench-4 emulated"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()[:-1]
    assert [line.split()[0] for line in lines] == ["build", "bench-4", "emulated"]
    assert "-n 4" in lines[1] and "-m emulated" in lines[2]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_gitignore_ignores_wheels_and_venv():
    for path in ["tools/gpu/wheels/mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl", ".venv-gpu/x"]:
        proc = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False
        )
        if proc.returncode == 128:
            pytest.skip("not a git checkout")
        assert proc.returncode == 0, f"{path} is not ignored by .gitignore"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_summary_says_when_the_files_differ_from_the_commit(tmp_path):
    # A remote runner may copy the working tree beside an older .git: the summary's commit
    # line must not pass changed files off as that commit.
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(repo)], check=True)
    run_sh = repo / "tools" / "gpu" / "run.sh"
    shutil.copy(KIT / "run.sh", run_sh)  # this tree's kit, committed or not
    shutil.copy(KIT / "stages.sh", run_sh.parent / "stages.sh")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "commit", "-qam", "kit", "--allow-empty", "--no-verify"], check=True)

    def header(out):
        env = {**os.environ, "STAGES": "none"}
        proc = subprocess.run(
            ["bash", str(run_sh), str(out)], capture_output=True, text=True, timeout=60, env=env
        )
        assert proc.returncode == 0, proc.stderr
        return (out / "summary.txt").read_text().splitlines()[1]

    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert header(tmp_path / "a").startswith(f"# commit {head}, "), header(tmp_path / "a")
    (repo / "README.md").write_text("changed\n")
    assert f"# commit {head} plus changes" in header(tmp_path / "b")


def test_result_files_carry_the_gpu_driver_and_commit(tmp_path):
    # A benchmark's output lands in OUTDIR/results/, named as benchmarks/results/ names it and
    # headed with what the performance page's tables cite; the command's status comes back.
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'NVIDIA H200, 143771 MiB, 580.159.04'\n")
    smi.chmod(0o755)
    script = f"""
        . {STAGES_SH}
        OUTDIR={tmp_path}
        result gpu_bench-@-2ranks-mps bench-mps bash -c 'echo "## all_reduce"; exit 3'
        echo "rc=$?"
    """
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert "rc=3" in proc.stdout, proc.stdout + proc.stderr
    lines = (tmp_path / "results" / "gpu_bench-h200-2ranks-mps.txt").read_text().splitlines()
    assert lines[0] == "# NVIDIA H200 (143771 MiB), driver 580.159.04", lines
    assert re.match(
        r"# commit [0-9a-f]+( plus changes)?, tools/gpu/run.sh stage bench-mps, ", lines[1]
    )
    assert lines[2] == '$ bash -c echo "## all_reduce"; exit 3', lines
    assert lines[3] == "## all_reduce", lines
