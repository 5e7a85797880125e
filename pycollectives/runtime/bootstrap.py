"""Rendezvous: how the ranks of a communicator find each other.

mpiexec is the primary launcher: ranks meet through MPI (``MPI.COMM_WORLD``, or any mpi4py
communicator). A job launched by torchrun, or any ``env://``-style launcher (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set, each process an MPI world of one), meets
through torch.distributed's ``TCPStore`` instead, on one machine. Either way the rendezvous
only exchanges names once; collectives never go through it.

A group offers ``rank``, ``size``, ``allgather(obj) -> list`` and ``mpi`` (the mpi4py
communicator, or None for a store rendezvous).
"""

from __future__ import annotations

import itertools
import operator
import os
import pickle
import socket
import threading
import time
from datetime import timedelta

from pycollectives.errors import CollectiveError, CollectiveTimeout

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
JOIN = "pycollectives/join"  # where processes ask to join a job over a store (StoreGroup.join)
_store_groups = itertools.count()  # communicators are made in the same order on every rank
# Where launchers say which of a machine's processes this is, and how many it runs: torchrun,
# MPICH's and Open MPI's mpiexec.
_LOCAL_RANK_VARS = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))  # fmt: skip


def machine_id(environ=None) -> str:
    """Which machine this process runs on, as every process of the job sees it: the host name
    and the kernel's boot id (two containers may share a host name; processes of one kernel
    share memory), or ``PYCOLL_HOST_ID`` when set (emulated nodes, e.g. two torchrun agents on
    one machine each taken as a node)."""
    env = os.environ if environ is None else environ
    given = env.get("PYCOLL_HOST_ID", "")
    if given:
        return f"given:{given}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def instance(pid: int | None = None, environ=None) -> str:
    """A process as the store names it (heartbeats, tombstones, requests to join): its
    machine id and pid (this process's by default)."""
    return f"{machine_id(environ)}|{os.getpid() if pid is None else pid}"


def join_key(what: str, inst: str) -> str:
    """Where a joining process `inst` says it has asked (`what` "asked") or is in ("in")."""
    return f"{JOIN}/{what}/{inst}"


def launch_local_rank(environ=None, mpi: bool = False):
    """(this process's index among the launch's processes on its machine, their number), from
    the launcher's environment (`mpi`: mpiexec's alone); None where no launcher says."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in _LOCAL_RANK_VARS[1:] if mpi else _LOCAL_RANK_VARS:
        try:
            return int(env[rank_var]), int(env[size_var])
        except (KeyError, ValueError):
            continue
    return None


def check_color(color, key) -> tuple:
    """(color, key) of a split as ints; color None or negative: this rank joins no group."""
    try:
        return (-1 if color is None else operator.index(color)), operator.index(key)
    except TypeError:
        raise TypeError(
            f"split: color must be an int or None and key an int, got {type(color).__name__} "
            f"and {type(key).__name__}"
        ) from None


def split_members(pairs: list, rank: int):
    """The ranks of this rank's part of a split, in (key, old rank) order, from every rank's
    (color, key); None when this rank's color is negative (it joins none)."""
    color = pairs[rank][0]
    if color < 0:
        return None
    return sorted((r for r, p in enumerate(pairs) if p[0] == color), key=lambda r: (pairs[r][1], r))


# The tag of MpiGroup.meet's tokens (MPI guarantees tags up to 32767).
MEET_TAG = 32123


