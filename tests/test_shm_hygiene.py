"""Shared memory: never trust a peer's segment, say clearly when space runs out, and leave
nothing in /dev/shm however a job ends."""

import os
import signal
import subprocess
import sys
import time

import pytest
from mpi_harness import WORKERS, mpiexec, our_segments, run_mpi

from pycollectives import _C


def host_pair(slot_bytes=4096):
    opts = _C.HostCommOptions()
    opts.slot_bytes = slot_bytes
    return _C.HostComm(0, 2, opts), _C.HostComm(1, 2, opts)


def test_segment_names_are_private_and_random():
    a, b = host_pair()
    for h in (a, b):
        name = h.segment_name
        assert name.startswith(f"/pycoll-{os.getuid()}-")
        st = os.stat("/dev/shm" + name)
        assert st.st_mode & 0o777 == 0o600
    assert a.segment_name != b.segment_name
    del a, b


@pytest.mark.parametrize(
    "offset,value,words",
    [(12, 3, "unexpected header"), (16, 0, "unexpected header"), (0, 0, "unexpected header")],
)
def test_corrupted_peer_header_is_an_error(offset, value, words):
    a, b = host_pair()
    with open("/dev/shm" + b.segment_name, "r+b") as f:  # rank 1's header, scribbled on
        f.seek(offset)
        f.write(value.to_bytes(4, "little"))
    with pytest.raises(_C.CollectiveError, match=words):
        a.attach([a.segment_name, b.segment_name])
    names = {a.segment_name[1:], b.segment_name[1:]}
    del a, b
    assert not names & our_segments()


def test_peer_segment_of_the_wrong_size_is_an_error():
    a, b = host_pair()
    os.truncate("/dev/shm" + b.segment_name, 8192)
    with pytest.raises(_C.CollectiveError, match="expected"):
        a.attach([a.segment_name, b.segment_name])


def test_missing_peer_segment_is_an_error():
    a, _ = host_pair()
    with pytest.raises(_C.CollectiveError, match="cannot open shared memory"):
        a.attach([a.segment_name, "/pycoll-no-such-segment"])


def test_not_enough_shared_memory_states_bytes_needed_and_available():
    before = our_segments()
    opts = _C.HostCommOptions()
    opts.slot_bytes = 1 << 40  # far more than any /dev/shm
    with pytest.raises(_C.CollectiveError, match=r"need \d+ bytes, /dev/shm has \d+ bytes"):
        _C.HostComm(0, 2, opts)
    assert our_segments() == before


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
        if "PASS kill9" in out:
            break
    assert "PASS kill9" in out, out
    assert our_segments() == before


def test_kill_9_of_every_rank_leaves_nothing():
    before = our_segments()
    proc = subprocess.Popen(
        [mpiexec(), "-n", "3", sys.executable, str(WORKERS / "faults.py"), "loop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert "looping" in proc.stdout.readline()
        time.sleep(0.5)  # collectives in full swing
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    time.sleep(0.2)
    assert our_segments() == before
