"""Revoke, agree and shrink between machines, over the rendezvous store (torchrun, ``env://``,
``pycollectives.launch --elastic --nnodes``): what the shared-memory board
(``HostComm.board_exchange``) does on one machine, for a communicator whose ranks meet through
a torch store. No MPI call and no gloo collective: both may be unusable after a death.

Who is alive. Each process heartbeats into the store (``pycollectives/hb/<instance>``, every
25 ms, from a thread with a store connection of its own), an instance being the machine id and
pid of a process. A rank is taken for dead when

- its tombstone is in the store (``pycollectives/dead/<instance>``: the elastic launcher writes
  it as it reaps the process), or
- it is on this machine (same host name and boot id) and its process is gone, or
- its heartbeat has not moved for ``PYCOLL_HEARTBEAT_TIMEOUT`` seconds (default 1; the only
  sign left when a whole machine is lost under torchrun).

A round of the board (``board_exchange``), the ranks' consensus: each rank writes its entry
into a slot of its own with ``compare_set`` from empty; a rank that finds another dead writes
"dead" into that slot with ``compare_set`` from empty. The store orders the two, so each slot
ends with one value for every reader, and the round's result (the ranks that posted, their
values, in rank order) is the same on every rank that reads it, whatever it saw of the
deaths. A rank that finds "dead" in its own slot was taken for dead (its heartbeat stalled past
the limit) and raises; it is out of the communicator. A rank once dead stays dead: later rounds
mark it at once.

Revoke: a key in the store. The heartbeat thread of every rank polls it and, once set, runs the
communicator's revocation locally (its shared-memory part revoked on its node, its waits for
gloo cut short), within about 75 ms of the call.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import threading
import time
import weakref

from pycollectives.errors import CollectiveError, CollectiveTimeout
from pycollectives.runtime.bootstrap import (
    StoreGroup,
    check_color,
    instance,
    machine_id,
    split_members,
)

HEARTBEAT_S = 0.025
ROOT = "pycollectives"


def heartbeat_key(inst: str) -> str:
    return f"{ROOT}/hb/{inst}"


def tombstone_key(inst: str) -> str:
    return f"{ROOT}/dead/{inst}"


def dead_after() -> float:
    """Seconds of a still heartbeat after which a rank is taken for dead."""
    text = os.environ.get("PYCOLL_HEARTBEAT_TIMEOUT", "1")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise CollectiveError(f"PYCOLL_HEARTBEAT_TIMEOUT must be a positive number, got {text!r}")
    return seconds


def root_store(store):
    """The store under every ``PrefixStore`` layer of `store` (torch hands each process group a
    prefixed one): heartbeats, tombstones and boards live there, one heartbeat per process."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _process_gone(pid: int) -> bool:
    """Whether process `pid` of this machine has ended (gone, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


class _Heart:
    """This process's heartbeat into one store, and the revocation keys it watches for the
    boards on that store: one thread, on a store connection of its own (a wait of the main
    thread on the shared connection would stall it)."""

    _by_store: dict = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, store) -> _Heart:
        """The heart of `store`'s root store (``root_store``), started at the first call."""
        store = root_store(store)
        with cls._lock:
            heart = cls._by_store.get(id(store))
            if heart is None or heart.stopped:
                heart = cls._by_store[id(store)] = cls(store)
            return heart

    def __init__(self, store):
        self._origin = store  # held: its id() names this heart
        self.store = store.clone()
        self.key = heartbeat_key(instance())
        self.boards: weakref.WeakSet = weakref.WeakSet()
        self.stopped = False
        self.store.add(self.key, 1)  # alive from now on, before any board reads it
        self._thread = threading.Thread(target=self._beat, name="pycoll-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.tombstone)
        _tombstone_on_sigterm()

    def tombstone(self):
        """Says in the store that this process is gone (at exit, or on SIGTERM): its peers
        leave it out of their next round at once instead of after the heartbeat's limit."""
        if self.stopped:  # in no communicator any more: nothing to say
            return
        self.stopped = True
        try:
            self.store.set(tombstone_key(instance()), "exited")
        except Exception:  # noqa: BLE001 - the store went first: the heartbeat says it all
            pass

    def watch(self, board):
        with self._lock:
            self.boards.add(board)

    def unwatch(self, board):
        with self._lock:
            self.boards.discard(board)
            if not self.boards:
                self.stopped = True

    def _beat(self):
        while not self.stopped:
            try:
                self.store.add(self.key, 1)
                for board in list(self.boards):
                    if not board.revoked and self.store.check([board.revoke_key]):
                        board.seen_revoked(int(self.store.get(board.revoke_key)))
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): stop
                return
            time.sleep(HEARTBEAT_S)


