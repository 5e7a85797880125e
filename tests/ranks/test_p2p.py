"""Point-to-point send/recv on the shared-memory transport (see workers/p2p.py): every dtype and
size against mpi4py's Send/Recv, tag semantics, progress, mismatches, faults, bad arguments."""

import pytest
from harness.launch import our_segments, run_mpi


@pytest.mark.parametrize("nranks", [pytest.param(2, marks=pytest.mark.quick), 3, 5])
def test_p2p_matches_mpi(nranks):
    run_mpi(nranks, "p2p.py", "matrix", timeout=120)


def test_p2p_direct_writes_match_mpi():
    # From 64 KiB up (the default is 4 MiB) messages are written straight into the receiver's
    # buffer.
    run_mpi(2, "p2p.py", "matrix", env={"PYCOLL_P2P_DIRECT_BYTES": "65536"}, timeout=120)


def test_p2p_slot_fallback_when_direct_writes_are_refused():
    # "fail": the kernel's refusal of process_vm_writev is simulated; data goes through slots.
    out, err = run_mpi(
        2,
        "p2p.py",
        "matrix",
        env={"PYCOLL_P2P_CMA": "fail", "PYCOLL_P2P_DIRECT_BYTES": "65536", "PYCOLL_DEBUG": "INFO"},
        with_stderr=True,
        timeout=120,
    )
    assert "direct writes to rank 1 refused" in err and "using the staging slots" in err


def test_p2p_semantics_and_debug_log():
    out, err = run_mpi(3, "p2p.py", "semantics", env={"PYCOLL_DEBUG": "INFO"}, with_stderr=True)
    assert "rank 0/3: p2p send to rank 1 (tag 1, 12288 x int32) async" in err


@pytest.mark.parametrize("eager_bytes", ["4096", "0"])
def test_p2p_eager_matched_unexpected_and_mixed_with_rendezvous(eager_bytes):
    # "0": every non-empty message waits for its request, as a reference for the same checks.
    env = {"PYCOLL_P2P_EAGER_BYTES": eager_bytes}
    run_mpi(2, "p2p.py", "eager", env=env, timeout=120)


def test_p2p_eager_mismatch_from_unexpected_queue_raises_on_both_ranks():
    run_mpi(2, "p2p.py", "mismatch-late", timeout=60)


@pytest.mark.parametrize("eager_bytes", ["4096", "0"])
@pytest.mark.parametrize("field", ["size", "dtype"])
def test_p2p_mismatch_raises_on_both_ranks(field, eager_bytes):
    run_mpi(2, "p2p.py", f"mismatch-{field}", env={"PYCOLL_P2P_EAGER_BYTES": eager_bytes})


def test_p2p_missing_sender_times_out():
    run_mpi(2, "p2p.py", "timeout", env={"PYCOLL_TIMEOUT": "2"}, timeout=60)


def test_p2p_dead_peer_mid_transfer():
    before = our_segments()
    run_mpi(
        2,
        "p2p.py",
        "dead",
        env={"PYCOLL_P2P_CMA": "0"},
        mpiexec_args=("-disable-auto-cleanup",),
        timeout=60,
    )
    assert our_segments() == before


def test_p2p_bad_arguments_move_nothing():
    run_mpi(2, "p2p.py", "args", timeout=60)


@pytest.mark.parametrize("nranks,per_node", [(4, "2"), (6, "3")])
def test_p2p_across_nodes_matches_mpi(nranks, per_node):
    env = {"PYCOLL_RANKS_PER_NODE": per_node}
    run_mpi(nranks, "p2p.py", "matrix", env=env, timeout=180)


def test_p2p_semantics_across_nodes():
    # Cyclic nodes {0, 2} and {1, 3}: the pairs 0-1 the test drives are on different nodes.
    env = {"PYCOLL_RANKS_PER_NODE": "2:cyclic"}
    run_mpi(4, "p2p.py", "semantics", env=env, timeout=120)


@pytest.mark.parametrize("nranks", [4, 6])
def test_p2p_progresses_on_its_own_across_nodes(nranks):
    # 2 x 2 and 3 x 2 nodes: isends received in the other order, several messages in flight
    # received and waited for in every order, one tag overtaking nothing, two-way batches,
    # point-to-point beside collectives in flight, objects; each phase far below the timeout.
    env = {"PYCOLL_RANKS_PER_NODE": "2"}
    run_mpi(nranks, "p2p.py", "progress", env=env, timeout=120)


def test_inter_node_engine_alone():
    # _net.NetP2P on MPI_COMM_WORLD: messages in blocks and a tail, any order of waits,
    # tags past MPI's bound, a mismatch that leaves the array alone, timeout, abort, close.
    run_mpi(2, "p2p.py", "engine", timeout=60)


@pytest.mark.parametrize("case", ["eager", "mismatch-late", "timeout", "args-across"])
def test_p2p_semantics_on_one_node_hold_across_nodes(case):
    # One rank per node: every message crosses MPI. Many messages waiting unreceived, one tag
    # in order across sizes; a mismatch met late; a recv whose sender never comes; bad ops
    # refused before anything moves.
    env = {"PYCOLL_RANKS_PER_NODE": "1"}
    if case == "timeout":
        env["PYCOLL_TIMEOUT"] = "2"
    run_mpi(2, "p2p.py", case, env=env, timeout=60)


@pytest.mark.parametrize("field", ["size", "dtype"])
def test_p2p_mismatch_across_nodes_raises_on_both_ranks(field):
    env = {"PYCOLL_RANKS_PER_NODE": "1"}
    run_mpi(2, "p2p.py", f"mismatch-{field}", env=env, timeout=60)


# send/recv of GPU arrays, staged through host memory, with host memory standing in for the
# GPU's and a fake CUDA module whose copies run only when their stream does (no GPU needed).
@pytest.mark.parametrize(
    "case,nranks", [("matrix", 2), ("matrix", 3), ("semantics", 2), ("mismatch", 2), ("bad", 2)]
)
def test_gpu_send_recv_staged_through_host_memory(case, nranks):
    run_mpi(nranks, "p2p_gpu_staged.py", case, timeout=180)
