"""Launches a job over mpiexec and restarts it when a rank dies (torchrun's elastic restart).

    python -m pycollectives.launch -n 4 [--max-restarts 3] -- python -m pycollectives.examples.train
    python -m pycollectives.launch -n 4 --elastic [--replace 2] -- \
        python -m pycollectives.examples.elastic

Runs ``mpiexec -n N <command>``. Each rank runs under a small watcher that records how its
process ended (exit status or signal, and when); when the job fails, the launcher names the
rank that failed first and how, and starts the whole job again, up to ``--max-restarts``
times. The job sees ``PYCOLL_RESTART_COUNT`` (0 on the first run) and ``PYCOLL_MAX_RESTARTS``;
a job that saves checkpoints resumes from its latest one (``pycollectives.checkpoint``).
The launcher's exit status is the job's: 0 once a run succeeds, else the last run's.

With ``--elastic`` the ranks are started as plain processes that meet through files instead
of under mpiexec (which ends the whole job when one rank dies): when one dies the others keep
running, shrink their communicator (``Communicator.shrink``) and carry on, and with
``--replace K`` a new process is started in each dead rank's place, up to K, which joins the
running job when its ranks call ``Communicator.grow``.

Across machines, a launcher on each, ``-n`` ranks on each::

    python -m pycollectives.launch -n 2 --elastic --replace 2 --nnodes 2 --node-rank I \
        --master-addr NODE0 --master-port 29500 -- python -m pycollectives.examples.elastic

The ranks meet as under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
through a TCPStore that node 0's launcher serves for the whole job; gloo carries what crosses
machines. Revoke, agree and shrink work over that store, each launcher writes a death into it
as it reaps the process, and replacements ask to join through it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pycollectives.checkpoint import write_atomically
from pycollectives.runtime.bootstrap import instance, join_key
from pycollectives.runtime.store_board import tombstone_key

PREFIX = "pycollectives.launch"
_WATCH = "--watch-rank"  # the per-rank watcher's entry (internal)


def log(text: str):
    print(f"{PREFIX}: {text}", file=sys.stderr, flush=True)


def find_mpiexec(explicit: str | None = None) -> str:
    """`explicit`, else the mpiexec next to this Python (the mpich package), else on PATH."""
    if explicit:
        return explicit
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit(f"{PREFIX}: mpiexec not found (pip install mpich, or pass --mpiexec)")
    return found


def rank_from_env() -> int:
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def describe(status: dict) -> str:
    sig = status.get("signal")
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by signal {sig} ({name})"
    return f"exited with status {status['returncode']}"


def _die_with_parent():
    """In the rank's process: die when the watcher dies (mpiexec may kill the watcher alone)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch_rank(status_dir: str, command: list[str]) -> int:
    """Runs `command` as this rank (inheriting mpiexec's environment and descriptors), then
    records how it ended in `status_dir`/rank-<R>.json; exits as it did."""
    rank = rank_from_env()
    child = subprocess.Popen(command, close_fds=False, preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    rc = child.wait()
    status = {"rank": rank, "returncode": rc, "signal": -rc if rc < 0 else 0, "time": time.time()}
    text = json.dumps(status).encode()
    write_atomically(Path(status_dir) / f"rank-{rank}.json", lambda f: f.write(text))
    return 128 - rc if rc < 0 else rc


def first_failure(status_dir: Path) -> dict | None:
    """The rank whose process failed first (by the time its watcher saw it end)."""
    failed = []
    for f in status_dir.glob("rank-*.json"):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if s["returncode"] != 0:
            failed.append(s)
    return min(failed, key=lambda s: s["time"]) if failed else None


def run_once(mpiexec: str, n: int, mpiexec_args: list[str], command: list[str], env: dict):
    """One run of the job: (mpiexec's exit status, the first failed rank's status or None)."""
    with tempfile.TemporaryDirectory(prefix="pycoll-launch-") as status_dir:
        watcher = [sys.executable, "-m", "pycollectives.launch", _WATCH, status_dir, "--"]
        cmd = [mpiexec, *mpiexec_args, "-n", str(n), *watcher, *command]
        proc = subprocess.Popen(cmd, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            raise
        return rc, first_failure(Path(status_dir))


def only_waiting(procs: dict, folder: str) -> bool:
    """Every process left is a replacement that has not been taken in (Communicator.grow
    has not answered its request): true only once it has asked."""
    return bool(procs) and all(
        what.startswith("replacement") and (Path(folder) / "join" / f"{pid}.req").exists()
        for pid, (_, what) in procs.items()
    )


def reap_ended(poll: float | None = None) -> list[tuple[int, int]]:
    """(pid, wait status) of every child that has ended by now (waiting for the first unless
    `poll` is set), those that failed first. The kernel does not hand back ended children in
    the order they ended: a rank that died before two others finished was once reaped after
    them, and counted as a death after the job had finished."""
    ended = [os.wait()] if poll is None else []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        ended.append((pid, status))
    return sorted(ended, key=lambda e: os.waitstatus_to_exitcode(e[1]) == 0)


class _FileMeeting:
    """Ranks of one machine that meet through files in a folder (``bootstrap.FileGroup``)."""

    def __init__(self, n: int, folder: str, env: dict):
        self.folder = folder
        self.base = {**env, "PYCOLL_RENDEZVOUS": folder, "PYCOLL_WORLD_SIZE": str(n),
                     "PYCOLL_ELASTIC": "1"}  # fmt: skip
        self.ranks = [{"PYCOLL_RANK": str(r)} for r in range(n)]
        self.joiner = {"PYCOLL_JOIN": "1"}
        self.poll = None  # reaping blocks: when every process here waits, the job is over

    def died(self, pid: int):
        pass

    def only_waiting(self, procs: dict) -> bool:
        return only_waiting(procs, self.folder)

    def over(self, idle: bool) -> bool:
        return idle

    def close(self, ok: bool):
        pass


class _StoreMeeting:
    """Ranks of `nnodes` machines, `n` on each, that meet through a TCPStore at addr:port
    (an ``env://`` launch: ``bootstrap.StoreGroup``), which node 0's launcher serves for the
    whole job. A death is written into the store at once (``pycollectives/dead/<instance>``),
    so that the survivors leave the rank out without waiting for its heartbeat to stop; a
    replacement asks to join through the store (``StoreGroup.join``)."""

    def __init__(self, n: int, nnodes: int, node_rank: int, addr: str, port: int, env: dict,
                 timeout: float = 300.0):  # fmt: skip
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.node, self.nnodes, self.env = node_rank, nnodes, env
        self.store = TCPStore(addr, port, is_master=node_rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout), multi_tenant=True)  # fmt: skip
        self.base = {**env, "MASTER_ADDR": addr, "MASTER_PORT": str(port),
                     "WORLD_SIZE": str(n * nnodes), "LOCAL_WORLD_SIZE": str(n),
                     "TORCHELASTIC_USE_AGENT_STORE": "True", "PYCOLL_ELASTIC": "1"}  # fmt: skip
        self.ranks = [{"RANK": str(node_rank * n + r), "LOCAL_RANK": str(r)} for r in range(n)]
        self.joiner = {"PYCOLL_JOIN": "1", "RANK": "", "LOCAL_RANK": ""}  # its rank: grow's
        self.poll = 0.05  # other nodes may still take this one's waiting replacements in
        self._idle = None

    def died(self, pid: int):
        self.store.set(tombstone_key(instance(pid, self.env)), "died")

    def only_waiting(self, procs: dict) -> bool:
        def waiting(pid: int) -> bool:
            me = instance(pid, self.env)  # as the child names itself: same machine, its pid
            asked, taken = join_key("asked", me), join_key("in", me)
            return self.store.check([asked]) and not self.store.check([taken])

        return bool(procs) and all(
            what.startswith("replacement") and waiting(pid) for pid, (_, what) in procs.items()
        )

    def over(self, idle: bool) -> bool:
        """Whether every node is idle (its processes ended, or replacements nobody took in)."""
        if idle != self._idle:
            self.store.set(f"pycollectives/launch/idle/{self.node}", "1" if idle else "0")
            self._idle = idle
        if not idle:
            return False
        keys = [f"pycollectives/launch/idle/{i}" for i in range(self.nnodes)]
        return self.store.check(keys) and all(v == b"1" for v in self.store.multi_get(keys))

    def close(self, ok: bool):
        """Node 0 serves the store until every node's launcher is done with it."""
        self.store.set(f"pycollectives/launch/done/{self.node}", "ok" if ok else "failed")
        if self.node == 0:
            keys = [f"pycollectives/launch/done/{i}" for i in range(self.nnodes)]
            deadline = time.monotonic() + 30
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)


