"""The multi-node paths on nodes that share nothing but a network: each node a Linux network,
mount and UTS namespace with its own address, /dev/shm and host name (harness/netns.py). No
PYCOLL_RANKS_PER_NODE or PYCOLL_HOST_ID: the nodes are found as on a cluster, mpiexec runs
across them through hydra's ssh launcher and torchrun runs one agent per node. Where namespaces
cannot be made (not root), these tests skip with the reason; the emulated nodes
(test_hierarchy.py, test_env_nodes.py, ...) still run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import netns
from harness.launch import clean_env, free_port, mpiexec, rank_errors, with_harness, worker_path


@pytest.fixture(scope="module")
def nodes():
    why_not = netns.available()
    if why_not is not None:
        pytest.skip(f"namespace nodes unavailable ({why_not}): emulated nodes only")
    with netns.NamespaceNodes(3) as made:
        yield made


def run_across(nodes, per_node: list, worker: str, *args, timeout: float = 120) -> str:
    """`worker` under mpiexec with per_node[i] ranks on node i; its stdout. A rank's failure
    fails the test with what that rank reported."""
    env = with_harness({**os.environ, **nodes.env(), "PYCOLL_TIMEOUT": "60",
                        "PYCOLL_NET_PIECE_BYTES": "256", "PYTHONUNBUFFERED": "1"})  # fmt: skip
    for name in ("PYCOLL_RANKS_PER_NODE", "PYCOLL_HOST_ID"):
        env.pop(name, None)
    cmd = [mpiexec(), *nodes.mpiexec_args(per_node), "-n", str(sum(per_node)), sys.executable,
           str(worker_path(worker)), *args]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pycoll-job-") as results:
        env["TEST_RESULTS_DIR"] = results
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            errors = "".join(f"\n  {line}" for line in rank_errors(Path(results)))
            pytest.fail(f"{worker} {' '.join(args)} on nodes of {per_node} ranks exited with "
                        f"{done.returncode}{errors}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}",
                        pytrace=False)  # fmt: skip
    return done.stdout


# 2 x 2, 3 x 2, 2 x 3 and nodes of 2, 1 and 2 ranks.
PLACEMENTS = [[2, 2, 0], [2, 2, 2], [3, 3, 0], [2, 1, 2]]


@pytest.mark.parametrize("per_node", PLACEMENTS, ids=lambda p: "+".join(map(str, p)))
def test_nodes_are_found_and_share_no_memory(nodes, per_node):
    # The nodes are the host names; a file in one node's /dev/shm is seen on that node alone;
    # every segment a rank maps lies on its node's own /dev/shm; an all-reduce and messages
    # between the nodes against MPI.
    out = run_across(nodes, per_node, "namespace_nodes.py", str(sum(1 for p in per_node if p)))
    for r in range(sum(per_node)):
        assert f"rank {r} on pcn" in out, out


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather",
                                        "broadcast", "reduce"])  # fmt: skip
def test_hierarchical_collectives_against_mpi(nodes, collective):
    # Every dtype, op, root and count against numpy and MPI, on nodes of 2, 1 and 2 ranks.
    out = run_across(nodes, [2, 1, 2], "collectives.py", collective, "small", "auto")
    assert f"{collective} auto ranks=5" in out, out


def test_splits_and_messages_under_mpiexec(nodes):
    cases = ("split", "random_splits", "messages")
    out = run_across(nodes, [2, 2, 0], "nodes.py", ",".join(cases))
    for case in cases:
        for r in range(4):
            assert f"rank {r} ok {case}" in out, out


def test_torchrun_one_agent_per_node(nodes):
    # torchrun on each of 2 nodes, 2 ranks each, meeting at node 0's address: shared memory
    # inside each node, gloo between them over the store.
    pytest.importorskip("torch")
    port = str(free_port())
    cases = "split,random_splits,messages"
    agents = []
    for i in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--node-rank", str(i), "--master-addr",
                nodes.address(0), "--master-port", port, worker_path("nodes.py"),
                cases]  # fmt: skip
        agents.append(subprocess.Popen(nodes.command(i, argv), env=clean_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))  # fmt: skip
    deadline = time.monotonic() + 180
    outs = []
    for a in agents:
        try:
            out, err = a.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            pytest.fail("torchrun agents did not finish in 180 s", pytrace=False)
        assert a.returncode == 0, f"agent exited with {a.returncode}: {err[-3000:]}"
        outs.append(out)
    every = "".join(outs)
    for case in cases.split(","):
        for r in range(4):
            assert f"rank {r} ok {case}" in every, every


def test_without_namespaces_the_reason_is_given(monkeypatch):
    monkeypatch.setenv("PYCOLL_TEST_NO_NAMESPACES", "1")
    assert netns.available() == "PYCOLL_TEST_NO_NAMESPACES is set"
