"""Revoke, agree and shrink on a communicator whose ranks are threads of this process
(Communicator.local: the same shared-memory board as between processes; ranks that die are
drilled in tests/ranks/test_elastic.py), and the file rendezvous of the elastic launcher."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pycollectives as pc
from pycollectives.runtime import bootstrap


def on_threads(comms, fn):
    with ThreadPoolExecutor(len(comms)) as pool:
        return list(pool.map(fn, comms))


def test_revoke_stops_the_waiting_ranks_and_shrink_keeps_everyone():
    comms = pc.Communicator.local(3, timeout=30)

    def rank(c):
        x = np.ones(1 << 12, np.float32)
        if c.rank == 0:
            time.sleep(0.3)
            c.revoke()
            took = 0.0
        else:
            t0 = time.monotonic()
            with pytest.raises(pc.CollectiveError, match="revoked by rank 0"):
                c.all_reduce(x)
            took = time.monotonic() - t0
        with pytest.raises(pc.CollectiveError, match="revoked"):  # and every later call
            c.broadcast(x)
        agreed = c.agree(0b110 if c.rank == 1 else 0b111)
        new = c.shrink()
        y = np.full(4, c.rank + 1.0)
        new.all_reduce(y)
        c.close()
        out = (took, agreed, new.size, new.previous_ranks, y.tolist())
        new.close()
        return out

    results = on_threads(comms, rank)
    assert max(r[0] for r in results) < 5, results  # the revocation, not the 30 s timeout
    assert all(r[1] == 0b110 for r in results)
    assert all(r[2] == 3 and r[3] == (0, 1, 2) and r[4] == [6.0] * 4 for r in results)


def test_agree_refuses_what_is_not_a_64_bit_flag():
    (comm,) = pc.Communicator.local(1)
    for bad in (-1, 2**64, 1.5, "1"):
        with pytest.raises(ValueError, match="agree takes an int"):
            comm.agree(bad)
    assert comm.agree(2**64 - 1) == 2**64 - 1
    comm.close()


def test_grow_needs_the_elastic_launcher(monkeypatch):
    monkeypatch.delenv("PYCOLL_RENDEZVOUS", raising=False)
    (comm,) = pc.Communicator.local(1)
    with pytest.raises(pc.CollectiveError, match="launch --elastic"):
        comm.grow()
    comm.close()


def test_file_group_exchanges_and_splits(tmp_path):
    def rank(r):
        g = bootstrap.FileGroup(tmp_path, r, 3, prefix="t", timeout=10)
        first = g.allgather(r * 10)
        part = g.split(r % 2, -r)  # ordered by key: highest rank first
        return first, g.allgather(str(r)), (part.rank, part.size, part.allgather(r))

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(rank, range(3)))
    assert all(r[0] == [0, 10, 20] and r[1] == ["0", "1", "2"] for r in results)
    assert results[0][2] == (1, 2, [2, 0]) and results[2][2] == (0, 2, [2, 0])
    assert results[1][2] == (0, 1, [1])


def test_file_group_names_the_ranks_that_never_came(tmp_path):
    g = bootstrap.FileGroup(tmp_path, 0, 3, prefix="t", timeout=0.2)
    with pytest.raises(pc.CollectiveError, match=r"rank\(s\) 1, 2 did not arrive within 0.2 s"):
        g.allgather(1)


def test_file_launch_reads_its_variables(tmp_path):
    env = {"PYCOLL_RENDEZVOUS": str(tmp_path), "PYCOLL_RANK": "1", "PYCOLL_WORLD_SIZE": "2"}
    assert bootstrap._file_launch(env) == (str(tmp_path), 1, 2)
    assert bootstrap._file_launch({}) is None
    assert bootstrap._file_launch({**env, "PYCOLL_JOIN": "1"}) is None  # joins instead
    with pytest.raises(pc.CollectiveError, match="out of range"):
        bootstrap._file_launch({**env, "PYCOLL_RANK": "2"})
    with pytest.raises(pc.CollectiveError, match="must be integers"):
        bootstrap._file_launch({**env, "PYCOLL_WORLD_SIZE": "two"})


def test_a_joiner_that_nobody_takes_in_times_out(tmp_path):
    with pytest.raises(pc.CollectiveError, match="did not take this process in within 0.2 s"):
        bootstrap.FileGroup.join(tmp_path, timeout=0.2)


def test_file_group_join_takes_its_place_from_the_admission(tmp_path):
    import json
    import os

    def admit():
        req = tmp_path / "join" / f"{os.getpid()}.req"
        while not req.exists():
            time.sleep(0.01)
        (tmp_path / "join" / f"{os.getpid()}.admit").write_text(
            json.dumps({"rank": 2, "size": 3, "prefix": "grow-x"})
        )

    threading.Thread(target=admit, daemon=True).start()
    g = bootstrap.FileGroup.join(tmp_path, timeout=10)
    assert (g.rank, g.size, g.prefix) == (2, 3, "grow-x")


def test_closing_a_revoked_communicator_drops_its_failed_work():
    comms = pc.Communicator.local(2, timeout=30)
    submitted = threading.Event()

    def rank(c):
        x = np.ones(1 << 12, np.float32)
        if c.rank == 0:
            assert submitted.wait(10)
            c.revoke()
            c.close()
            return None
        works = [c.all_reduce(x, async_op=True) for _ in range(3)]  # rank 0 never comes
        submitted.set()
        with pytest.raises(pc.CollectiveError, match="revoked"):
            works[0].wait()
        c.close()  # does not raise what the work in flight raised
        return None

    on_threads(comms, rank)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_global_batches_are_shared_whole_and_weighted_to_the_mean(world):
    sampler = pc.GlobalBatchSampler(100, 16, seed=3)
    assert sampler.per_pass == 6
    seen = []
    for step in range(6):  # one pass: disjoint batches
        batch = sampler.batch(step)
        shares = [sampler.share(step, r, world) for r in range(world)]
        assert np.array_equal(np.concatenate([s for s, _ in shares]), batch)
        assert sum(w for _, w in shares) == pytest.approx(world)  # average of weights is 1
        assert all(w == world * len(s) / 16 for s, w in shares)
        seen.extend(batch.tolist())
    assert len(set(seen)) == len(seen) == 96
    assert not np.array_equal(sampler.batch(0), sampler.batch(6))  # the next pass reshuffles
    with pytest.raises(ValueError, match="out of range"):
        sampler.share(0, world, world)
    with pytest.raises(ValueError, match="batch_size"):
        pc.GlobalBatchSampler(10, 11)


def test_data_parallel_rebinds_to_a_shrunk_communicator():
    comms = pc.Communicator.local(3, timeout=30)

    def rank(c):
        w = np.full(5, float(c.rank), np.float32)
        dp = pc.DataParallel(c, [w])
        assert np.all(w == 0)  # rank 0's
        c.revoke() if c.rank == 0 else None
        new = c.shrink()
        c.close()
        w[...] = new.rank  # rebind broadcasts rank 0's parameters
        dp.rebind(new)
        assert np.all(w == 0) and dp.comm is new
        dp.grads[0][...] = new.rank + 1
        dp.mark_ready(0)
        dp.synchronize()
        out = dp.grads[0].copy()
        new.close()
        return out

    for got in on_threads(comms, rank):
        assert np.all(got == 2.0), got  # the average of 1, 2, 3