class MpiGroup:
    """Ranks of an mpi4py communicator: its own duplicate, whose errors are returned, not
    fatal (``dup=False``: `comm` itself, left as it is). On a communicator of its own, every
    exchange (allgather, split, local) first meets every rank, bounded by `timeout`
    (``meet``): MPI's collectives have no timeout, so a rank that never comes (an error on it
    before the exchange, or an exchange of another kind) is named within the timeout instead
    of leaving the others waiting forever. A borrowed communicator (``dup=False``) carries no
    message of ours: its exchanges are MPI's own."""

    def __init__(self, comm, dup: bool = True, timeout: float = 300.0):
        from mpi4py import MPI

        self._owned = dup
        self.mpi = comm.Dup() if dup else comm
        if dup:
            self.mpi.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        self.timeout = timeout
        self._meetings = 0

    def meet(self, what: str, payload=None) -> list:
        """Returns once every rank has reached this exchange, `what` (the same on every rank),
        with every rank's `payload` (ours at our rank): each sends every other a token (the
        exchange's number, `what`, `payload`) and waits for theirs, polling with back-off.
        Raises CollectiveTimeout naming the ranks whose token did not come within the
        timeout, and CollectiveError where one came from another exchange. Then the MPI calls
        of the exchange find every rank in them. On a borrowed communicator, or of one rank,
        it sends nothing (and returns None)."""
        if not self._owned or self.size == 1:
            return None
        self._meetings += 1
        token = (self._meetings, what)
        peers = [q for q in range(self.size) if q != self.rank]
        sends = [self.mpi.isend((*token, payload), dest=q, tag=MEET_TAG) for q in peers]
        got = {}

        def arrived():
            for q in peers:
                if q not in got:
                    msg = self.mpi.improbe(source=q, tag=MEET_TAG)
                    if msg is not None:
                        got[q] = msg.recv()
            return len(got) == len(peers)

        def missing():
            return CollectiveTimeout(
                f"{what}: rank(s) {[q for q in peers if q not in got]} did not come within "
                f"{self.timeout:g} s (rank {self.rank} of {self.size} waited; an error on them "
                "before it, or a different call there?)"
            )

        _poll(arrived, self.timeout, 1e-5, missing, max_pause=1e-3)
        wrong = {q: t[:2] for q, t in got.items() if t[:2] != token}
        if wrong:
            q, (n, theirs) = min(wrong.items())
            raise CollectiveError(
                f"{what}: ranks disagree: rank {q} is at {theirs} (its exchange #{n}), rank "
                f"{self.rank} at {what} (#{self._meetings})"
            )
        from mpi4py import MPI

        MPI.Request.Waitall(sends)
        return [payload if q == self.rank else got[q][2] for q in range(self.size)]

    def allgather(self, obj) -> list:
        everyone = self.meet("a rendezvous", obj)  # the objects ride with the tokens
        return self.mpi.allgather(obj) if everyone is None else everyone

    def local(self) -> tuple:
        """(rank among the ranks of this machine, their number)."""
        from mpi4py import MPI

        self.meet("finding the ranks of this machine")
        node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return node.Get_rank(), node.Get_size()
        finally:
            node.Free()

    @classmethod
    def of_members(cls, comm, members):
        """The group of the ranks `members` of `comm` (in that order), made by them alone
        (``MPI_Comm_create_group``: the other ranks of `comm` take no part)."""
        whole = comm.Get_group()
        part = whole.Incl(list(members))
        try:
            sub = comm.Create_group(part)
        finally:
            part.Free()
            whole.Free()
        group = cls(sub, dup=False)
        group._owned = True
        return group

    def split(self, color, key):
        """The group of the ranks that gave this `color`, ordered by `key` then rank
        (``MPI_Comm_split``); None for a negative color. Collective."""
        from mpi4py import MPI

        color, key = check_color(color, key)
        self.meet("split")
        part = self.mpi.Split(MPI.UNDEFINED if color < 0 else color, key)
        if part == MPI.COMM_NULL:
            return None
        group = MpiGroup(part, dup=False, timeout=self.timeout)
        group._owned = True  # the split is ours to free
        return group

    def free(self):
        if self.mpi is not None and self._owned:
            self.mpi.Free()
        self.mpi = None


