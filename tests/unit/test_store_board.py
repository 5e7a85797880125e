"""The fault-tolerant board over a store (runtime/store_board.py), its ranks as threads over one
TCPStore of this process, each with a client of its own: who is taken for dead (a tombstone, a
still heartbeat), the same round on every survivor, a rank taken for dead refused, a revocation
seen by every board, and a survivors' group that sees a lost member alike."""

from __future__ import annotations

import time

import pytest
from harness.unit import on_threads

from pycollectives.errors import CollectiveError
from pycollectives.runtime import store_board
from pycollectives.runtime.store_board import BoardStoreGroup, StoreBoard

# Instances on a machine that is not this one: no process check, only the store's signs.
INSTANCES = ["elsewhere|101", "elsewhere|102", "elsewhere|103"]


@pytest.fixture
def stores():
    torch_dist = pytest.importorskip("torch.distributed")
    server = torch_dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    clients = [torch_dist.TCPStore("127.0.0.1", server.port, 4, False) for _ in range(3)]
    yield server, clients


def boards(clients, prefix="t", on_revoke=None) -> list:
    return [StoreBoard(c, prefix, r, INSTANCES, 10.0, on_revoke) for r, c in enumerate(clients)]


def test_a_rank_with_a_tombstone_is_left_out_at_once_and_refused_later(stores):
    server, clients = stores
    b = boards(clients)
    server.set(store_board.tombstone_key(INSTANCES[2]), "exited")
    t0 = time.monotonic()
    got = on_threads([lambda: b[0].board_exchange(6, b"a"), lambda: b[1].board_exchange(3, b"b")])
    assert time.monotonic() - t0 < 0.5  # the tombstone, not the heartbeat's second
    assert got[0] == got[1] == [(0, 6, b"a"), (1, 3, b"b")], got
    with pytest.raises(CollectiveError, match="rank 2 was taken for dead"):
        b[2].board_exchange(7)
    # Dead for good: the next round leaves it out without looking again.
    got = on_threads([lambda: b[0].board_exchange(1), lambda: b[1].board_exchange(1)])
    assert got[0] == got[1] == [(0, 1, b""), (1, 1, b"")], got
    for x in b:
        x.close()


def test_a_still_heartbeat_is_death_after_its_limit(stores, monkeypatch):
    monkeypatch.setenv("PYCOLL_HEARTBEAT_TIMEOUT", "0.3")
    _, clients = stores
    b = boards(clients)
    t0 = time.monotonic()
    got = on_threads([lambda: b[0].board_exchange(1), lambda: b[1].board_exchange(1)])
    took = time.monotonic() - t0
    assert got[0] == got[1] == [(0, 1, b""), (1, 1, b"")], got
    assert 0.3 <= took < 3, took
    for x in b:
        x.close()


def test_a_late_rank_that_is_alive_is_waited_for(stores):
    _, clients = stores
    b = boards(clients)

    def late():
        time.sleep(0.4)
        return b[2].board_exchange(4)

    got = on_threads([lambda: b[0].board_exchange(7), lambda: b[1].board_exchange(5), late])
    # 0.4 s of silence is within the heartbeat's limit (1 s): it is waited for, and every
    # rank holds the same round.
    assert got[0] == got[1] == got[2] == [(0, 7, b""), (1, 5, b""), (2, 4, b"")], got
    for x in b:
        x.close()


def test_a_revocation_reaches_every_board(stores):
    _, clients = stores
    seen = []
    b = boards(clients, on_revoke=lambda by: seen.append((time.monotonic(), by)))
    t0 = time.monotonic()
    b[1].revoke()
    deadline = t0 + 2
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(seen) == 3 and all(x.revoked for x in b), seen
    assert [by for _, by in seen] == [1, 1, 1], seen
    assert max(t for t, _ in seen) - t0 < 0.5, [t - t0 for t, _ in seen]
    for x in b:
        x.close()


def test_a_revocation_names_the_first_revoker_whoever_revokes_after(stores):
    # Survivors revoke in turn once they see a revocation (their recovery does); a rank whose
    # heartbeat thread looks only after that must still name the first (it named the last).
    _, clients = stores
    seen = []
    b = boards(clients[:2], on_revoke=lambda by: seen.append(by))
    b[1].revoke()
    b[0].revoke()
    late = StoreBoard(clients[2], "t", 2, INSTANCES, 10.0, seen.append)
    deadline = time.monotonic() + 2
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert seen == [1, 1, 1], seen
    for x in [*b, late]:
        x.close()


def test_a_survivors_group_sees_a_lost_member_alike(stores):
    server, clients = stores
    groups = [BoardStoreGroup(c, INSTANCES, [0, 1, 2], r, "g", 10.0) for r, c in enumerate(clients)]
    assert on_threads([lambda g=g: g.allgather(g.rank) for g in groups]) == [[0, 1, 2]] * 3
    server.set(store_board.tombstone_key(INSTANCES[1]), "exited")
    got = on_threads([lambda: groups[0].allgather("x"), lambda: groups[2].allgather("x")])
    for e in got:
        assert isinstance(e, CollectiveError) and "rank(s) [1] exited" in str(e), got
    assert groups[0].lost and groups[2].lost
    for g in groups:
        g.free()
