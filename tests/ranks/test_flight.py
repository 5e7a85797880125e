"""The flight recorder (pycollectives.trace.flight): the rings workers/flight.py's drills leave
behind, read as files and through ``python -m pycollectives.trace analyze``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import run_mpi

from pycollectives.trace import flight


@pytest.fixture(scope="module")
def drills(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("flight")
    out = run_mpi(3, "flight.py", env={"FLIGHT_DIR": str(base)},
                  mpiexec_args=("-disable-auto-cleanup",), timeout=120)  # fmt: skip
    assert "rank 0 done" in out and "rank 1 done" in out, out
    return base


def rings(directory: Path) -> dict:
    (comm,) = flight.load(directory).values()  # one communicator per drill
    return comm


def analyze(directory: Path) -> str:
    cmd = [sys.executable, "-m", "pycollectives.trace", "analyze", str(directory)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def test_a_skipped_call_is_named_with_its_rank(drills):
    docs = rings(drills / "skipped")
    assert sorted(docs) == [0, 1, 2]
    for r, doc in docs.items():
        assert "CollectiveMismatch" not in doc["reason"] and "#4" in doc["reason"], doc["reason"]
        calls = [(e["call"], e["seq"]) for e in doc["calls"]]
        assert calls[:3] == [("all_reduce", 1), ("broadcast", 2), ("all_reduce", 3)], calls
        assert calls[3] == ("all_reduce" if r == 1 else "broadcast", 4), calls
        # The broadcast's root does not wait for its receivers: it may find out at #5.
        assert len(calls) == 4 or (r == 0 and calls[4:] == [("all_reduce", 5)]), calls
        assert doc["calls"][-1]["state"] == "started", doc["calls"]  # as it was when it failed
    report = analyze(drills / "skipped")
    assert "first disagreement at #4" in report, report
    # "skipped" where the root ran on to #5 and shows it, "did not make" where it did not
    assert re.search(r"rank 1 (skipped|did not make) broadcast #4 \(4 x float32, root 0\)", report)


def test_a_hang_names_the_rank_behind_and_what_each_waits_for(drills):
    docs = rings(drills / "hang")
    assert sorted(docs) == [0, 1, 2], "rank 1 wrote no ring when its peers timed out"
    assert docs[1]["reason"] == "SIGUSR1", docs[1]["reason"]  # asked by a peer, in its own code
    for r in (0, 2):
        assert "timed out" in docs[r]["reason"] and "flight record:" in docs[r]["reason"]
    assert all(e["state"] == "ended" for e in docs[1]["calls"]), docs[1]["calls"]
    report = analyze(drills / "hang")
    assert "rank 1 is furthest behind: its last collective is all_reduce #3" in report, report
    assert re.search(
        r"rank 2 \(pid \d+, .*\) when it wrote its ring: started broadcast #4 "
        r"\(4 x float32, root 0\) for \d\.\d\d s",
        report,
    ), report
    assert re.search(
        r"rank 1 .* in no call of this communicator; the last, all_reduce #3 .*, ended", report
    ), report


def test_a_ring_holds_point_to_point_and_asynchronous_calls(drills):
    docs = rings(drills / "asked")
    for r, doc in docs.items():
        assert doc["reason"] == "SIGUSR1" and doc["size"] == 3 and doc["rank"] == r
        send, recv = doc["calls"][:2]
        assert (send["call"], send["peer"], send["tag"], send["count"]) == (
            "send",
            (r + 1) % 3,
            7,
            6,
        )
        assert (recv["call"], recv["peer"], recv["dtype"]) == ("recv", (r - 1) % 3, "int32")
        colls = [e for e in doc["calls"] if e["seq"]]
        assert [e["call"] for e in colls] == ["all_reduce"] * 3 + ["barrier"], colls
        for e in doc["calls"]:
            assert e["state"] == "ended", e
            assert 0 < e["queued_ns"] <= e["started_ns"] <= e["ended_ns"] <= doc["dumped_ns"], e
        assert [e["count"] for e in colls[:3]] == [1000] * 3 and colls[0]["dtype"] == "float64"
        assert colls[0]["algo"] in ("ring", "tree", "direct"), colls[0]  # as chosen, not auto
    report = analyze(drills / "asked")
    assert "every rank reached collective #4" in report and "no disagreement" in report, report


def test_a_dead_rank_leaves_the_survivors_records(drills):
    docs = rings(drills / "dead")
    assert sorted(docs) == [0, 1], sorted(docs)
    for doc in docs.values():
        assert "no longer running" in doc["reason"], doc["reason"]
    report = analyze(drills / "dead")
    assert "no ring from rank(s) 2" in report, report


def test_the_dump_is_valid_json_whatever_the_reason(drills):
    for f in drills.rglob("rank*.json"):
        doc = json.loads(f.read_text())
        assert doc["version"] == 1 and doc["capacity"] == 1024, f


def test_a_skipped_call_across_nodes_is_named_with_its_rank(tmp_path):
    # The calls across nodes are in the ring of each node's communicator, their node-local
    # phases beside them; every node's ranks write into one directory.
    run_mpi(
        4, "flight.py", "nodes", env={"FLIGHT_DIR": str(tmp_path), "PYCOLL_RANKS_PER_NODE": "2"}
    )
    docs = rings(tmp_path / "skipped")
    assert sorted(docs) == [0, 1, 2, 3]
    report = analyze(tmp_path / "skipped")
    assert re.search(r"rank 1 (skipped|did not make) broadcast #4 \(4 x float32, root 0\)", report)