def run_elastic(n: int, command: list[str], replace: int, env: dict, nodes=None) -> int:
    """The job's N ranks started as plain processes, so that the death of one leaves the
    others running: on one machine they meet through files (``bootstrap.FileGroup``); with
    `nodes` (nnodes, node_rank, addr, port) through the store node 0's launcher serves, N on
    each machine. Each death is reported; with `replace` > 0 a new process is started in its
    place (``PYCOLL_JOIN``: its ``Communicator()`` waits for the survivors to take it in,
    ``Communicator.grow``), up to `replace` of them. 0 when some process finished (exited 0)
    and none died after that; a replacement never taken in is stopped at the end, and is no
    failure."""
    started_at, t0 = time.time(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pycoll-elastic-") as folder:
        meet = _FileMeeting(n, folder, env) if nodes is None else _StoreMeeting(n, *nodes, env)
        procs = {}  # pid -> (Popen, what it is)

        def start(extra: dict, what: str):
            extra = {**extra, "PYCOLL_STARTED_AT": repr(time.time())}
            p = subprocess.Popen(command, env={**meet.base, **extra}, preexec_fn=_die_with_parent)
            procs[p.pid] = (p, what)
            return p

        first = 0 if nodes is None else nodes[1] * n
        for r, extra in enumerate(meet.ranks):
            start(extra, f"rank {first + r}")
        deaths = replaced = finished = 0
        failed_after_finish = False  # a process died once others had finished the job
        try:
            while True:
                if meet.over(not procs or meet.only_waiting(procs)):
                    for p, what in procs.values():  # the job is over: nobody will take them in
                        log(f"{what} (pid {p.pid}) was not taken in before the job ended")
                        p.terminate()
                        p.wait()
                    break
                ended = reap_ended(meet.poll) if procs else []
                if not ended and meet.poll is not None:
                    time.sleep(meet.poll)
                for pid, status in ended:
                    if pid not in procs:
                        continue
                    _, what = procs.pop(pid)
                    rc = os.waitstatus_to_exitcode(status)
                    if rc == 0:
                        finished += 1
                        continue
                    deaths += 1
                    meet.died(pid)
                    failed_after_finish |= finished > 0
                    how = describe({"returncode": rc, "signal": -rc if rc < 0 else 0})
                    log(f"{what} (pid {pid}) {how} after {time.monotonic() - t0:.2f} s; "
                        f"{len(procs)} process(es) still running")  # fmt: skip
                    if replaced < replace and (procs or nodes) and not meet.only_waiting(procs):
                        replaced += 1
                        p = start(meet.joiner, f"replacement {replaced}")
                        log(f"started replacement {replaced} (pid {p.pid}) for {what}")
        except KeyboardInterrupt:
            for p, _ in procs.values():
                p.send_signal(signal.SIGINT)
            for p, _ in procs.values():
                p.wait()
            raise
        removed = remove_orphaned_shm(started_at)
        if removed:
            log(f"removed {removed} shared-memory segment(s) left in /dev/shm")
        # The job finished when some process did, and none died after that.
        ok = finished > 0 and not failed_after_finish
        meet.close(ok)
    if deaths:
        log(f"{deaths} process(es) died, {replaced} replaced; the job "
            + ("finished" if ok else "failed"))  # fmt: skip
    return 0 if ok else 1


def _mapped_shm() -> set:
    """Names of the /dev/shm files some process has mapped."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            i = line.find("/dev/shm/")
            if i >= 0:
                names.add(line[i + 9 :].split(" ")[0])
    return names


def remove_orphaned_shm(since: float) -> int:
    """Removes the shared-memory segments a failed run left: this user's MPI and
    pycollectives segments made since `since` (a time.time()) that no process maps."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return 0
    uid = os.getuid()
    candidates = []
    for f in shm.iterdir():
        if not f.name.startswith(("mpich_shm_", "pycoll-")):  # ownership: st_uid below
            continue
        try:
            st = f.stat()
        except OSError:
            continue
        if st.st_uid == uid and st.st_mtime >= since - 1:
            candidates.append(f)
    if not candidates:
        return 0
    mapped = _mapped_shm()
    removed = 0
    for f in candidates:
        if f.name not in mapped:
            try:
                f.unlink()
                removed += 1
            except OSError:
                pass
    return removed


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m pycollectives.launch",
        description="run COMMAND on N ranks over mpiexec; restart the whole job when a rank "
        "dies, up to --max-restarts times",
        usage="%(prog)s -n N [--max-restarts K | --elastic [--replace K]] [--mpiexec PATH] "
        "[--mpiexec-arg ARG] -- COMMAND [ARGS...]",
    )
    ap.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    ap.add_argument(
        "--max-restarts", type=int, default=0, help="restarts after a failure (default 0)"
    )
    ap.add_argument("--mpiexec", default=None, help="mpiexec to use (default: next to python)")
    ap.add_argument(
        "--mpiexec-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument passed to mpiexec before -n (repeatable), e.g. --mpiexec-arg=-hosts=a,b",
    )
    ap.add_argument(
        "--elastic",
        action="store_true",
        help="keep the other ranks running when one dies (ranks meet through files, not MPI; "
        "their code shrinks the communicator and carries on)",
    )
    ap.add_argument(
        "--replace",
        type=int,
        default=0,
        metavar="K",
        help="with --elastic: start a new process for each rank that dies, up to K; it joins "
        "the running job (Communicator.grow)",
    )
    ap.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="with --elastic: machines in the job, a launcher on each with -n ranks (default 1)",
    )
    ap.add_argument("--node-rank", type=int, default=0, help="with --nnodes: this machine's index")
    ap.add_argument(
        "--master-addr",
        default=None,
        help="with --nnodes: the address of node 0, whose launcher serves the job's store",
    )
    ap.add_argument("--master-port", type=int, default=29500, help="with --nnodes: its port")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the job: -- COMMAND [ARGS...]")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given (put it after --)")
    if args.nprocs < 1:
        ap.error(f"-n must be at least 1, got {args.nprocs}")
    if args.max_restarts < 0:
        ap.error(f"--max-restarts must be at least 0, got {args.max_restarts}")
    if args.replace < 0:
        ap.error(f"--replace must be at least 0, got {args.replace}")
    if args.replace and not args.elastic:
        ap.error("--replace needs --elastic")
    if args.nnodes < 1:
        ap.error(f"--nnodes must be at least 1, got {args.nnodes}")
    if args.nnodes > 1 and not args.elastic:
        ap.error("--nnodes needs --elastic (over mpiexec, name the hosts with --mpiexec-arg)")
    if args.nnodes > 1 and not args.master_addr:
        ap.error("--nnodes needs --master-addr (node 0's address)")
    if not 0 <= args.node_rank < args.nnodes:
        ap.error(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.elastic and args.max_restarts:
        ap.error("--elastic keeps the job running instead of restarting it: not with "
                 "--max-restarts")  # fmt: skip
    return args, command


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [_WATCH]:
        if len(argv) < 4 or argv[2] != "--":
            raise SystemExit(f"usage: {_WATCH} STATUS_DIR -- COMMAND")
        return watch_rank(argv[1], argv[3:])
    args, command = parse_args(argv)
    if args.elastic:
        nodes = None
        if args.nnodes > 1:
            nodes = (args.nnodes, args.node_rank, args.master_addr, args.master_port)
        return run_elastic(args.nprocs, command, args.replace, dict(os.environ), nodes)
    mpiexec = find_mpiexec(args.mpiexec)
    for attempt in range(args.max_restarts + 1):
        env = dict(os.environ)
        env.update(PYCOLL_RESTART_COUNT=str(attempt), PYCOLL_MAX_RESTARTS=str(args.max_restarts))
        t0, started = time.monotonic(), time.time()
        rc, failed = run_once(mpiexec, args.nprocs, args.mpiexec_arg, command, env)
        if rc == 0:
            if attempt:
                log(f"the job finished after {attempt} restart(s)")
            return 0
        what = (
            f"rank {failed['rank']} {describe(failed)}"
            if failed
            else f"mpiexec exited with status {rc}"
        )
        log(f"the job failed after {time.monotonic() - t0:.1f} s: {what}")
        removed = remove_orphaned_shm(started)
        if removed:
            log(f"removed {removed} shared-memory segment(s) the failed run left in /dev/shm")
        if attempt < args.max_restarts:
            log(f"restarting the job ({attempt + 1} of {args.max_restarts})")
        else:
            if args.max_restarts:
                log(f"giving up after {args.max_restarts} restart(s)")
            return rc if rc > 0 else 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
