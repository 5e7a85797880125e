"""pycollectives.launch (restart after a rank dies), the training job's checkpoints and
resume, and pycollectives.checkpoint's atomic files."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from harness.launch import clean_env, our_segments

TRAIN = [sys.executable, "-m", "pycollectives.examples.train", "--epochs", "5", "--momentum", "0.9"]


def launch(*args, timeout=300):
    env = clean_env()
    env.pop("PYCOLL_RESTART_COUNT", None)
    cmd = [sys.executable, "-m", "pycollectives.launch", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def final(out: str):
    acc = re.search(r"final test accuracy (\S+)", out).group(1)
    digest = re.search(r"parameters sha256 (\S+)", out).group(1)
    return acc, digest


def test_restart_after_a_rank_is_killed(tmp_path):
    before = our_segments()
    plain = launch("-n", "4", "--", *TRAIN)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    drill = launch(
        "-n", "4", "--max-restarts", "2", "--",
        *TRAIN, "--checkpoint-dir", str(ckpt), "--fail-rank", "2", "--fail-at-step", "40",
    )  # fmt: skip
    out, err = drill.stdout, drill.stderr
    assert drill.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "rank 2: dying at global step 40" in out
    assert "rank 2 killed by signal 9 (SIGKILL)" in err
    assert "restarting the job (1 of 2)" in err
    assert "the job finished after 1 restart(s)" in err
    # 12 steps an epoch on 4 ranks: the last checkpoint before step 40 ends epoch 3
    assert "resumed from" in out and "epoch 4, step 0 (global step 36" in out
    assert out.count("dying at global step") == 1  # once: not again after the restart
    assert "epoch   5" in out and "replicas bit-identical across 4 ranks: yes" in out
    # the resumed run ends exactly where the undisturbed one does
    assert final(out) == final(plain.stdout)
    assert (ckpt / "checkpoint.npz").exists()
    assert not [f for f in os.listdir(ckpt) if ".tmp-" in f]
    assert our_segments() <= before


def test_resume_mid_epoch_matches(tmp_path):
    """--checkpoint-every: saves inside epochs too; a second run resumes where the first
    stopped (here: its last epoch already done) and reports the same parameters."""
    ckpt = tmp_path / "ckpt"
    args = ("-n", "2", "--max-restarts", "1", "--", *TRAIN[:4], "2", "--momentum", "0.9")
    drill = launch(*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
                   "--fail-rank", "1", "--fail-at-step", "27")  # fmt: skip
    assert drill.returncode == 0, drill.stderr[-3000:]
    # 23 steps an epoch on 2 ranks: step 27 is inside epoch 2; the last save was at step 25
    assert "epoch 2, step 2 (global step 25" in drill.stdout
    plain = launch(*args)
    assert final(drill.stdout) == final(plain.stdout)
    again = launch(*args, "--checkpoint-dir", str(ckpt))
    assert "epoch 3, step 0 (global step 46" in again.stdout
    assert final(again.stdout) == final(plain.stdout)


def test_gives_up_after_max_restarts(tmp_path):
    marker = tmp_path / "runs"
    code = (
        "import os, sys; from mpi4py import MPI; "
        f"open({str(marker)!r}, 'a').write('x') if MPI.COMM_WORLD.rank == 0 else None; "
        "sys.exit(3 if MPI.COMM_WORLD.rank == 1 else 0)"
    )
    done = launch("-n", "2", "--max-restarts", "1", "--", sys.executable, "-c", code)
    assert done.returncode != 0
    assert marker.read_text() == "xx"  # the first run and one restart
    assert "rank 1 exited with status 3" in done.stderr
    assert "giving up after 1 restart(s)" in done.stderr


@pytest.mark.parametrize(
    "args,message",
    [((), "no command given"), (("-n", "0", "--", "true"), "-n must be at least 1"),
     (("-n", "2", "--max-restarts", "-1", "--", "true"), "--max-restarts must be at least 0"),
     (("-n", "2", "--replace", "1", "--", "true"), "--replace needs --elastic"),
     (("-n", "2", "--elastic", "--max-restarts", "1", "--", "true"), "not with --max-restarts"),
     (("-n", "2", "--elastic", "--replace", "-1", "--", "true"), "--replace must be at least 0")],
)  # fmt: skip
def test_usage_errors(args, message):
    done = launch(*args) if args else launch("-n", "2")
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
