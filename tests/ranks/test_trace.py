"""PYCOLL_TRACE: a Chrome trace per rank with an event per call (workers/trace_job.py), the
merge command, and the training job's steps."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.launch import run_mpi


def load(path):
    doc = json.loads(path.read_text())
    assert set(doc) >= {"traceEvents"}
    return doc["traceEvents"]


def spans(events, name=None):
    return [e for e in events if e["ph"] == "X" and (name is None or e["name"] == name)]


def test_trace_records_every_call(tmp_path):
    out = run_mpi(2, "trace_job.py", env={"PYCOLL_TRACE": str(tmp_path / "t-{rank}.json")})
    assert "rank 0 done" in out and "rank 1 done" in out
    per_rank = {r: load(tmp_path / f"t-{r}.json") for r in (0, 1)}
    for rank, events in per_rank.items():
        for e in spans(events):
            assert e["pid"] == rank and e["dur"] >= 0 and e["ts"] > 0
        names = [e["name"] for e in events if e["ph"] == "M"]
        assert "process_name" in names and "thread_name" in names
        colls = sorted(spans(events), key=lambda e: e["ts"])
        colls = [e for e in colls if e["cat"] == "collective"]
        assert [e["name"] for e in colls] == [
            "all_reduce", "all_reduce", "all_gather", "broadcast", "all_reduce", "batch_p2p",
            "barrier",
        ]  # fmt: skip
        ar0, ar1, ag, bc, big, p2p, bar = colls
        assert ar0["args"]["bytes"] == 4000 and ar0["args"]["dtype"] == "float32"
        assert ar1["args"]["algorithm"] == "ring"
        assert ar0["args"]["algorithm"] in ("ring", "tree", "direct")
        assert ag["args"]["out_bytes"] == 8000
        assert bc["args"]["root"] == 1 and bc["args"]["bytes"] == 80
        assert big["args"]["bytes"] == 4 << 20 and big["args"]["async"] is True
        assert big["tid"] != ar0["tid"]  # the progress thread's track
        assert big["dur"] > 0
        assert p2p["args"]["bytes"] == 8000 and len(p2p["args"]["ops"]) == 2
        seqs = [e["args"]["seq"] for e in colls if "seq" in e["args"]]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert all(e["args"]["rank"] == rank for e in colls)
        phases = spans(events, "phase")
        assert [p["args"]["part"] for p in phases] == ["blocking", "async"]
        # the blocking collectives lie inside the first phase
        first = phases[0]
        for e in (ar0, ar1, ag, bc):
            assert first["ts"] <= e["ts"] and e["ts"] + e["dur"] <= first["ts"] + first["dur"]
    # the same call has the same sequence number and size on both ranks
    key = [
        [(e["name"], e["args"]["seq"], e["args"]["bytes"]) for e in spans(ev) if "seq" in e["args"]]
        for ev in per_rank.values()
    ]
    assert sorted(key[0]) == sorted(key[1])

    merged = tmp_path / "all.json"
    cmd = [sys.executable, "-m", "pycollectives.trace", "merge", "-o", str(merged)]
    done = subprocess.run(
        cmd + [str(tmp_path / "t-0.json"), str(tmp_path / "t-1.json")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "all.json" in done.stdout
    events = load(merged)
    assert {e["pid"] for e in spans(events)} == {0, 1}
    assert len(spans(events)) == sum(len(spans(ev)) for ev in per_rank.values())
    assert sum(e["name"] == "process_name" for e in events) == 2


def test_trace_of_training_steps(tmp_path):
    env = {"PYCOLL_TRACE": str(tmp_path / "train.json")}
    out = run_mpi(2, "run_module.py", "pycollectives.examples.train", "--epochs", "1", env=env)
    assert "replicas bit-identical across 2 ranks: yes" in out
    for rank in (0, 1):
        events = load(tmp_path / f"train.rank{rank}.json")
        steps = spans(events, "step")
        assert [s["args"]["step"] for s in steps] == list(range(len(steps))) and steps
        # every step holds its gradient all-reduce (asynchronous, on the progress track)
        reduces = [e for e in spans(events, "all_reduce") if e["args"].get("async")]
        assert len(reduces) >= len(steps)


def test_no_trace_without_the_variable(tmp_path):
    code = "import pycollectives.trace as t; print(t.enabled())"
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYCOLL_TRACE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False"
