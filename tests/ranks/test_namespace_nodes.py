"""The multi-node paths on nodes that share nothing but a network: each node Linux network,
mount, UTS, IPC and PID namespaces with its own address, /dev/shm, /sys, boot id and host name
(harness/netns.py). No PYCOLL_RANKS_PER_NODE or PYCOLL_HOST_ID: the nodes are found as on a
cluster, mpiexec runs across them through hydra's ssh launcher and torchrun runs one agent per
node. Every byte between nodes crosses the veth pairs (checked on their counters).

Where namespaces cannot be made (not root, unshare fails, PYCOLL_TEST_NO_NAMESPACES=1), the
namespace tests skip with the reason and test_emulated_nodes_instead runs the same workers on
emulated nodes (the rest of the emulated cases are in test_hierarchy.py, test_env_nodes.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import netns
from harness.launch import (
    TWO_NODES,
    clean_env,
    free_port,
    mpiexec,
    rank_errors,
    run_mpi,
    with_harness,
    worker_path,
)

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def namespace_nodes():
    """3 namespace nodes for the whole session (a test uses the first k); skips, saying why,
    where they cannot be made."""
    why_not = netns.available()
    if why_not is not None:
        pytest.skip(f"namespace nodes unavailable ({why_not}): emulated nodes only")
    with netns.NamespaceNodes(3) as made:
        yield made


def run_across(nodes, per_node: list, worker: str, *args, env=None, timeout: float = 120):
    """`worker` under mpiexec with per_node[i] ranks on node i (and `env`); its stdout and the
    bytes each node's interface carried meanwhile. A rank's failure fails the test with its
    report."""
    env = with_harness({**os.environ, **nodes.env(), "PYCOLL_TIMEOUT": "60",
                        "PYTHONUNBUFFERED": "1", **(env or {})})  # fmt: skip
    for name in ("PYCOLL_RANKS_PER_NODE", "PYCOLL_HOST_ID"):
        env.pop(name, None)
    cmd = [mpiexec(), *nodes.mpiexec_args(per_node), "-n", str(sum(per_node)), sys.executable,
           str(worker_path(worker)), *args]  # fmt: skip
    before = [nodes.veth_bytes(i) for i in range(nodes.n)]
    with tempfile.TemporaryDirectory(prefix="pycoll-job-") as results:
        env["TEST_RESULTS_DIR"] = results
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            errors = "".join(f"\n  {line}" for line in rank_errors(Path(results)))
            pytest.fail(f"{worker} {' '.join(args)} on nodes of {per_node} ranks exited with "
                        f"{done.returncode}{errors}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}",
                        pytrace=False)  # fmt: skip
    crossed = [nodes.veth_bytes(i) - b for i, b in enumerate(before)]
    return done.stdout, crossed


# Messages between nodes in many pieces (as test_hierarchy.py runs them).
SMALL_PIECES = {"PYCOLL_NET_PIECE_BYTES": "256"}
# 2 x 2, 3 x 2, 2 x 3 and nodes of 2, 1 and 2 ranks.
PLACEMENTS = [[2, 2, 0], [2, 2, 2], [3, 3, 0], [2, 1, 2]]


def placement(per_node) -> str:
    return "+".join(str(c) for c in per_node if c)


@pytest.mark.parametrize("per_node", PLACEMENTS, ids=placement)
def test_nodes_are_found_and_share_no_memory(namespace_nodes, per_node):
    # The communicator's nodes and MPI's COMM_TYPE_SHARED split are the host names (pcn0..);
    # a file in one node's /dev/shm is seen on that node alone; every segment a rank maps
    # lies on its node's own /dev/shm; an all-reduce of 1 MiB a rank and messages between
    # the nodes against MPI, and those bytes on the veth pairs: each node in the job sends
    # and receives its node's 1 MiB partial sum at least, an idle node next to nothing.
    out, crossed = run_across(namespace_nodes, per_node, "namespace_nodes.py",
                              str(sum(1 for p in per_node if p)))  # fmt: skip
    hosts = dict(re.findall(r"rank (\d+) on (pcn\d) ok", out))
    node_of = [i for i, c in enumerate(per_node) for _ in range(c)]  # hydra's order
    want = {str(r): f"pcn{i}" for r, i in enumerate(node_of)}
    assert hosts == want, out
    for i, c in enumerate(per_node):
        assert (crossed[i] > 2 << 20) if c else (crossed[i] < 1 << 16), (per_node, crossed)


COLLECTIVE_CASES = [
    # 2 x 2 ([[0, 1], [2, 3]], checked on that placement above)
    ([2, 2, 0], "all_reduce"), ([2, 2, 0], "all_gather"), ([2, 2, 0], "broadcast"),
    # 3 x 2 and 2 x 3
    ([2, 2, 2], "reduce_scatter"), ([3, 3, 0], "all_gather"),
    # nodes of 2, 1 and 2 ranks
    ([2, 1, 2], "reduce"),
]  # fmt: skip


@pytest.mark.parametrize(("per_node", "collective"), COLLECTIVE_CASES,
                         ids=[f"{placement(p)}-{c}" for p, c in COLLECTIVE_CASES])  # fmt: skip
def test_hierarchical_collectives_against_mpi(namespace_nodes, per_node, collective):
    # collectives.py unchanged: every dtype, op, root and count of the communicator's own
    # choice (hierarchical) against numpy and MPI, with tiny staging slots.
    out, crossed = run_across(namespace_nodes, per_node, "collectives.py", collective, "small",
                              "auto", env=SMALL_PIECES)  # fmt: skip
    assert f"{collective} auto ranks={sum(per_node)}" in out, out
    assert all(b > 0 for b, c in zip(crossed, per_node) if c), crossed


def test_splits_and_messages_under_mpiexec(namespace_nodes):
    cases = ("split", "random_splits", "messages")
    out, _ = run_across(namespace_nodes, [2, 2, 0], "nodes.py", ",".join(cases),
                        env=SMALL_PIECES)  # fmt: skip
    for case in cases:
        for r in range(4):
            assert f"rank {r} ok {case}" in out, out


def test_torchrun_one_agent_per_node(namespace_nodes):
    # torchrun on each of 2 nodes, 2 ranks each, meeting in a c10d rendezvous on node 0's
    # address: shared memory inside each node, gloo between them over the veths. Each agent's
    # ranks print on its own output: one node's are 0 and 1, the other's 2 and 3, and
    # nodes.py checks the communicator's nodes against the host names.
    pytest.importorskip("torch")
    nodes = namespace_nodes
    endpoint = f"{nodes.address(0)}:{free_port()}"
    cases = "split,random_splits,messages"
    before = [nodes.veth_bytes(i) for i in range(2)]
    agents = []
    for i in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", f"pycoll-{os.getpid()}", worker_path("nodes.py"), cases]  # fmt: skip
        agents.append(nodes.run(i, argv, env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True))  # fmt: skip
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
    ranks = [sorted({int(r) for r in re.findall(r"rank (\d+) ok", o)}) for o in outs]
    assert sorted(ranks) == [[0, 1], [2, 3]], outs
    every = "".join(outs)
    for case in cases.split(","):
        for r in range(4):
            assert f"rank {r} ok {case}" in every, every
    assert all(nodes.veth_bytes(i) > b for i, b in enumerate(before))


def test_emulated_nodes_instead():
    # The fallback: where namespace nodes cannot be made, the same workers on emulated nodes
    # (PYCOLL_RANKS_PER_NODE=2 under mpiexec: 2 x 2), so that this file still runs the
    # multi-node paths.
    why_not = netns.available()
    if why_not is None:
        pytest.skip("namespace nodes available: the namespace variants ran instead")
    out = run_mpi(4, "collectives.py", "all_reduce", "small", "auto", env=TWO_NODES)
    assert "all_reduce auto ranks=4" in out, out


def test_without_namespaces_the_tests_skip_saying_why():
    # PYCOLL_TEST_NO_NAMESPACES=1 takes the "unavailable" path: in a pytest of this file, a
    # namespace test skips naming the reason and the emulated variant runs and passes.
    assert netns.available() is None or pytest.skip(f"unavailable anyway: {netns.available()}")
    env = {**os.environ, "PYCOLL_TEST_NO_NAMESPACES": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k",
         "2+2-all_reduce or emulated_nodes_instead", __file__],
        capture_output=True, text=True, env=env, cwd=TESTS, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout, done.stdout
    assert "namespace nodes unavailable (PYCOLL_TEST_NO_NAMESPACES is set)" in done.stdout
