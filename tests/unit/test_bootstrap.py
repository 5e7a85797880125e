"""Launch variables of env:// launches, checked before any rendezvous."""

from __future__ import annotations

from functools import partial

import pytest
from harness.unit import on_threads

from pycollectives.errors import CollectiveError
from pycollectives.runtime import bootstrap


def test_env_launch_variables_are_checked():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert bootstrap._env_launch({}) is None
    assert bootstrap._env_launch(env) == (0, 2, "h", 1)
    with pytest.raises(CollectiveError, match="MASTER_PORT not"):
        bootstrap._env_launch({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(CollectiveError, match="out of range"):
        bootstrap._env_launch({**env, "RANK": "2"})
    with pytest.raises(CollectiveError, match="integers"):
        bootstrap._env_launch({**env, "WORLD_SIZE": "two"})


def _store_groups(n: int, timeout: float):
    """`n` StoreGroups over one TCPStore of this process, each with a client of its own."""
    torch_dist = pytest.importorskip("torch.distributed")
    server = torch_dist.TCPStore("127.0.0.1", 0, n + 1, True, wait_for_workers=False)
    clients = [torch_dist.TCPStore("127.0.0.1", server.port, n + 1, False) for _ in range(n)]
    return server, [bootstrap.StoreGroup(r, n, c, "t", timeout) for r, c in enumerate(clients)]


def _each(groups, fn) -> list:
    """fn(group) on a thread per group: what each returned or raised."""
    return on_threads([partial(fn, g) for g in groups])


def test_store_exchanges_are_bounded_and_name_who_did_not_come():
    import time

    from pycollectives.errors import CollectiveTimeout

    server, groups = _store_groups(3, timeout=0.5)
    # Every rank comes: a split by parity, ranked by key.
    parts = _each(groups, lambda g: g.split(g.rank % 2, -g.rank))
    assert [(p.rank, p.size) for p in parts] == [(1, 2), (0, 1), (0, 2)]
    # The last rank never comes to a split: the others name it within the timeout.
    t0 = time.monotonic()
    got = _each(groups[:2], lambda g: g.split(0, g.rank))
    for e in got:
        assert isinstance(e, CollectiveTimeout), e
        assert "split: rank(s) [2] did not come within 0.5 s" in str(e), e
    assert time.monotonic() - t0 < 5
    # Ranks at different exchanges raise instead of pairing a split with a rendezvous.
    _, groups = _store_groups(2, timeout=5)
    got = _each(groups, lambda g: g.split(0, 0) if g.rank == 0 else g.allgather(1))
    assert all(isinstance(e, CollectiveError) and "ranks disagree" in str(e) for e in got), got
    del server
