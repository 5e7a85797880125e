"""Drills for a rank that dies while the others carry on: revoke, agree, shrink, grow.

Usage: python -m pycollectives.launch -n N --elastic [--replace K] -- python elastic.py DRILL

Every rank that finishes writes what it saw to $DRILL_RESULTS/rank-<pid>.json (the test
checks those: a rank that fails an assertion dies like a killed one, and the elastic launcher
carries on without it). A rank told to die kills itself with SIGKILL, as a crash would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

import pycollectives as pc
from pycollectives.runtime import bootstrap
from pycollectives.runtime.store_board import BoardStoreGroup

VICTIM = 2  # the rank that dies


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def reference_sum(size: int, n: int, salt: int = 0) -> np.ndarray:
    return sum(np.arange(n, dtype=np.float64) * (r + 1 + salt) for r in range(size))


def check_new(comm, old_size: int, lost: list) -> dict:
    """The survivors' communicator: its size and order, then an all-reduce and a message
    around the ring on it, against numpy."""
    survivors = [r for r in range(old_size) if r not in lost]
    assert comm.size == len(survivors), (comm.size, survivors)
    assert list(comm.previous_ranks) == survivors, comm.previous_ranks
    x = np.arange(100_000, dtype=np.float64) * (comm.rank + 1)
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, reference_sum(comm.size, 100_000))
    out = np.empty(10, np.int64)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    comm.batch_p2p([pc.P2POp("send", np.full(10, comm.rank), right),
                    pc.P2POp("recv", out, left)])  # fmt: skip
    assert np.all(out == left), out
    return {"size": comm.size, "previous_ranks": list(comm.previous_ranks)}


def until_failure(comm, step):
    """Runs step() until it raises CollectiveError (bounded): (the error, seconds from the
    first call that failed to its raising)."""
    for _ in range(100_000):
        t0 = time.monotonic()
        try:
            step()
        except pc.CollectiveError as e:
            return e, time.monotonic() - t0
    raise AssertionError("no failure seen")


def recover(comm, error) -> tuple:
    """What a survivor does: revoke, shrink (timed), agree on the new communicator."""
    comm.revoke()
    t0 = time.monotonic()
    new = comm.shrink()
    took = time.monotonic() - t0
    assert new.agree(3) == 3
    comm.close()
    return new, {"error": str(error), "shrink_s": took}


def killed_in(kind: str):
    """The victim dies while everyone is in (or between) collectives of `kind`; the
    survivors see it, revoke, shrink, and go on."""
    comm = pc.Communicator(timeout=30)
    n = comm.size
    big = np.ones(1 << 20, np.float32)
    if comm.rank == VICTIM:
        if kind == "between":
            comm.all_reduce(big)
            die()
        threading.Timer(0.2, die).start()  # mid-collective: the loop below is under way
    if kind == "p2p":
        right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
        buf = np.empty_like(big)

        def step():
            comm.batch_p2p([pc.P2POp("send", big, right), pc.P2POp("recv", buf, left)])
    else:
        whole = np.ones(4096 * n, np.float32) if comm.rank == 0 else None  # gather, scatter
        op = {"all_reduce": lambda: comm.all_reduce(big),
              "between": lambda: comm.all_reduce(big),
              "all_gather": lambda: comm.all_gather(big[:4096], np.empty(4096 * n, np.float32)),
              "broadcast": lambda: comm.broadcast(big, root=0),
              "reduce_scatter": lambda: comm.reduce_scatter(big, np.empty(len(big) // n,
                                                                          np.float32)),
              "all_to_all": lambda: comm.all_to_all(big[: 1024 * n],
                                                    np.empty(1024 * n, np.float32)),
              "barrier": lambda: comm.barrier(),
              "reduce": lambda: comm.reduce(big, np.empty_like(big), root=0),
              "gather": lambda: comm.gather(big[:4096], whole, root=0),
              "scatter": lambda: comm.scatter(whole, np.empty(4096, np.float32), root=0),
              }[kind]  # fmt: skip

        def step():
            op()

    error, _ = until_failure(comm, step)
    new, result = recover(comm, error)
    result.update(check_new(new, n, [VICTIM]))
    new.close()
    return result


def second_dies_in_shrink():
    """The victim dies mid-collective; then rank 1 dies inside shrink, after the survivors'
    first agreement (it takes part in it) and before the new communicator is made: the
    others leave it out too, in a second try."""
    comm = pc.Communicator(timeout=30)
    n = comm.size
    if comm.rank == 1:  # on one machine the shared-memory board's group, else the store's

        def dying(self, *args):
            die()

        bootstrap.BoardGroup.allgather = dying
        BoardStoreGroup._exchange = dying
    if comm.rank == VICTIM:
        threading.Timer(0.2, die).start()
    big = np.ones(1 << 20, np.float32)
    error, _ = until_failure(comm, lambda: comm.all_reduce(big))
    new, result = recover(comm, error)
    result.update(check_new(new, n, [1, VICTIM]))
    new.close()
    return result


def revoke_reaches_the_blocked():
    """Rank 0 never enters the all-reduce the others wait in, and revokes instead: they
    raise at once, not after the timeout (30 s). Nobody died: shrink keeps every rank."""
    comm = pc.Communicator(timeout=30)
    x = np.ones(1 << 16, np.float32)
    result = {}
    if comm.rank == 0:
        time.sleep(0.5)  # the others are waiting by now
        comm.revoke()
        error = "revoked here"
        try:
            comm.all_reduce(x)
            raise AssertionError("a revoked communicator ran an all-reduce")
        except pc.CollectiveError as e:
            assert "revoked by this rank" in str(e), e
    else:
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
            raise AssertionError("the all-reduce completed without rank 0")
        except pc.CollectiveError as e:
            error = str(e)
        result["waited_s"] = time.monotonic() - t0
        assert "revoked by rank 0" in error, error
        assert result["waited_s"] < 5, result  # the revocation, not the 30 s timeout
    new, got = recover(comm, error)
    result.update(got)
    result.update(check_new(new, comm.size, []))
    new.close()
    return result


def agree_values():
    """agree is the AND of the survivors' flags; a dead rank's flag does not count."""
    comm = pc.Communicator(timeout=30)
    flags = [0b1111, 0b0111, 0b0001, 0b1101, 0b1111]
    got = comm.agree(flags[comm.rank])
    want = 0
    want = ~want
    for f in flags[: comm.size]:
        want &= f
    assert got == want & (2**64 - 1), (got, want)
    # The only cleared bit on one rank, each rank in turn (the highest among them): every
    # rank sees it cleared. Then a high bit alone, cleared on the highest rank.
    for k in range(comm.size):
        got = comm.agree(0b01 if comm.rank == k else 0b11)
        assert got == 0b01, (k, got)
    got = comm.agree((1 << 63) if comm.rank != comm.size - 1 else 0)
    assert got == 0, got
    comm.barrier()
    if comm.rank == VICTIM:
        die()
    got = comm.agree(0b0011 if comm.rank != VICTIM else 0)  # the victim is gone: no 0 from it
    assert got == 0b0011, got
    try:
        comm.agree(-1)
        raise AssertionError("agree took -1")
    except ValueError as e:
        assert "agree takes an int" in str(e), e
    comm.close()
    return {"agreed": got}


def agree_exits():
    """Ranks that post a round of agree and exit at once, one after another (each rank but the
    first and the last, in turn): every survivor sees the same members and the same value. Each
    rank clears its own bit, so the value names the members: a victim took part if it posted
    before it died (in every other round its thread may not have), and is left out of every
    later round. Rank 0 reads the victim's entry while it lives, the last rank after its death:
    a board that counted the living instead of the posted would tell them apart."""
    comm = pc.Communicator(timeout=30)
    mask = 2**64 - 1
    flag = mask & ~(1 << comm.rank)
    rounds = []
    for k, victim in enumerate(range(1, comm.size - 1)):
        if comm.rank == victim:
            threading.Thread(target=comm.agree, args=(flag,), daemon=True).start()
            time.sleep((0.01, 0.0)[k % 2])  # posted by then; or not yet: either holds
            die()
        if comm.rank == comm.size - 1:  # reads the round once the victim is dead; rank 0
            time.sleep(0.05)  # reads the victim's entry first, while it lives
        got = comm.agree(flag)
        members = [r for r in range(comm.size) if not got >> r & 1]
        rounds.append({"members": members, "value": got})
    comm.close()
    return {"rounds": rounds}


def replaced():
    """The victim dies between collectives; the survivors shrink, then take in the
    replacement the launcher started (grow) and run on the full size again. The replacement's
    Communicator() returns once it is taken in."""
    if os.environ.get("PYCOLL_JOIN"):
        t0 = time.monotonic()
        comm = pc.Communicator(timeout=30)
        joined = time.monotonic() - t0
        n = comm.size
        x = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
        comm.all_reduce(x)
        np.testing.assert_array_equal(x, reference_sum(n, 1000))
        assert comm.grow() is None  # the next step boundary, with the others
        comm.close()
        return {"joined": True, "rank": comm.rank, "size": n, "join_s": joined}
    comm = pc.Communicator(timeout=30)
    n = comm.size
    comm.barrier()
    if comm.rank == VICTIM:
        die()
    error, _ = until_failure(comm, lambda: comm.all_reduce(np.ones(4, np.float32)))
    new, result = recover(comm, error)
    deadline = time.monotonic() + 30
    while True:  # a step boundary, again and again, until the replacement is in
        grown = new.grow()
        if grown is not None:
            break
        assert time.monotonic() < deadline, "no replacement joined"
        time.sleep(0.01)
    new.close()
    assert grown.size == n, grown.size
    x = np.arange(1000, dtype=np.float64) * (grown.rank + 1)
    grown.all_reduce(x)
    np.testing.assert_array_equal(x, reference_sum(n, 1000))
    assert grown.grow() is None  # nobody else waits
    grown.close()
    result.update({"rank": grown.rank, "size": grown.size})
    return result


DRILLS = {"second_dies_in_shrink": second_dies_in_shrink, "revoke": revoke_reaches_the_blocked,
          "agree": agree_values, "agree_exits": agree_exits,
          "replaced": replaced}  # fmt: skip


def nodes():
    """Under mpiexec, over two emulated nodes: revoke, agree and shrink refuse, naming why."""
    comm = pc.Communicator()
    assert comm.topology.num_nodes == 2, comm.topology.num_nodes
    for call in (comm.revoke, lambda: comm.agree(1), comm.shrink):
        try:
            call()
            raise AssertionError("worked over several nodes")
        except pc.CollectiveError as e:
            assert "spans 2 nodes" in str(e) and "one machine" in str(e), e
    x = np.ones(10, np.float32)
    comm.all_reduce(x)  # still usable: nothing was revoked
    assert np.all(x == comm.size), x
    comm.close()


def main():
    drill = sys.argv[1]
    if drill == "nodes":  # in a rank pool, which reports what it raises
        return nodes()
    what = DRILLS.get(drill) or (lambda: killed_in(drill))
    try:
        result = {"ok": True, **what()}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "trace": traceback.format_exc()}  # fmt: skip
    result["rank"] = result.get("rank", os.environ.get("PYCOLL_RANK", os.environ.get("RANK")))
    # pids repeat across nodes (namespace nodes have process ids of their own)
    out = Path(os.environ["DRILL_RESULTS"]) / f"rank-{os.getpid()}-{socket.gethostname()}.json"
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