def _tombstone_on_sigterm():
    """On SIGTERM (how torchrun's agent stops a node's other ranks when one fails), the
    tombstones first, then SIGTERM's default. Only where SIGTERM has its default action and
    this is the main thread: a program's own handler stays."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def handler(signum, _frame):
        for heart in list(_Heart._by_store.values()):
            heart.tombstone()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


class StoreBoard:
    """The fault-tolerant board of a communicator of `size` ranks over `store`, its keys under
    `prefix` in the root store (``root_store``: a name the ranks agreed on, unique there);
    `instances[r]` names rank r's process (``instance()``). `on_revoke(by)` runs once, on the
    thread that sees the revocation by rank `by` first."""

    def __init__(self, store, prefix: str, rank: int, instances: list, timeout: float,
                 on_revoke=None):  # fmt: skip
        self.group_store = store  # the communicator's own (a survivors' group meets there)
        store = root_store(store)
        self.store, self.prefix, self.rank = store, f"{prefix}/board", rank
        self.size, self.instances, self.timeout = len(instances), list(instances), timeout
        self.revoke_key = f"{self.prefix}/revoked"
        self.revoked = False
        self.dead: set = set()
        self.rounds = 0  # rounds so far (the same on every rank)
        self._on_revoke = on_revoke
        self._revoke_lock = threading.Lock()
        self._dead_after = dead_after()
        here = machine_id()
        self._local_pid = {
            r: int(inst.rsplit("|", 1)[1])
            for r, inst in enumerate(instances)
            if inst.rsplit("|", 1)[0] == here and not here.startswith("given:")
        }
        self._heart = _Heart.of(store)
        self._heart.watch(self)

    # -- revocation ----------------------------------------------------------------------------

    def revoke(self):
        """Every rank's operations on the communicator fail from now on (this rank's at once,
        the others' once their heartbeat thread sees the key). The key keeps the first
        revoker: survivors that revoke in turn after seeing it (as each one's recovery does)
        must not make a rank that has not looked yet name one of them instead."""
        first = self.store.compare_set(self.revoke_key, "", str(self.rank))
        self.seen_revoked(int(first))

    def seen_revoked(self, by: int):
        """The revocation by rank `by`, seen here: `on_revoke(by)`, once."""
        with self._revoke_lock:
            if self.revoked:
                return
            self.revoked = True
        if self._on_revoke is not None:
            self._on_revoke(by)

    # -- liveness ------------------------------------------------------------------------------

    def _is_dead(self, r: int, beats: dict, now: float) -> bool:
        if r in self.dead:
            return True
        inst = self.instances[r]
        pid = self._local_pid.get(r)
        if pid is not None and _process_gone(pid):
            return True
        if self.store.check([tombstone_key(inst)]):
            return True
        count = self.store.add(heartbeat_key(inst), 0)
        seen = beats.get(r)
        if seen is None or seen[0] != count:
            beats[r] = (count, now)
            return False
        return now - seen[1] > self._dead_after

    # -- a round -------------------------------------------------------------------------------

    def board_exchange(self, value: int, payload: bytes = b"") -> list:
        """(rank, value, payload) of every rank that took part in this round, in rank order:
        the same list on every rank. Ranks dead before they posted are left out; every running
        rank must call it, in the same order of rounds. Bounded by the timeout."""
        self.rounds += 1
        keys = [f"{self.prefix}/{self.rounds}/{r}" for r in range(self.size)]
        mine = b"P" + int(value).to_bytes(8, "little") + payload
        got = self.store.compare_set(keys[self.rank], "", mine)
        if got != mine:
            raise CollectiveError(
                f"rank {self.rank} was taken for dead by the others (its heartbeat stood still "
                f"for more than {self._dead_after:g} s, PYCOLL_HEARTBEAT_TIMEOUT): it is out of "
                "the communicator"
            )
        slots: dict = {self.rank: mine}
        beats: dict = {}
        deadline = time.monotonic() + self.timeout
        pause = 0.0002
        while len(slots) < self.size:
            pending = [r for r in range(self.size) if r not in slots]
            if self.store.check([keys[r] for r in pending]):
                for r, v in zip(pending, self.store.multi_get([keys[r] for r in pending])):
                    slots[r] = bytes(v)
                break
            now = time.monotonic()
            for r in pending:
                if self.store.check([keys[r]]):
                    slots[r] = bytes(self.store.get(keys[r]))
                elif self._is_dead(r, beats, now):
                    slots[r] = bytes(self.store.compare_set(keys[r], "", b"D"))
            if len(slots) == self.size:
                break
            if now > deadline:
                missing = [r for r in range(self.size) if r not in slots]
                raise CollectiveTimeout(
                    f"a fault-tolerant round (#{self.rounds}): rank(s) {missing} neither came "
                    f"nor died within {self.timeout:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        entries = []
        for r in range(self.size):
            v = slots[r]
            if v[:1] == b"P":
                entries.append((r, int.from_bytes(v[1:9], "little"), v[9:]))
            else:
                self.dead.add(r)
        return entries

    def close(self):
        self._heart.unwatch(self)


def board_for(group, timeout: float, on_revoke=None) -> StoreBoard:
    """The board of a communicator over the ``StoreGroup`` `group`. Collective: the ranks
    exchange their instances, and take rank 0's name for the board."""
    import uuid

    got = group.allgather((instance(), uuid.uuid4().hex[:16]))
    prefix = f"{ROOT}/boards/{got[0][1]}"
    return StoreBoard(group.store, prefix, group.rank, [i for i, _ in got], timeout, on_revoke)


class BoardStoreGroup(StoreGroup):
    """The ranks `members` (ranks of the communicator whose board is `board`) meeting on a
    board of their own over the same store: how ``Communicator.shrink`` makes the survivors'
    communicator between nodes. Every exchange is a round of that board, so a member that
    dies meanwhile is seen alike by all (``lost`` set, CollectiveError on every member)
    instead of being waited for until the timeout; a split is such a group too."""

    def __init__(self, store, instances: list, members: list, rank_before: int, prefix: str,
                 timeout: float):  # fmt: skip
        self.members = list(members)
        super().__init__(self.members.index(rank_before), len(self.members), store, prefix,
                         timeout)  # fmt: skip
        self.instances = [instances[r] for r in self.members]
        self._board = StoreBoard(store, f"{prefix}/group", self.rank, self.instances, timeout)
        self.lost = False

    def _exchange(self, what: str, obj) -> list:
        self._round += 1
        entries = self._board.board_exchange(0, pickle.dumps((what, obj)))
        if len(entries) != self.size:
            self.lost = True
            gone = sorted(set(range(self.size)) - {r for r, _, _ in entries})
            raise CollectiveError(
                f"{what}: rank(s) {gone} exited while the communicator of the survivors was "
                "being made"
            )
        got = [pickle.loads(payload) for _, _, payload in entries]
        wrong = [(q, theirs) for q, (theirs, _) in enumerate(got) if theirs != what]
        if wrong:
            raise CollectiveError(
                f"{what}: ranks disagree: rank {wrong[0][0]} is at {wrong[0][1]}, rank "
                f"{self.rank} at {what}"
            )
        return [o for _, o in got]

    def split(self, color, key):
        pairs = self._exchange("split", check_color(color, key))
        members = split_members(pairs, self.rank)
        if members is None:
            return None
        prefix = f"{self.prefix}/split{self._round}/{pairs[self.rank][0]}"
        return BoardStoreGroup(self.store, self.instances, members, self.rank, prefix,
                               self.timeout)  # fmt: skip

    def free(self):
        if self._board is not None:
            self._board.close()
            self._board = None
        super().free()
