"""Shared memory in one process: private random segment names; a peer's segment never trusted
(corrupted header, wrong size, missing); running out of space says how much was needed."""

import os

import pytest
from harness.launch import our_segments

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
