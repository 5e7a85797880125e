"""The training job's checkpoints: round trip, a crash mid-write, what a killed writer left."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pycollectives import checkpoint


def test_checkpoint_roundtrip(tmp_path):
    path = tmp_path / "sub" / "c.npz"
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.int64)}
    checkpoint.save(path, a, {"epoch": 3, "note": "x"})
    got, meta = checkpoint.load(path)
    assert meta == {"epoch": 3, "note": "x"}
    assert set(got) == {"w", "b"} and np.array_equal(got["w"], a["w"])
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.save(path, {checkpoint.META: a["b"]})


def test_checkpoint_crash_mid_write_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    checkpoint.save(path, {"w": np.ones(4)}, {"step": 1})

    def half_then_crash(f, arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk gone")

    monkeypatch.setattr(checkpoint, "_write_npz", half_then_crash)
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save(path, {"w": np.zeros(4)}, {"step": 2})
    got, meta = checkpoint.load(path)
    assert meta == {"step": 1} and np.array_equal(got["w"], np.ones(4))
    assert os.listdir(tmp_path) == ["c.npz"]


def test_checkpoint_removes_what_a_killed_writer_left(tmp_path):
    path = tmp_path / "c.npz"
    (tmp_path / "c.npz.tmp-12345").write_bytes(b"partial")  # a writer killed mid-write
    checkpoint.save(path, {"w": np.ones(2)})
    assert os.listdir(tmp_path) == ["c.npz"]


REAP = """
import os, signal, subprocess, sys, time
from pycollectives.launch import reap_ended

def ended(p):
    end = time.monotonic() + 10
    while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < end, "the child did not end"
        time.sleep(0.01)

done = subprocess.Popen(["true"])
ended(done)  # it ends first, and has the lower pid: the kernel's order would put it first
killed = subprocess.Popen(["sleep", "60"])
killed.send_signal(signal.SIGKILL)
ended(killed)
got = reap_ended()
assert [pid for pid, _ in got] == [killed.pid, done.pid], (got, killed.pid, done.pid)
assert os.waitstatus_to_exitcode(got[0][1]) == -signal.SIGKILL, got
done.returncode = killed.returncode = 0  # reaped here
print("ok")
"""


def test_reap_ended_hands_back_deaths_before_finishes():
    # A rank that died while others were finishing must not count as a death after the job
    # finished, whatever order the kernel hands ended processes back in (in a process of its
    # own: reap_ended reaps every ended child).
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REAP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
