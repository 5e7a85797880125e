"""The verdict of the check across nodes, from every node's status (call_check), without
processes: the same statuses give the same verdict and the same message on every rank."""

import numpy as np
import pytest

import pycollectives as pc
from pycollectives import _C
from pycollectives.backends import Call, call_check

NODES = [[0, 2, 4], [1, 3, 5]]  # two nodes of three, placed round-robin


def record(seq=3, count=6, dtype=np.float32, collective="all_reduce", op=0, root=0):
    x = np.ones(count, dtype)
    out = np.empty(count * 6, dtype) if collective == "all_gather" else None
    return _C.call_record(Call(collective, x, out, op, root), 0, 6, seq)[2]


def test_one_call_everywhere_passes():
    s = call_check.same_status(record())
    call_check.verdict([s, s], NODES)


def test_a_rank_of_one_node_names_itself_and_the_field():
    # Rank 3 (node 1, local rank 1) all-reduces 5 elements: node 1's status lists each rank's.
    good, odd = record(), record(count=5)
    statuses = [call_check.same_status(good), call_check.each_status([good, odd, good])]
    with pytest.raises(pc.CollectiveMismatch) as e:
        call_check.verdict(statuses, NODES)
    msg = str(e.value)
    assert msg == (
        "all_reduce #3: ranks disagree on the collective (count): ranks 0, 1, 2, 4, 5 run "
        "all_reduce count=6 dtype=float32 op=sum algorithm=auto; rank 3 runs all_reduce "
        "count=5 dtype=float32 op=sum algorithm=auto"
    ), msg
    # Every rank holds these statuses, in node order: the message is the same on each.
    assert call_check.mismatch_message(statuses, NODES) == msg


def test_nodes_that_each_agree_but_differ():
    a, b = record(), record(dtype=np.int32)
    with pytest.raises(pc.CollectiveMismatch, match=r"\(dtype\): ranks 0, 2, 4 run .*float32 .*; "
                       r"ranks 1, 3, 5 run .*int32"):  # fmt: skip
        call_check.verdict([call_check.same_status(a), call_check.same_status(b)], NODES)


def test_fields_and_sequence_numbers_listed_once():
    base = record()
    others = [record(collective="all_gather"), record(seq=4), record(count=7)]
    statuses = [call_check.each_status([base, base, others[0]]),
                call_check.each_status([others[1], base, others[2]])]  # fmt: skip
    msg = call_check.mismatch_message(statuses, NODES)
    assert "(sequence number, collective, count)" in msg, msg
    assert "rank 4 runs all_gather #3" in msg and "rank 1 runs all_reduce #4" in msg, msg


def test_barrier_against_a_collective():
    barrier = _C.barrier_record(2)
    statuses = [
        call_check.same_status(barrier),
        call_check.each_status([barrier, record(seq=2), barrier]),
    ]
    with pytest.raises(
        pc.CollectiveMismatch,
        match=r"barrier #2: ranks disagree on the collective \(collective\): ranks 0, 1, 2, 4, 5 "
        r"run barrier; rank 3 runs all_reduce count=6",
    ):
        call_check.verdict(statuses, NODES)


def test_an_unreadable_status_is_a_mismatch_not_a_pass():
    s = call_check.same_status(record())
    with pytest.raises(pc.CollectiveMismatch, match="unreadable"):
        call_check.verdict([s, b"\x01\x00"], NODES)
    # A status of the right kind whose record equals ours passes only in full.
    with pytest.raises(pc.CollectiveMismatch):
        call_check.verdict([s, s[:-1]], NODES)


def test_status_width_fits_the_largest():
    assert len(call_check.each_status([record()] * 3)) == call_check.status_width(3)
