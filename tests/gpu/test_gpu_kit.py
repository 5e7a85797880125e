"""The GPU run kit (tools/gpu/), checked without a GPU: the scripts parse, run.sh refuses a
missing OUTDIR, its stage limits fit one 10-minute remote command, and git ignores the wheels."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "tools" / "gpu"
SCRIPTS = ["run.sh", "fetch_wheels.sh"]


def bash(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script):
    proc = bash("-n", str(KIT / script))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [(), ("a", "b"), ("--dry-run",)])
def test_run_without_outdir_prints_usage(args):
    proc = bash(str(KIT / "run.sh"), *args)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr


def test_dry_run_fits_one_remote_command(tmp_path):
    out = tmp_path / "out"
    proc = bash(str(KIT / "run.sh"), "--dry-run", str(out))
    assert proc.returncode == 0, proc.stderr
    stages = [line.split()[0] for line in proc.stdout.splitlines()[:-1]]
    assert stages == ["env", "build", "bench-2", "bench-mps", "train", "gpu"]
    total = int(re.search(r"^total\s+(\d+)s", proc.stdout, re.M).group(1))
    assert total <= 570, proc.stdout  # a remote command gets 600 s
    # Summary plus one log per stage: a remote runner brings back at most 8 files.
    assert len(stages) + 1 <= 8
    assert not out.exists()  # a dry run writes nothing


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
