"""The cost model (pycollectives.cost_model): counts from the schedules, composition,
calibration."""

import pytest

from pycollectives import _C, cost_model
from pycollectives.ops import ALGORITHMS_FOR

FLAT = [
    (a, c)
    for c in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
    for a in ALGORITHMS_FOR[c]
]


# An independent reading of the step kinds (the model takes them from the schedule code).
INCOMING = {
    "recv",
    "recv_reduce_send",
    "recv_reduce_copy",
    "recv_reduce_copy_send",
    "recv_copy_send",
}
OUTGOING = {"send", "recv_reduce_send", "recv_reduce_copy_send", "recv_copy_send"}
REDUCING = {"recv_reduce_send", "recv_reduce_copy", "recv_reduce_copy_send"}


def direct_counts(algorithm, collective, n, count, piece, bcast_once):
    """Busiest-rank counts computed straight from the schedule dicts."""
    worst = [0, 0, 0, 0]
    for r in range(n):
        steps = messages = sent = reduced = 0
        for s in _C.schedule(algorithm, collective, r, n, count, 0, piece=piece):
            b = 4 * s["count"]
            incoming = 0
            if s["kind"] in INCOMING:
                incoming = (n - 1) if s["from"] == _C.ALL_PEERS else 1 + (s["from2"] >= 0)
                steps += 1
            if s["kind"] in OUTGOING:
                k = (n - 1) if s["to"] == _C.ALL_PEERS else 1 + (s["to2"] >= 0)
                messages += k
                sent += b * (1 if s["to"] == _C.ALL_PEERS and bcast_once else k)
            if s["kind"] in REDUCING:
                reduced += b * incoming
        worst = [max(a, b) for a, b in zip(worst, (steps, messages, sent, reduced))]
    return worst


@pytest.mark.parametrize("algorithm,collective", FLAT)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_counts_match_schedules(algorithm, collective, n):
    for count, piece in ((0, 8), (7, 2), (1000, 64)):
        c = cost_model.schedule_costs(algorithm, collective, n, count, piece, bcast_once=True)
        want = direct_counts(algorithm, collective, n, count, piece, bcast_once=True)
        assert [c.steps, c.messages, c.bytes_sent, c.bytes_reduced] == want


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_reduce_closed_form(n):
    count = 96 * n
    c = cost_model.schedule_costs("ring", "all_reduce", n, count, piece=count)
    assert c.bytes_sent == 2 * (n - 1) * count // n * 4  # 2(n-1)/n of the vector, float32
    assert c.steps == 2 * (n - 1)  # the busiest rank waits for a message 2(n-1) times
    assert c.bytes_reduced == (n - 1) * count // n * 4


@pytest.mark.parametrize("algorithm,collective", FLAT)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_simulation_finishes(algorithm, collective, n):
    link = cost_model.Link(alpha=1e-6, beta=1e9, gamma=1e-10, piece_bytes=1024)
    t = cost_model.simulate(algorithm, collective, n, 40_000, lambda r, q: link, link.piece_bytes)
    assert (t > 0) == (n > 1)


def test_hierarchical_is_the_sum_of_its_phases():
    m = cost_model.H100
    nbytes, N, L = 64 << 20, 4, 8
    shard = nbytes // L
    inter = cost_model.Machine(m.inter, m.inter)
    want = (
        cost_model.predict("reduce_scatter", "ring", shard, 1, L, m)
        + cost_model.predict("all_reduce", "ring", shard, 1, N, inter)
        + cost_model.predict("all_gather", "ring", shard, 1, L, m)
    )
    assert cost_model.predict("all_reduce", "hierarchical", nbytes, N, L, m) == pytest.approx(want)
    tree = cost_model.predict("all_reduce", "hierarchical:tree", nbytes, N, L, m)
    assert tree != pytest.approx(want)


def test_estimate_agrees_with_simulation():
    # The estimate (used above 16 ranks) against the event simulation where both run.
    link = cost_model.Link(alpha=2e-6, beta=10e9, gamma=1e-11, piece_bytes=256 << 10)
    for algorithm in ("ring", "tree"):
        for n in (8, 16):
            for nbytes in (8, 1 << 20, 64 << 20):
                sim = cost_model.simulate(algorithm, "all_reduce", n, nbytes, lambda r, q: link,
                                     link.piece_bytes)  # fmt: skip
                est = cost_model.estimate(algorithm, "all_reduce", n, nbytes, link)
                if algorithm == "ring":
                    assert est == pytest.approx(sim, rel=0.35), (algorithm, n, nbytes)
                else:  # optimistic: the pieces of both trees overlapping perfectly
                    assert sim / 4 <= est <= sim * 1.1, (algorithm, n, nbytes)


def test_reproduces_calibration_measurements():
    # pycollectives/cost_model_calibration.json: our ring all-reduce measured on this machine
    # (shared memory, and MPI between two emulated nodes), 8 B - 32 MiB, and the fitted links.
    rows = cost_model.calibration_check(cost_model.load_calibration())
    assert len(rows) >= 20
    bad = [(p["link"], p["bytes"], f"{err:+.0%}") for p, _, _, err in rows if abs(err) > 0.25]
    assert not bad, bad


def test_h100_against_published_nccl():
    busbw, latency_us = cost_model.nccl_check()
    lo, hi = cost_model.NCCL_H100_BUSBW_GBS
    assert busbw == pytest.approx((lo + hi) / 2, rel=0.15)
    assert latency_us == pytest.approx(cost_model.NCCL_H100_SMALL_LATENCY_US, rel=0.3)


def test_scaling_table_shapes():
    rows = cost_model.scaling(cost_model.H100, sizes=(8, 1 << 30), max_gpus=64)
    assert [r["gpus"] for r in rows[::2]] == [8, 16, 32, 64]
    big = {r["gpus"]: r for r in rows if r["bytes"] == 1 << 30}
    # Across nodes, hierarchical all-reduce keeps NVLink busy where a flat ring is NIC-bound.
    assert big[64]["hierarchical_busbw"] > 2 * big[64]["ring_busbw"]
