"""No wait is unbounded: a skipped collective times out, a dead peer is noticed, and neither
leaves anything of ours in /dev/shm."""

from harness.launch import our_segments, run_mpi


def test_skipped_collective_times_out_and_poisons():
    before = our_segments()
    run_mpi(2, "faults.py", "skip", timeout=60)
    assert our_segments() == before


def test_dead_peer_is_reported_quickly():
    before = our_segments()
    # Keep mpiexec from killing the survivor when the other rank exits early.
    run_mpi(2, "faults.py", "die", timeout=60, mpiexec_args=("-disable-auto-cleanup",))
    assert our_segments() == before


def test_broadcast_root_runs_ahead_and_checks_at_its_next_call():
    run_mpi(2, "faults.py", "skip_root", timeout=60)


def test_data_from_a_peer_that_disagreed_on_a_deferred_call_is_refused():
    run_mpi(2, "faults.py", "late_root", timeout=60)
