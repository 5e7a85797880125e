"""The CUDA transport's device code on the CPU (the emulated device, csrc/emu/): the step
kernel compiled for the host, run by every rank over shared memory with the GPU's segment
layout, every access bounds-checked, in kernel mode (blocks waiting on peers' device flags)
and stepped mode (one launch per step). See workers/emulated.py."""

import pytest
from harness.launch import run_mpi

pytestmark = pytest.mark.emulated

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
MODES = ["kernel", "stepped"]


def _algos(collective):
    tree = collective in ("all_reduce", "broadcast", "reduce")
    return ["ring"] + (["tree"] if tree else []) + ["direct", "auto"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("collective", COLLECTIVES)
# (2 ranks on default slots went: 2 ranks run on small slots, default slots on 3; 10 cases,
# about 12 s, for the push, first-use and copy-engine tests.)
@pytest.mark.parametrize(
    "nranks,staging", [(2, "small"), (3, "small"), (4, "small"), (3, "default")]
)
def test_emulated_matrix(mode, collective, nranks, staging):
    # Every (algorithm, in place) variant of every case on 2 and 3 ranks with small slots; on
    # the others each case runs one in turn (PYCOLL_TEST_COVER, workers/collectives.py).
    full = nranks < 4 and staging == "small"
    env = None if full else {"PYCOLL_TEST_COVER": "rotate"}
    run_mpi(nranks, "emulated.py", mode, collective, staging, env=env)


NEW_PARTS = ["all_to_all", "gather_scatter", "all_gather_v", "reduce_scatter_v"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("part", NEW_PARTS)
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_emulated_new_collectives(mode, part, nranks):
    # all_to_all (even and split), gather and scatter from every root, uneven all_gather and
    # reduce_scatter: every dtype, 4 KiB slots, against MPI and numpy (workers/new_collectives.py).
    run_mpi(nranks, "emulated.py", mode, part)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nranks", [2, 3])
def test_emulated_split_and_count_mismatch(mode, nranks):
    run_mpi(nranks, "emulated.py", mode, "split_mismatch")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("blocks", [1, 7])
def test_emulated_block_counts(mode, blocks):
    # One channel, and a channel count that divides no message evenly.
    run_mpi(3, "emulated.py", mode, "all_reduce", "small", "ring,direct", str(blocks))


def test_emulated_many_blocks():
    # As many blocks as PYCOLL_CUDA_BLOCKS=auto gives 4 ranks of an H100 (33): a 64 KiB slot's
    # share per block is under 2 KiB, and no count divides evenly among them.
    run_mpi(2, "emulated.py", "kernel", "all_reduce", "default", "ring,direct", "33")


@pytest.mark.parametrize("mode", MODES)
def test_emulated_twoshot(mode):
    run_mpi(
        3, "emulated.py", mode, "all_reduce", "small", "direct", env={"PYCOLL_ONESHOT_BYTES": "0"}
    )


@pytest.mark.parametrize("mode", MODES)
def test_emulated_more_shapes_than_the_plan_cache(mode):
    run_mpi(2, "emulated.py", mode, "shapes")


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_emulated_capture_and_replay(mode, nranks):
    out = run_mpi(nranks, "emulated.py", mode, "replay")
    assert f"replay {mode} ranks={nranks}" in out, out


# A replay waits for the eager launch before it, whose end is reported late.
def test_emulated_replay_waits_for_the_eager_call_before():
    out = run_mpi(2, "emulated.py", "kernel", "replay_order")
    assert "replay_order ranks=2: 4 replays" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_emulated_launch_runs_the_blocks_its_messages_use(mode):
    out = run_mpi(2, "emulated.py", mode, "grid")
    assert f"grid {mode} ranks=2" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_emulated_sizes_change_back_to_back(mode):
    run_mpi(3, "emulated.py", mode, "resize")


@pytest.mark.parametrize("mode", MODES)
def test_emulated_call_headers_are_not_overwritten_before_they_are_read(mode):
    out = run_mpi(3, "emulated.py", mode, "headers")
    assert f"headers {mode} ranks=3" in out, out


def _drill(mode, what, nranks=3, size="large", env=None):
    out = run_mpi(nranks, "emulated.py", mode, what, size, env=env,
                  mpiexec_args=("-disable-auto-cleanup",))  # fmt: skip
    return ["RAISED" + part.split("\n")[0] for part in out.split("RAISED")[1:]]


@pytest.mark.parametrize("mode,push", [("kernel", "0"), ("stepped", "0"), ("kernel", "1")])
def test_emulated_peer_dies_mid_collective(mode, push):
    # push: the survivors wait on flags in their own memory that the dead rank would write.
    raised = _drill(mode, "dies_mid", env={"PYCOLL_CUDA_PUSH": push})
    assert len(raised) == 2, raised  # both survivors
    for line in raised:
        assert "CollectiveError" in line and "rank 1" in line and "no longer running" in line


@pytest.mark.parametrize("mode", MODES)
def test_emulated_peer_stalls_mid_collective(mode):
    raised = _drill(mode, "stalls_mid")
    assert len(raised) == 2, raised
    for line in raised:
        assert "CollectiveTimeout" in line and "rank 1" in line
        assert float(line.split(" after ")[1].split("s:")[0]) < 6  # the timeout is 1.5 s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["dead_peer", "timeout"])
def test_emulated_peer_missing_between_collectives(mode, what):
    raised = _drill(mode, what)
    assert len(raised) == 2, raised
    kind = "CollectiveTimeout" if what == "timeout" else "CollectiveError"
    assert all(kind in line and "rank 1" in line for line in raised), raised


@pytest.mark.parametrize("mode", MODES)
def test_emulated_mismatch(mode):
    raised = _drill(mode, "mismatch", nranks=2)
    assert len(raised) == 2, raised
    assert all("CollectiveMismatch" in line and "count" in line for line in raised), raised


# The LL format (device/plan.h, ll_message): data and flag in one store, polled by the
# receiver's threads. Kernel mode only; stepped mode runs the same cases without it.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nranks", [2, 3])
def test_emulated_ll_sizes_and_dtypes(mode, nranks):
    out = run_mpi(nranks, "emulated.py", mode, "ll_sizes")
    assert f"ll_sizes {mode} ranks={nranks}" in out, out


@pytest.mark.parametrize("mode", ["kernel"])  # stepped mode plans no LL message
@pytest.mark.parametrize("nranks", [2, 4])
def test_emulated_ll_back_to_back_with_late_ranks(mode, nranks):
    out = run_mpi(nranks, "emulated.py", mode, "ll_race")
    assert f"ll_race {mode} ranks={nranks}" in out, out


@pytest.mark.parametrize("mode", ["kernel"])  # stepped mode plans no LL message
def test_emulated_ll_flags_wrap(mode):
    out = run_mpi(3, "emulated.py", mode, "ll_wrap")
    assert f"ll_wrap {mode} ranks=3" in out, out


@pytest.mark.parametrize("mode", ["kernel"])  # stepped mode plans no LL message
def test_emulated_ll_peer_dies_mid_collective(mode):
    raised = _drill(mode, "dies_mid", size="ll")
    assert len(raised) == 2, raised
    for line in raised:
        assert "CollectiveError" in line and "rank 1" in line and "no longer running" in line


@pytest.mark.parametrize("mode", ["kernel"])  # stepped mode plans no LL message
def test_emulated_ll_peer_stalls_mid_collective(mode):
    raised = _drill(mode, "stalls_mid", size="ll")
    assert len(raised) == 2, raised
    for line in raised:
        assert "CollectiveTimeout" in line and "rank 1" in line
        assert float(line.split(" after ")[1].split("s:")[0]) < 6  # the timeout is 1.5 s


@pytest.mark.parametrize("mode", ["kernel"])  # stepped mode plans no LL message
def test_emulated_ll_mismatch(mode):
    raised = _drill(mode, "mismatch", nranks=2, size="ll")
    assert len(raised) == 2, raised
    assert all("CollectiveMismatch" in line and "count" in line for line in raised), raised


# Kernel mode's launch end (step_kernel.h, finish_launch) and its order across streams (the
# host's: an event after the launch before): a blocking call is one launch on the caller's
# stream.
@pytest.mark.parametrize("mode", ["kernel"])  # stepped mode launches on the communicator's stream
def test_emulated_launch_end_is_reported_after_every_block(mode):
    out = run_mpi(3, "emulated.py", mode, "launch_end")
    assert f"launch_end {mode} ranks=3" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_emulated_mismatched_call_of_several_blocks_moves_nothing(mode, tmp_path):
    out = run_mpi(3, "emulated.py", mode, "gate", env={"FLIGHT_DIR": str(tmp_path)})
    assert out.count(f"gate {mode} ranks=3: nothing moved") == 3, out
    # The device's flight recorder wrote each rank's ring as the mismatch aborted it: the
    # all-gather issued (queued: the host does not follow a GPU call further), rank 2's count
    # the odd one, named by the analyzer.
    from pycollectives.trace import flight

    (docs,) = flight.load(tmp_path).values()
    assert sorted(docs) == [0, 1, 2], docs
    for r, doc in docs.items():
        (call,) = doc["calls"]
        assert (call["call"], call["seq"], call["state"]) == ("all_gather", 1, "queued"), call
        assert call["count"] == 5000 - 16 * (r == 2) and call["algo"] == "direct", call
        assert "count" in doc["reason"], doc["reason"]
    report = flight.analyze(tmp_path)
    assert "rank(s) 2: all_gather #1 (4984 x float32)" in report, report


# Stepped mode through scratch (device/stepped.h, run_scratch): all-reduce, reduce and
# reduce-scatter (the two-shot in place over every rank's segment data area), all-gather and
# broadcast (copies), a chunk at a time between host meetings: two waits for the GPU per chunk
# instead of one per step.
@pytest.mark.parametrize("nranks", [2, 3])
def test_emulated_stepped_all_reduce_through_scratch(nranks):
    out = run_mpi(nranks, "emulated.py", "stepped", "stepped_scratch")
    assert f"stepped_scratch ranks={nranks}" in out, out


def test_emulated_stepped_all_reduce_through_scratch_after_a_late_call_of_steps():
    out = run_mpi(2, "emulated.py", "stepped", "stepped_scratch_after_steps")
    assert "stepped_scratch_after_steps ranks=2" in out, out


# Stepped mode's fences (device/stepped.h, counter_fence): the work of a call goes on each
# rank's queue, ordered across ranks by waits on their fence counters, every rank's queue late
# in turn; the same calls with the fences of PYCOLL_CUDA_STEPPED_EVENTS=0; and the fences on
# interprocess events whose waits bind when the queue reaches them (weak_events): a cycle,
# every rank raising within the timeout.
@pytest.mark.parametrize("events", ["on", "off", "weak_events"])
def test_emulated_stepped_fences_order_every_ranks_queue(events):
    out = run_mpi(3, "emulated.py", "stepped", "stepped_events", events)
    assert f"stepped_events {events} ranks=3" in out, out


@pytest.mark.parametrize("what", ["dies_mid", "stalls_mid"])
def test_emulated_peer_fails_in_stepped_all_reduce_through_scratch(what):
    raised = _drill("stepped", what, size="scratch")
    assert len(raised) == 2, raised
    kind = "CollectiveError" if what == "dies_mid" else "CollectiveTimeout"
    for line in raised:
        assert kind in line and "rank 1" in line, line


# A one-rank job: calls that move nothing are not launched, and nothing waits for their end.
def test_emulated_one_rank_skips_launches_and_waits_for_none():
    out = run_mpi(1, "emulated.py", "kernel", "one_rank")
    assert "one_rank kernel: 7 calls" in out, out


# The barrier a GPU runs (device/orchestration.h): nobody leaves early, a mismatch raises.
@pytest.mark.parametrize("mode", ["kernel", "stepped"])
def test_emulated_barrier(mode):
    out = run_mpi(3, "emulated.py", mode, "barrier")
    assert f"barrier {mode} ranks=3: 3 barriers right" in out, out


@pytest.mark.parametrize("late_ms", [20, 2500])
def test_emulated_call_on_another_stream_waits_for_the_call_before(late_ms):
    out = run_mpi(2, "emulated.py", "kernel", "previous_stream", str(late_ms))
    assert "previous_stream kernel ranks=2" in out, out


# Kernel mode on ranks that share a GPU: the emulated GPU has 8 SMs, a block runs only while
# it holds one (EmuOptions::sms). The residency check's blocks run right, with calls queued on
# alternating streams and a late rank; 4 blocks each, unchecked, hang a GPU: here every rank
# raises, bounded, and the emulated device names the block that could not become resident.
@pytest.mark.parametrize("checked", ["checked", "unchecked"])
def test_emulated_blocks_of_ranks_sharing_a_gpu_fit_its_sms(checked):
    out = run_mpi(4, "emulated.py", "kernel", "residency", checked)
    assert f"residency {checked} ranks=4" in out, out


PUSH_CASES = [("kernel", c, 3) for c in COLLECTIVES] + [
    ("stepped", "all_reduce", 3),
    ("stepped", "reduce_scatter", 2),
    ("kernel", "all_to_all", 3),
    ("kernel", "ll_race", 3),
    ("kernel", "ll_sizes", 2),
    ("kernel", "ll_wrap", 2),
]


@pytest.mark.parametrize("mode,part,nranks", PUSH_CASES)
def test_push(mode, part, nranks):
    # PYCOLL_CUDA_PUSH=1: a message between two ranks goes by writes into the receiver's
    # segment, each rank polling its own memory (SegmentLayout::push), LL words included; the
    # emulated device lets a launch write peers' segments only then. Planted and caught: the
    # receiver's freed flag posted in its own segment (every rank times out), the pushed flag
    # posted without a release (weak stores: 2240 of 5000 elements wrong).
    args = (part, "small") if part in COLLECTIVES else (part,)
    run_mpi(nranks, "emulated.py", mode, *args, env={"PYCOLL_CUDA_PUSH": "1"})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nranks,staging", [(2, "small"), (3, "small"), (4, "default")])
@pytest.mark.parametrize("algo", ["ring", "direct"])
def test_lookahead(mode, nranks, staging, algo):
    # PYCOLL_CUDA_LOOKAHEAD=1: the ring's and the two-shot's next piece's first messages go out
    # before this piece's last receives, two messages in flight per channel (small staging: 2
    # slots). Direct all-reduces are all two-shot here (PYCOLL_ONESHOT_BYTES=0).
    env = {"PYCOLL_CUDA_LOOKAHEAD": "1", "PYCOLL_ONESHOT_BYTES": "0"}
    out = run_mpi(nranks, "emulated.py", mode, "all_reduce", staging, algo, env=env)
    assert f"all_reduce {algo} {mode} ranks={nranks}" in out, out