class StoreGroup:
    """Ranks that meet through a torch.distributed store (torchrun, ``env://``, or the store
    torch hands a process-group backend), on one machine or several."""

    mpi = None

    def __init__(self, rank: int, size: int, store, prefix: str | None = None, timeout=None):
        self.rank, self.size, self.store = rank, size, store
        self.prefix = prefix if prefix is not None else f"pycollectives/{next(_store_groups)}"
        self.timeout = timeout  # seconds each exchange waits; None: the store's own timeout
        self._round = 0

    @classmethod
    def connect(cls, rank: int, size: int, host: str, port: int, timeout: float):
        """Joins the ``TCPStore`` at host:port: under torchrun the launcher's own store,
        otherwise the one rank 0 hosts."""
        try:
            from torch.distributed import TCPStore
        except ImportError:
            raise CollectiveError(
                f"RANK/WORLD_SIZE say this is rank {rank} of {size} (an env:// launch such as "
                "torchrun), which needs torch to meet the other ranks; install torch, or launch "
                "with mpiexec -n N"
            ) from None
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:
            store = TCPStore(
                host,
                port,
                size,
                is_master=rank == 0 and not agent,
                timeout=timedelta(seconds=timeout),
                multi_tenant=True,
            )
        except Exception as e:  # a refused or timed-out connection: say where we looked
            raise CollectiveError(
                f"rank {rank}: cannot reach the rendezvous store at {host}:{port}: {e}"
            ) from None
        return cls(rank, size, store, timeout=timeout)

    @classmethod
    def join(cls, host: str, port: int, timeout: float):
        """A process started to join a running job whose ranks meet through the store at
        host:port (``pycollectives.launch --elastic --nnodes ... --replace``, ``PYCOLL_JOIN``):
        takes a ticket (``pycollectives/join/tickets``), asks under it, and waits until the
        job's ranks take it in (``Communicator.grow``), which tells it its rank, the new size
        and where they meet."""
        import json

        from torch.distributed import TCPStore

        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - refused, or timed out: say where we looked
            raise CollectiveError(f"cannot reach the job's store at {host}:{port}: {e}") from None
        me = instance()
        ticket = store.add(f"{JOIN}/tickets", 1)
        store.set(f"{JOIN}/ask/{ticket}", me)
        store.set(join_key("asked", me), str(ticket))
        key = f"{JOIN}/admit/{ticket}"
        try:
            store.wait([key], timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - torch's timeout
            raise CollectiveError(
                f"asked to join the job at {host}:{port} (ticket {ticket}) but its ranks did not "
                f"take this process in within {timeout} s (their training loop calls "
                "Communicator.grow at step boundaries?)"
            ) from None
        admit = json.loads(store.get(key))
        store.set(join_key("in", me), "1")
        return cls(admit["rank"], admit["size"], store, admit["prefix"], timeout)

    def allgather(self, obj) -> list:
        return self._exchange("a rendezvous", obj)

    def _exchange(self, what: str, obj) -> list:
        """Every rank's `obj` from exchange `what` (the same on every rank), in rank order.
        Bounded as ``MpiGroup.meet``: CollectiveTimeout naming the ranks that did not come
        within the timeout, CollectiveError where one came to another exchange."""
        self._round += 1
        keys = [f"{self.prefix}/{self._round}/{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], pickle.dumps((what, obj)))
        seconds = self.timeout
        if seconds is None:
            seconds = self.store.timeout.total_seconds()
        try:
            self.store.wait(keys, timedelta(seconds=seconds))
        except Exception:  # torch's timeout (DistStoreError), or a store that went away
            try:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            except Exception:  # noqa: BLE001 - the store itself is gone: its own error says so
                missing = []
            if not missing:
                raise
            raise CollectiveTimeout(
                f"{what}: rank(s) {missing} did not come within {seconds:g} s (rank "
                f"{self.rank} of {self.size} waited; an error on them before it, or a "
                "different call there?)"
            ) from None
        got = [pickle.loads(self.store.get(k)) for k in keys]
        wrong = [(q, theirs) for q, (theirs, _) in enumerate(got) if theirs != what]
        if wrong:
            q, theirs = wrong[0]
            raise CollectiveError(
                f"{what}: ranks disagree: rank {q} is at {theirs} (exchange #{self._round}), "
                f"rank {self.rank} at {what}"
            )
        return [o for _, o in got]

    def split(self, color, key):
        """As ``MpiGroup.split``: the ranks of one color meet under a prefix of their own in
        the same store."""
        pairs = self._exchange("split", check_color(color, key))
        members = split_members(pairs, self.rank)
        if members is None:
            return None
        prefix = f"{self.prefix}/split{self._round}/{pairs[self.rank][0]}"
        return StoreGroup(members.index(self.rank), len(members), self.store, prefix, self.timeout)

    def local(self) -> tuple:
        """(rank among the ranks of this machine, their number). Collective."""
        machines = self._exchange("finding the ranks of this machine", machine_id())
        here = [r for r, m in enumerate(machines) if m == machines[self.rank]]
        return here.index(self.rank), len(here)

    def free(self):
        self.store = None


class ThreadGroup:
    """Ranks that are threads of this process (``Communicator.local``): they meet through a
    barrier in memory. Each exchange writes one of two alternating slot lists, so a fast rank
    may start the next exchange while a slow one still reads this one."""

    mpi = None

    def __init__(self, rank: int, shared: dict, timeout: float):
        self.rank, self.size = rank, shared["size"]
        self._shared, self._timeout, self._round = shared, timeout, 0

    @staticmethod
    def shared(size: int) -> dict:
        """What the `size` ThreadGroups of one local communicator share."""
        return {"size": size, "barrier": threading.Barrier(size),
                "slots": ([None] * size, [None] * size)}  # fmt: skip

    def allgather(self, obj) -> list:
        slots = self._shared["slots"][self._round % 2]
        self._round += 1
        slots[self.rank] = obj
        try:
            self._shared["barrier"].wait(self._timeout)
        except threading.BrokenBarrierError:
            raise CollectiveError(
                f"rank {self.rank} of a local communicator: the other threads did not arrive "
                f"within {self._timeout} s (or one of them failed)"
            ) from None
        return list(slots)

    def split(self, color, key):
        """As ``MpiGroup.split``, among threads: the lowest rank of each color makes what its
        group shares and hands it to the others in a second exchange."""
        pair = check_color(color, key)
        pairs = self.allgather(pair)
        members = split_members(pairs, self.rank)
        lead = members is not None and members[0] == self.rank
        made = self.allgather(ThreadGroup.shared(len(members)) if lead else None)
        if members is None:
            return None
        return ThreadGroup(members.index(self.rank), made[members[0]], self._timeout)

    def abort(self):
        """Breaks the barrier: threads waiting in an exchange raise instead of waiting on."""
        self._shared["barrier"].abort()

    def local(self) -> tuple:
        return self.rank, self.size

    def free(self):
        self._shared = None


class FileGroup:
    """Ranks on one machine that meet through files in a directory (``PYCOLL_RENDEZVOUS``,
    with ``PYCOLL_RANK`` and ``PYCOLL_WORLD_SIZE``): how ``python -m pycollectives.launch
    --elastic`` starts a job, with no MPI world, so that ranks can die, and join, without an
    MPI launcher ending the job. Each exchange writes one file per rank (written whole, then
    renamed into place) and waits for the others', backing off to 20 ms between looks."""

    mpi = None

    def __init__(self, folder, rank: int, size: int, prefix: str | None = None,
                 timeout: float = 300.0):  # fmt: skip
        from pathlib import Path

        self.folder, self.rank, self.size = Path(folder), rank, size
        self.prefix = prefix if prefix is not None else f"g{next(_store_groups)}"
        self.timeout, self._round = timeout, 0

    def allgather(self, obj) -> list:
        self._round += 1
        here = self.folder / self.prefix / str(self._round)
        here.mkdir(parents=True, exist_ok=True)
        tmp = here / f".{self.rank}.{os.getpid()}"
        tmp.write_bytes(pickle.dumps(obj))
        tmp.rename(here / str(self.rank))
        values = [None] * self.size
        missing = list(range(self.size))

        def arrived() -> bool:
            nonlocal missing
            still = []
            for r in missing:
                try:
                    values[r] = pickle.loads((here / str(r)).read_bytes())
                except FileNotFoundError:
                    still.append(r)
            missing = still
            return not missing

        _poll(arrived, self.timeout, 1e-4, lambda: CollectiveError(
            f"rendezvous in {here}: rank(s) {', '.join(map(str, missing))} did not arrive "
            f"within {self.timeout} s"))  # fmt: skip
        return values

    @classmethod
    def join(cls, folder, timeout: float = 300.0):
        """A process started to join a running job (``pycollectives.launch --elastic
        --replace``, ``PYCOLL_JOIN``): asks to join (``join/<pid>.req``), then waits until the
        job's ranks take it in (``Communicator.grow``), which tells it its rank, the new size
        and where they meet (``join/<pid>.admit``)."""
        import json
        from pathlib import Path

        from pycollectives.checkpoint import write_atomically

        where = Path(folder) / "join"
        where.mkdir(parents=True, exist_ok=True)
        name = str(os.getpid())
        write_atomically(where / f"{name}.req", lambda f: f.write(b"{}"))
        admit = {}

        def admitted() -> bool:
            try:
                admit.update(json.loads((where / f"{name}.admit").read_text()))
            except FileNotFoundError:
                return False
            return True

        _poll(admitted, timeout, 1e-3, lambda: CollectiveError(
            f"asked to join the job in {folder} but its ranks did not take this process in "
            f"within {timeout} s (their training loop calls Communicator.grow at step "
            "boundaries?)"))  # fmt: skip
        return cls(folder, admit["rank"], admit["size"], admit["prefix"], timeout)

    def split(self, color, key):
        """As ``MpiGroup.split``: the ranks of one color meet under a prefix of their own."""
        pairs = self.allgather(check_color(color, key))
        members = split_members(pairs, self.rank)
        if members is None:
            return None
        prefix = f"{self.prefix}/split{self._round}-{pairs[self.rank][0]}"
        return FileGroup(self.folder, members.index(self.rank), len(members), prefix,
                         self.timeout)  # fmt: skip

    def local(self) -> tuple:
        return self.rank, self.size

    def free(self):
        pass


def _poll(ready, timeout: float, first_pause: float, failure, max_pause: float = 0.02):
    """Calls ready() until it returns True, sleeping between calls from `first_pause` seconds,
    doubling up to `max_pause`; past `timeout` seconds raises failure() instead."""
    deadline, pause = time.monotonic() + timeout, first_pause
    while not ready():
        if time.monotonic() > deadline:
            raise failure()
        time.sleep(pause)
        pause = min(pause * 2, max_pause)


def _file_launch(environ) -> tuple | None:
    """(folder, rank, size) of a job started by ``pycollectives.launch --elastic``, or None."""
    folder = environ.get("PYCOLL_RENDEZVOUS", "")
    if not folder or environ.get("PYCOLL_JOIN"):
        return None
    try:
        rank, size = int(environ["PYCOLL_RANK"]), int(environ["PYCOLL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise CollectiveError(
            "PYCOLL_RENDEZVOUS is set, so PYCOLL_RANK and PYCOLL_WORLD_SIZE must be integers"
        ) from None
    if not 0 <= rank < size:
        raise CollectiveError(f"PYCOLL_RANK={rank} is out of range for PYCOLL_WORLD_SIZE={size}")
    return folder, rank, size


class BoardGroup:
    """The ranks `members` of a host communicator that are still running, meeting on its
    fault-tolerant board (``HostComm.board_exchange``: shared memory, no MPI): how
    ``Communicator.shrink`` makes the survivors' communicator. An exchange in which a member
    no longer takes part raises CollectiveError on every member, with ``lost`` set."""

    mpi = None

    def __init__(self, host, members: list, rank_before: int):
        self._host, self.members = host, list(members)
        self.rank, self.size = self.members.index(rank_before), len(self.members)
        self.lost = False

    def allgather(self, obj) -> list:
        entries = self._host.board_exchange(0, pickle.dumps(obj))
        took_part = [rank for rank, _, _ in entries]
        if took_part != self.members:
            self.lost = True
            gone = sorted(set(self.members) - set(took_part))
            raise CollectiveError(
                f"rank(s) {', '.join(map(str, gone))} exited while the communicator of the "
                "survivors was being made"
            )
        return [pickle.loads(payload) for _, _, payload in entries]

    def split(self, color, key):
        raise CollectiveError("a communicator being made by shrink() cannot be split")

    def local(self) -> tuple:
        return self.rank, self.size

    def free(self):
        self._host = None


GROUPS = (MpiGroup, StoreGroup, ThreadGroup, FileGroup, BoardGroup)


def as_group(comm):
    """`comm` if it is a group already, else a group over the mpi4py communicator `comm`."""
    return comm if isinstance(comm, GROUPS) else MpiGroup(comm, dup=False)


def _env_launch(environ) -> tuple | None:
    """(rank, size, host, port) of an env:// launch, None when none of its variables is set."""
    present = [v for v in _ENV_VARS if environ.get(v, "") != ""]
    if not present:
        return None
    missing = [v for v in _ENV_VARS if v not in present]
    if missing:
        raise CollectiveError(
            f"an env:// launch sets {', '.join(_ENV_VARS)}; {', '.join(present)} set but "
            f"{', '.join(missing)} not"
        )
    try:
        rank, size, port = (int(environ[v]) for v in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    except ValueError:
        raise CollectiveError(
            "RANK, WORLD_SIZE and MASTER_PORT must be integers, got "
            + ", ".join(f"{v}={environ[v]!r}" for v in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
        ) from None
    if not 0 <= rank < size:
        raise CollectiveError(f"RANK={rank} is out of range for WORLD_SIZE={size}")
    return rank, size, environ["MASTER_ADDR"], port


def world(mpi_comm=None, timeout: float = 300.0, environ=None):
    """The group of a new communicator: `mpi_comm`'s ranks when given (or `mpi_comm` itself,
    when it is a group already); otherwise the MPI world,
    or a TCPStore rendezvous when an env:// launcher started this process as an MPI world of
    one. A launch whose MPI world and RANK/WORLD_SIZE disagree is an error, never a silent
    world of one."""
    if isinstance(mpi_comm, GROUPS):
        return mpi_comm
    environ = os.environ if environ is None else environ
    files = _file_launch(environ) if mpi_comm is None else None
    if files is not None:  # pycollectives.launch --elastic: no MPI world at all
        return FileGroup(*files, timeout=timeout)
    if mpi_comm is None and environ.get("PYCOLL_JOIN") and environ.get("PYCOLL_RENDEZVOUS"):
        return FileGroup.join(environ["PYCOLL_RENDEZVOUS"], timeout)  # a replacement
    if mpi_comm is None and environ.get("PYCOLL_JOIN") and environ.get("MASTER_ADDR"):
        try:
            port = int(environ.get("MASTER_PORT", ""))
        except ValueError:
            raise CollectiveError(
                f"PYCOLL_JOIN with MASTER_ADDR needs an integer MASTER_PORT, got "
                f"{environ.get('MASTER_PORT')!r}"
            ) from None
        return StoreGroup.join(environ["MASTER_ADDR"], port, timeout)  # a replacement
    from mpi4py import MPI

    if mpi_comm is not None:
        return MpiGroup(mpi_comm, timeout=timeout)
    env = _env_launch(environ)
    mpi_rank, mpi_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if env is None or env[:2] == (mpi_rank, mpi_size):
        return MpiGroup(MPI.COMM_WORLD, timeout=timeout)
    if env[1] == 1:
        raise CollectiveError(
            f"WORLD_SIZE=1 but the MPI world has {mpi_size} ranks: launch with one launcher"
        )
    if mpi_size != 1:
        raise CollectiveError(
            f"the launch is inconsistent: MPI says rank {mpi_rank} of {mpi_size}, RANK/WORLD_SIZE "
            f"say rank {env[0]} of {env[1]}; launch with mpiexec or with torchrun, not both"
        )
    return StoreGroup.connect(*env, timeout=timeout)
