"""A rank dies and the others carry on (workers/elastic.py, examples/elastic.py): revoke,
agree and shrink on the survivors, in every collective and in point-to-point, a second death
during the shrink, revoke reaching ranks blocked in an all-reduce, a replacement joining
(grow), and elastic data-parallel training against a one-process replay. Each drill is a job
of its own under ``python -m pycollectives.launch --elastic`` (ranks that meet through files:
no mpiexec to end the job when one dies); the survivors' reports are checked here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness.launch import TWO_NODES, clean_env, run_mpi, worker_path

from pycollectives.launch import _mapped_shm


def segments() -> set:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("pycoll-*")} if shm.is_dir() else set()


def elastic(n: int, command: list, tmp_path, replace: int = 0, timeout: float = 120):
    """Runs `command` on `n` ranks under the elastic launcher: the finished process. No
    shared-memory segment outlives the job, whoever died."""
    env = clean_env(DRILL_RESULTS=str(tmp_path))
    cmd = [sys.executable, "-m", "pycollectives.launch", "-n", str(n), "--elastic",
           "--replace", str(replace), "--", *command]  # fmt: skip
    before = segments()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    left = segments() - before - _mapped_shm()  # not another job's, still in use
    assert not left, f"segments left in /dev/shm: {sorted(left)}"
    return done


def drill(n: int, name: str, tmp_path, replace: int = 0) -> list[dict]:
    """The reports of the ranks that finished `name`, each checked to have passed."""
    done = elastic(n, [sys.executable, str(worker_path("elastic.py")), name], tmp_path, replace)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    failed = [r for r in reports if not r["ok"]]
    assert not failed, "\n".join(f"rank {r['rank']}: {r['error']}\n{r['trace']}" for r in failed)
    assert done.returncode == 0, done.stderr[-3000:]
    return reports


@pytest.mark.parametrize(
    "n,kind",
    [(4, "all_reduce"), (3, "all_reduce"), (5, "all_reduce"), (4, "between"), (4, "p2p"),
     (4, "all_gather"), (4, "broadcast"), (4, "reduce_scatter"), (4, "all_to_all"),
     (3, "barrier"), (4, "reduce"), (4, "gather"), (4, "scatter")],
)  # fmt: skip
def test_survivors_shrink_and_go_on_after_a_rank_is_killed(n, kind, tmp_path):
    reports = drill(n, kind, tmp_path)
    survivors = [r for r in range(n) if r != 2]
    assert len(reports) == n - 1
    for r in reports:
        assert r["size"] == n - 1 and r["previous_ranks"] == survivors, r
        # Each survivor saw the death itself, or a peer's revocation: never a timeout.
        assert "no longer running" in r["error"] or "revoked by rank" in r["error"], r
    assert any("rank 2" in r["error"] and "no longer running" in r["error"] for r in reports)


def test_a_rank_that_dies_during_shrink_is_left_out_too(tmp_path):
    reports = drill(4, "second_dies_in_shrink", tmp_path)
    assert len(reports) == 2
    assert all(r["size"] == 2 and r["previous_ranks"] == [0, 3] for r in reports), reports


def test_revoke_reaches_ranks_blocked_in_an_all_reduce(tmp_path):
    reports = drill(4, "revoke", tmp_path)
    assert len(reports) == 4
    waited = [r["waited_s"] for r in reports if "waited_s" in r]
    assert len(waited) == 3 and max(waited) < 5, waited  # not the 30 s timeout
    assert all(r["size"] == 4 for r in reports)


def test_agree_is_the_and_of_the_survivors_flags(tmp_path):
    reports = drill(5, "agree", tmp_path)
    assert len(reports) == 4 and all(r["agreed"] == 0b0011 for r in reports), reports


def test_ranks_that_post_an_agree_and_exit_are_seen_alike(tmp_path):
    # 6 ranks; ranks 1-4 each post a round and exit at once, one round after another.
    reports = drill(6, "agree_exits", tmp_path)
    assert len(reports) == 2, reports
    first, last = (r["rounds"] for r in reports)
    assert first == last, (first, last)  # the same members and value on every survivor
    for k, got in enumerate(first):
        victim = k + 1
        # The survivors and the victim of this round if it posted; no earlier victim.
        assert set(got["members"]) - {victim} == {0, *range(victim + 1, 6)}, (k, got)


def test_a_replacement_joins_the_survivors(tmp_path):
    reports = drill(4, "replaced", tmp_path, replace=1)
    assert len(reports) == 4
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    assert all(r["size"] == 4 for r in reports)
    assert [r for r in reports if r.get("joined")][0]["rank"] == 3


def test_elastic_training_loses_no_step_and_matches_its_replay(tmp_path):
    from pycollectives.examples import elastic as example

    record = tmp_path / "record.json"
    args = ["--steps", "100", "--fail-rank", "2", "--fail-at-step", "40", "--full-size-by", "60",
            "--record", str(record)]  # fmt: skip
    done = elastic(4, [sys.executable, "-m", "pycollectives.examples.elastic", *args], tmp_path,
                   replace=1)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout
    assert "step 40: world 4 -> 3 (rank(s) [2] of 4 gone" in out, out
    assert "step 60: world 3 -> 4 (1 joined, " in out, out
    ms = float(re.search(r"step 40: done on 3 ranks ([0-9.]+) ms after the death", out)[1])
    assert ms < 10_000, out  # the death was seen, not waited out (timeout 60 s)
    got = json.loads(record.read_text())
    # Every step once: 40 on 4 ranks, the step of the death done again on 3, then 4 again.
    assert got["sizes"] == [4] * 40 + [3] * 20 + [4] * 40, got["sizes"]
    want = example.replay(example.parse_args(args), got["sizes"])
    # Bitwise: DataParallel's one bucket (19 KiB, from comm.zeros) is averaged over the shared
    # buffers, which add the ranks' shares in rank order, as the replay does.
    np.testing.assert_array_equal(np.array(got["params"], np.float32), want)
    assert "pycollectives.launch: rank 2" in done.stderr and "started replacement 1" in done.stderr


def test_a_rank_that_dies_late_in_a_step_loses_no_step_either(tmp_path):
    # It dies once its gradients are averaged: the others may finish that step with its
    # share or fail it, and may then see the death at the step boundary; either way the
    # survivors shrink and every step is done once.
    from pycollectives.examples import elastic as example

    record = tmp_path / "record.json"
    args = ["--steps", "80", "--fail-rank", "1", "--fail-at-step", "30", "--fail-late",
            "--record", str(record)]  # fmt: skip
    done = elastic(4, [sys.executable, "-m", "pycollectives.examples.elastic", *args], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    sizes = json.loads(record.read_text())["sizes"]
    k = sizes.index(3)
    assert k in (30, 31) and sizes == [4] * k + [3] * (80 - k), sizes
    got = np.array(json.loads(record.read_text())["params"], np.float32)
    np.testing.assert_array_equal(got, example.replay(example.parse_args(args), sizes))


def test_over_several_nodes_revoke_agree_and_shrink_are_refused():
    run_mpi(4, "elastic.py", "nodes", env=TWO_NODES)


@pytest.mark.parametrize("replace", [0, 1])
def test_a_job_whose_every_rank_fails_fails(replace, tmp_path):
    done = elastic(3, [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path, replace)
    assert done.returncode == 1, done.stderr
    assert "exited with status 3" in done.stderr and "the job failed" in done.stderr


def test_a_death_after_the_job_finished_elsewhere_fails_it(tmp_path):
    # rank 0 finishes at once; the others die later: the job did not finish
    code = "import os, sys, time; r = int(os.environ['PYCOLL_RANK']); time.sleep(0.3 * r); " \
           "sys.exit(0 if r == 0 else 5)"  # fmt: skip
    done = elastic(3, [sys.executable, "-c", code], tmp_path)
    assert done.returncode == 1 and "the job failed" in done.stderr, done.stderr
