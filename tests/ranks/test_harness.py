"""The rank pool itself (harness/pool.py, rank.py): a case that fails or hangs is reported with
the rank, the case and the error, ends its pool, and the next case gets a fresh one. The
env:// launches' ranks, forked from the zygote (harness/zygote.py), report the same way."""

from __future__ import annotations

import time

import pytest
from harness.checks import proc_stat
from harness.launch import HARNESS, mpiexec, run_env_launch
from harness.pool import CaseFailed, Pools

SCRIPT = """
import sys, time
from mpi4py import MPI
rank, what = MPI.COMM_WORLD.Get_rank(), sys.argv[1]
print(f"rank {rank} says hello")
if what == "fail" and rank == 1:
    raise AssertionError("x: 3 of 10 elements wrong, first at [4]: got 1, expected 2")
if what == "hang" and rank == 0:
    time.sleep(60)
MPI.COMM_WORLD.Barrier() if what == "ok" else None
"""


def cpu_ticks(pid: int) -> int:
    fields = proc_stat(pid)
    return int(fields[11]) + int(fields[12])


@pytest.fixture
def pools():
    made = Pools()
    yield made
    made.close()


def test_failures_name_the_rank_and_the_case_and_the_next_case_gets_a_fresh_pool(tmp_path, pools):
    script = tmp_path / "case.py"
    script.write_text(SCRIPT)

    def case(what):
        return {"script": str(script), "argv": [what], "env": {"PYCOLL_TIMEOUT": "10"}}

    out, _ = pools.run(mpiexec(), 2, HARNESS, case("ok"), {}, 60)
    assert "rank 0 says hello" in out and "rank 1 says hello" in out
    first = next(iter(pools.pools.values()))
    # An idle pool sleeps in the kernel: no CPU while it waits for the next case.
    pids = [int((first.box / f"pid-{r}").read_text()) for r in range(2)]
    before = [cpu_ticks(p) for p in pids]
    time.sleep(1.0)
    assert [cpu_ticks(p) - b for p, b in zip(pids, before)] == [0, 0]

    with pytest.raises(CaseFailed) as failed:
        pools.run(mpiexec(), 2, HARNESS, case("fail"), {}, 60)
    text = str(failed.value)
    assert "case.py fail on 2 ranks" in text
    assert "rank 1: AssertionError: x: 3 of 10 elements wrong, first at [4]" in text
    assert "rank 0:" not in text.split("---")[0]  # rank 0 passed
    assert not first.alive() and not first.box.exists()

    with pytest.raises(CaseFailed) as hung:
        pools.run(mpiexec(), 2, HARNESS, case("hang"), {}, 3)
    text = str(hung.value)
    assert "ranks [0]: not done after 3 s" in text
    assert "time.sleep" in text or "in <module>" in text  # rank 0's stack, dumped on request

    out, _ = pools.run(mpiexec(), 2, HARNESS, case("ok"), {}, 60)  # a fresh pool
    assert "rank 1 says hello" in out

    # The pools of one launch environment end, the others stay.
    pools.run(mpiexec(), 2, HARNESS, case("ok"), {"POOL_MARK": "a"}, 60)
    marked, plain = (p for k, p in sorted(pools.pools.items(), key=lambda kv: -len(kv[0][1])))
    pools.close_with({"POOL_MARK": "a"})
    assert not marked.alive() and plain.alive() and list(pools.pools.values()) == [plain]


ENV_SCRIPT = """
import os, sys, time
rank, what = int(os.environ["RANK"]), sys.argv[1]
print(f"rank {rank} of {os.environ['WORLD_SIZE']} says hello", flush=True)
if what == "fail" and rank == 1:
    raise AssertionError("x: 3 of 10 elements wrong, first at [4]: got 1, expected 2")
if what == "exit" and rank == 1:
    sys.exit(3)
if what == "hang" and rank == 0:
    time.sleep(60)
print("torch", "torch" in sys.modules, os.environ.get("CASE_SETTING"), sys.argv[1:])
"""


def test_env_launch_ranks_report_their_output_failures_and_hangs(tmp_path):
    script = tmp_path / "env_case.py"
    script.write_text(ENV_SCRIPT)

    def launch(what, timeout=60):
        return run_env_launch(2, str(script), what, timeout=timeout,
                              rank_env=lambda r: {"CASE_SETTING": f"r{r}"})  # fmt: skip

    outs = launch("ok")
    assert outs == [f"rank {r} of 2 says hello\ntorch True r{r} ['ok']\n" for r in range(2)]
    with pytest.raises(pytest.fail.Exception) as failed:
        launch("fail")
    text = str(failed.value)
    assert "rank 1 exited with 1:" in text and "AssertionError: x: 3 of 10" in text
    assert "rank 0 exited" not in text
    with pytest.raises(pytest.fail.Exception) as exited:
        launch("exit")
    assert "rank 1 exited with 3: rank 1 of 2 says hello" in str(exited.value)
    with pytest.raises(pytest.fail.Exception) as hung:
        # Long enough for rank 1 to have exited, on a loaded machine too: at 1 s it was once
        # still finishing, and was reported hung beside rank 0.
        launch("hang", timeout=5)
    assert "ranks [0] hung; rank 0 exited with -9: rank 0 of 2 says hello" in str(hung.value)
    assert launch("ok")[1].startswith("rank 1 of 2 says hello")  # the zygote serves on
