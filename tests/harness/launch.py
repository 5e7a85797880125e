"""Runs worker scripts on several ranks, and turns a failure into a readable pytest failure.

Workers live beside the tests that run them (tests/ranks/workers, tests/gpu/workers) and
import their shared checks from this folder (checks.py). A case runs in a rank pool (pool.py)
unless it needs a job of its own; either way a failure names the case, the rank and the error
its checks raised (what differed, where).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.pool import OWN_JOB_VARIABLES, POOLS, CaseFailed, split_env

HARNESS = Path(__file__).resolve().parent
TESTS = HARNESS.parent
WORKER_DIRS = (TESTS / "ranks" / "workers", TESTS / "gpu" / "workers")
# 4 ranks as 2 nodes x 2 (emulated): shared memory inside each node, MPI between them.
TWO_NODES = {"PYCOLL_RANKS_PER_NODE": "2"}
# A test's (nranks, nodes): 2 and 4 ranks on one node, and 4 as two nodes (its `nodes`, the
# environment to run with).
ONE_NODE_AND_TWO = pytest.mark.parametrize(
    "nranks,nodes", [(2, {}), (4, {}), (4, TWO_NODES)], ids=["2", "4", "4-two-nodes"]
)


def worker_path(name: str) -> Path:
    """A worker script by file name (run_module.py, ``python -m``, is the harness's own), or
    any script by its absolute path."""
    if Path(name).is_absolute() and Path(name).is_file():
        return Path(name)
    for folder in (HARNESS, *WORKER_DIRS):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no worker {name} in {', '.join(map(str, WORKER_DIRS))}")


def with_harness(env: dict) -> dict:
    """`env` with this folder on PYTHONPATH: a worker started by any launcher finds checks.py."""
    path = [str(HARNESS), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("mpiexec not found (make test installs mpich into .venv)")
    return found


def run_mpi(
    nprocs: int,
    worker: str,
    *args: str,
    timeout: float = 300,
    env: dict | None = None,
    mpiexec_args: tuple = (),
    with_stderr: bool = False,
    returncodes: tuple = (0,),
    own_job: bool = False,
):
    """Runs the worker script `worker` on `nprocs` ranks; returns its stdout (and stderr if
    asked). A case that fails on any rank fails the test, naming the rank and what went wrong.

    Cases run in a rank pool (pool.py: one job per rank count that runs case after case)
    unless they need a job of their own: `own_job` (ranks that die or are killed, a job's exit
    itself under test), `mpiexec_args`, an exit code other than 0 expected, or a variable read
    once per process (pool.OWN_JOB_VARIABLES)."""
    env = env or {}
    own_job = own_job or any(k in env for k in OWN_JOB_VARIABLES)
    path = worker_path(worker)
    if not own_job and not mpiexec_args and returncodes == (0,):
        case_env, launch_env = split_env(env)
        case_env.setdefault("PYCOLL_TIMEOUT", os.environ.get("PYCOLL_TIMEOUT", "60"))
        if worker == "run_module.py":
            case = {"module": args[0], "argv": list(args[1:]), "env": case_env}
        elif path.parent not in WORKER_DIRS:  # a script of the test's own, run as __main__
            case = {"script": str(path), "argv": list(args), "env": case_env}
        else:
            case = {"worker": str(path), "argv": list(args), "env": case_env}
        try:
            out, err = POOLS.run(mpiexec(), nprocs, HARNESS, case, launch_env, timeout)
        except CaseFailed as e:
            pytest.fail(str(e), pytrace=False)
        return (out, err) if with_stderr else out
    full_env = with_harness(dict(os.environ))
    full_env.setdefault("PYCOLL_TIMEOUT", "60")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(with_harness(env) if "PYTHONPATH" in env else env)
    cmd = [mpiexec(), *mpiexec_args, "-n", str(nprocs), sys.executable, str(path), *args]
    with tempfile.TemporaryDirectory(prefix="pycoll-job-") as results:
        full_env["TEST_RESULTS_DIR"] = results  # checks.run_main reports a rank's error here
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\n{e.stdout}\n{e.stderr}")
        if proc.returncode not in returncodes:
            errors = rank_errors(Path(results))
            pytest.fail(
                f"{worker} {' '.join(args)} on {nprocs} ranks exited with {proc.returncode}"
                + "".join(f"\n  {line}" for line in errors)
                + f"\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}",
                pytrace=False,
            )
    return (proc.stdout, proc.stderr) if with_stderr else proc.stdout


def rank_errors(folder: Path) -> list[str]:
    """What each rank that failed reported (checks.run_main): 'rank r: Type: message'."""
    lines = []
    for path in sorted(folder.glob("result-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        res = json.loads(path.read_text())
        lines.append(f"rank {path.stem.split('-')[1]}: {res['type']}: {res['message']}")
    return lines


def fake_tool(directory: Path, name: str, script: str) -> Path:
    """An executable shell script `name` in `directory` (a stand-in for a system tool)."""
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def our_segments() -> set:
    """This user's pycollectives segments currently in /dev/shm."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"pycoll-{os.getuid()}-")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """This process's environment without MPI's launch variables (for other launchers), with
    the harness on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env.update(PYTHONUNBUFFERED="1", PYCOLL_TIMEOUT="30", **extra)
    return with_harness(env)


class Zygote:
    """zygote.py, started at the first env:// launch: it has imported torch once and forks each
    rank from itself (a fresh Python per rank spent 2.7 CPU-s importing torch). `enter`: the
    command prefix that runs it inside a namespace node (``NamespaceNodes.command``)."""

    def __init__(self, enter=()):
        self.proc = subprocess.Popen(
            [*enter, sys.executable, str(HARNESS / "zygote.py")], env=clean_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )  # fmt: skip
        self.exited: dict[int, int] = {}
        self.pending = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _line(self, deadline: float) -> str | None:
        """The zygote's next line, or None at `deadline`."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the zygote ended (status {self.proc.wait()})")
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def _take(self, line: str):
        what, pid, *code = line.split()
        if what == "exited":
            self.exited[int(pid)] = int(code[0])
        return what, int(pid)

    def start(self, argv: list[str], env: dict, out: Path, err: Path) -> int:
        request = {"argv": argv, "env": env, "out": str(out), "err": str(err)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        deadline = time.monotonic() + 60
        while (line := self._line(deadline)) is not None:
            what, pid = self._take(line)
            if what == "started":
                return pid
        raise RuntimeError("the zygote did not fork a rank in 60 s")

    def wait(self, pids: list[int], deadline: float) -> list[int]:
        """The pids among `pids` still running at `deadline` (the others' codes in exited)."""
        while any(p not in self.exited for p in pids):
            line = self._line(deadline)
            if line is None:
                break
            self._take(line)
        return [p for p in pids if p not in self.exited]

    def kill(self, pid: int):
        """SIGKILL to a rank it forked (by its pid there)."""
        self.proc.stdin.write(json.dumps({"kill": pid}).encode() + b"\n")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_ZYGOTES: dict = {}  # None: this machine's; i: namespace node i's


def zygote(node: int | None = None) -> Zygote:
    z = _ZYGOTES.get(node)
    if z is None or not z.alive():
        from harness import netns

        enter = () if node is None else netns.shared().command(node, [])
        z = _ZYGOTES[node] = Zygote(enter)
    return z


def close_zygote():
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


def _namespace_placement(nprocs: int, rank_env) -> list | None:
    """Where each rank of an env:// launch that names its machine (PYCOLL_HOST_ID in
    `rank_env`) runs: on namespace node k for the k-th machine named, where namespace nodes can
    be made (harness/netns.py; PYCOLL_TEST_NO_NAMESPACES=1 keeps them emulated), else None."""
    from harness import netns

    if rank_env is None or os.environ.get("PYCOLL_TEST_NO_NAMESPACES") == "1":
        return None
    hosts = [rank_env(r).get("PYCOLL_HOST_ID") for r in range(nprocs)]
    if None in hosts or len(set(hosts)) > 3 or netns.shared() is None:
        return None
    names = list(dict.fromkeys(hosts))
    return [names.index(h) for h in hosts]


def run_env_launch(nprocs: int, worker: str, *args: str, rank_env=None, timeout: float = 120,
                   **env) -> list[str]:  # fmt: skip
    """Runs `worker` as an env:// launcher would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    no mpiexec), with `env` on every rank and `rank_env(r)` on rank r; returns each rank's
    stdout. A rank that fails or hangs fails the test, named with its output. The ranks are
    forked from the zygote, where torch is imported already. Ranks that name their machine
    (PYCOLL_HOST_ID) run on namespace nodes instead where those can be made, one per machine
    named, without the variable: a zygote inside each node forks them there."""
    port = str(free_port())
    placed = _namespace_placement(nprocs, rank_env)
    master = "127.0.0.1"
    if placed is not None:  # each machine a namespace node: rank 0's serves the store
        from harness import netns

        master = netns.shared().address(placed[0])
        port = str(netns.shared().free_port(placed[0]))
    zs = [zygote(None if placed is None else placed[r]) for r in range(nprocs)]
    box = Path(tempfile.mkdtemp(prefix="pycoll-env-"))
    pids = []
    try:
        for r in range(nprocs):
            extra = {**env, **(rank_env(r) if rank_env else {})}
            if placed is not None:  # found from its host name, as on a cluster
                extra.pop("PYCOLL_HOST_ID")
            launch = dict(RANK=str(r), WORLD_SIZE=str(nprocs), MASTER_ADDR=master,
                          MASTER_PORT=port)  # fmt: skip
            argv = [str(worker_path(worker)), *args]
            pids.append(zs[r].start(argv, clean_env(**launch, **extra), box / f"out-{r}",
                                    box / f"err-{r}"))  # fmt: skip
        deadline = time.monotonic() + timeout
        hung = [r for r in range(nprocs) if zs[r].wait([pids[r]], deadline)]
        for r in hung:
            zs[r].kill(pids[r])
        for r in hung:
            zs[r].wait([pids[r]], time.monotonic() + 30)
        outs = [((box / f"out-{r}").read_text(), (box / f"err-{r}").read_text())
                for r in range(nprocs)]  # fmt: skip
    finally:
        for r, pid in enumerate(pids):
            if pid not in zs[r].exited:
                zs[r].kill(pid)
        shutil.rmtree(box, ignore_errors=True)
    codes = [zs[r].exited.pop(pid, None) for r, pid in enumerate(pids)]
    failed = [(r, code, o) for r, (code, o) in enumerate(zip(codes, outs)) if code]
    if hung or failed:
        report = "; ".join(f"rank {r} exited with {code}: {(o[1] or o[0])[-1500:]}"
                           for r, code, o in failed)  # fmt: skip
        pytest.fail(f"{worker} {' '.join(args)} on {nprocs} ranks (env://): "
                    f"{f'ranks {hung} hung; ' if hung else ''}{report}", pytrace=False)  # fmt: skip
    return [o[0] for o in outs]
