"""Shared memory: never trust a peer's segment, say clearly when space runs out, and leave
nothing in /dev/shm however a job ends."""

import os
import signal
import subprocess
import sys
import time

from harness.launch import mpiexec, our_segments, run_mpi, with_harness, worker_path


def test_kill_9_of_one_rank_is_reported_and_leaves_nothing():
    before = our_segments()
    # mpiexec may still kill the survivor soon after a rank dies of a signal: on a loaded
    # machine it can do so before the survivor (which notices within milliseconds) has run.
    # That is the launcher's race, not a failure; a survivor that ran and failed prints a
    # traceback, which fails at once.
    for _ in range(4):
        out, err = run_mpi(
            2,
            "faults.py",
            "kill9",
            timeout=60,
            mpiexec_args=("-disable-auto-cleanup",),
            returncodes=(0, 9, 137),  # mpiexec reports the killed rank's signal
            with_stderr=True,
        )
        assert "Traceback" not in err, err
        if "kill9: the survivor raised" in out:
            break
    assert "kill9: the survivor raised" in out, out
    assert our_segments() == before


def test_kill_9_of_every_rank_leaves_nothing():
    before = our_segments()
    proc = subprocess.Popen(
        [mpiexec(), "-n", "3", sys.executable, str(worker_path("faults.py")), "loop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env=with_harness(dict(os.environ)),
    )
    try:
        assert "looping" in proc.stdout.readline()
        time.sleep(0.5)  # collectives in full swing
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    time.sleep(0.2)
    assert our_segments() == before
