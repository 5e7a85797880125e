"""Rank pools: one mpiexec job per rank count (and launch environment) that runs case after case.

Starting a job costs a fresh Python, numpy, mpi4py and MPI set-up on every rank (0.5-1.3 s on
2 cores for 2-6 ranks, 7 s with torch on 4): most of what a small multi-rank test took. A pool
starts once and runs every case sent to it (rank.py), each still its own pytest item with its
own verdict. A case is a worker's ``main()`` with its arguments and ``PYCOLL_*`` environment
(read when a communicator is made, so they differ per case); other variables (PYTHONPATH, MPI's
own settings) are the launch environment and key the pool. A case that fails on any rank is
reported with the rank, the case and the error (the worker's own assertion message: what
differed), and ends its pool: the next case starts a fresh one.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Per-case variables: read by the package when a communicator is made. PYCOLL_TRACE is read at
# import and gathers a process's calls: a case that sets it needs a job of its own.
CASE_PREFIX = "PYCOLL_"
OWN_JOB_VARIABLES = ("PYCOLL_TRACE",)
# Idle ranks of other pools sleep; one BLAS thread per process keeps BLAS from oversubscribing
# the cores. And malloc keeps what a case frees for the next one: by default glibc hands freed
# arrays back to the kernel (munmap, or a trim of the heap), and the next array of that size is
# faulted in and zeroed again page by page. In test_collectives.py that was 4.1 million page
# faults and 32 of its 85 CPU-s (system time); with arrays up to 32 MiB (glibc's largest
# threshold) taken from a heap that is never trimmed, 0.33 million and 19 s (50 s -> 42 s).
MALLOC_KEEPS_FREED = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
POOL_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "GLIBC_TUNABLES": MALLOC_KEEPS_FREED,
}


class CaseFailed(Exception):
    """A case failed on some rank: the message says which, and how."""


def split_env(env: dict) -> tuple[dict, dict]:
    """(per-case variables, launch variables) of a case's environment."""
    case = {k: v for k, v in env.items() if k.startswith(CASE_PREFIX)}
    return case, {k: v for k, v in env.items() if k not in case}


class RankPool:
    """One job of `nranks` ranks running rank.py. Cases are files (BOX/case-K.json); a rank
    waits for the next one blocked on a pipe of its own (BOX/wake-R), and tells it is done
    through one pipe that this side waits on (BOX/done), so neither side polls and an idle
    pool takes no CPU."""

    def __init__(self, mpiexec: str, nranks: int, harness: Path, launch_env: dict,
                 nodes=None, counts=None):  # fmt: skip
        """`nodes` (harness/netns.py) and `counts`: the ranks on namespace nodes, counts[i] on
        node i in turn (hydra's order) instead of on this machine."""
        self.nranks = nranks
        self.nodes, self.node_of = nodes, []
        while counts and len(self.node_of) < nranks:
            self.node_of += [i for i, c in enumerate(counts) for _ in range(c)]
        self.box = Path(tempfile.mkdtemp(prefix="pycoll-pool-"))
        self.k = 0
        # O_RDWR: opening does not wait for the other end, and reads never see end-of-file.
        self.wake = []
        for r in range(nranks):
            os.mkfifo(self.box / f"wake-{r}")
            self.wake.append(os.open(self.box / f"wake-{r}", os.O_RDWR))
        os.mkfifo(self.box / "done")
        self.done = os.open(self.box / "done", os.O_RDWR | os.O_NONBLOCK)
        self.pending = b""
        env = {**os.environ, **POOL_ENV, **launch_env, "PYTHONUNBUFFERED": "1"}
        where, watch = [], os.getpid()
        if nodes is not None:  # the ranks die with the nodes, whose holders die with pytest
            where, watch = nodes.mpiexec_args(list(counts)), 0
            env.update(nodes.env())
            for name in ("PYCOLL_RANKS_PER_NODE", "PYCOLL_HOST_ID"):
                env.pop(name, None)
        cmd = [mpiexec, *where, "-n", str(nranks), sys.executable, str(HERE / "rank.py")]
        cmd += [str(self.box), str(harness), str(watch)]
        self.log = open(self.box / "pool.log", "w+b")  # what ranks print outside a case
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def post(self, k: int, case: dict):
        """Case `k` for every rank: its file, then a line on each rank's wake-up pipe."""
        tmp = self.box / f".case-{k}"
        tmp.write_text(json.dumps(case))
        tmp.rename(self.box / f"case-{k}.json")
        for fd in self.wake:
            os.write(fd, b"%d\n" % k)

    def finished(self, wait: float) -> list[int]:
        """Ranks that reported the current case done (lines "K R" on the done pipe), waiting
        up to `wait` seconds for the first."""
        ready, _, _ = select.select([self.done], [], [], max(wait, 0.0))
        if not ready:
            return []
        try:
            self.pending += os.read(self.done, 65536)
        except BlockingIOError:
            return []
        *lines, self.pending = self.pending.split(b"\n")
        return [int(line.split()[1]) for line in lines if int(line.split()[0]) == self.k - 1]

    def run(self, case: dict, timeout: float) -> tuple[str, str]:
        """Runs `case` on every rank; (stdout, stderr) of all ranks, rank by rank. CaseFailed
        (after which this pool is closed) if any rank failed or the case took too long."""
        k, n = self.k, self.nranks
        self.k += 1
        self.post(k, case)
        deadline = time.monotonic() + timeout
        results: dict[int, dict] = {}
        failed_at = None
        while len(results) < n:
            now = time.monotonic()
            # A failed rank's peers may be stuck in the case: give them a moment to fail too.
            if failed_at is not None and now - failed_at > 3.0:
                break
            if now > deadline or not self.alive():
                break
            limit = deadline if failed_at is None else failed_at + 3.0
            for r in self.finished(min(limit - now, 1.0)):  # 1 s: to notice a job that ended
                results[r] = json.loads((self.box / f"result-{k}-{r}.json").read_text())
                if not results[r]["ok"] and failed_at is None:
                    failed_at = time.monotonic()
        out, err = self.outputs(k)
        bad = {r: res for r, res in results.items() if not res["ok"]}
        if len(results) == n and not bad:
            self.cleanup(k)
            return out, err
        if len(results) < n and self.alive():  # hung ranks: ask them where they are
            self.dump_stacks()
            out, err = self.outputs(k)
        text = self.describe(case, k, results, bad, timeout, out, err)  # while the job lives
        self.close(kill=True)
        raise CaseFailed(text)

    def outputs(self, k: int) -> tuple[str, str]:
        def read(kind):
            texts = []
            for r in range(self.nranks):
                try:
                    texts.append((self.box / f"{kind}-{k}-{r}").read_text(errors="replace"))
                except FileNotFoundError:
                    pass
            return "".join(texts)

        return read("out"), read("err")

    def cleanup(self, k: int):
        for path in self.box.glob(f"*-{k}*"):
            if path.name.startswith(("case-", "result-", "out-", "err-")):
                path.unlink(missing_ok=True)

    def signal_rank(self, r: int, sig: int):
        """`sig` to rank r (its pid translated from its node's, on a namespace node)."""
        try:
            pid = int((self.box / f"pid-{r}").read_text())
            if self.nodes is not None:
                pid = self.nodes.host_pid(self.node_of[r], pid)
            if pid:
                os.kill(pid, sig)
        except (OSError, ValueError):
            pass

    def dump_stacks(self):
        for r in range(self.nranks):
            self.signal_rank(r, signal.SIGUSR1)
        time.sleep(0.5)

    def describe(self, case, k, results, bad, timeout, out, err) -> str:
        if "module" in case:
            worker = f"-m {case['module']}"
        else:
            worker = Path(case.get("worker") or case["script"]).name
        what = " ".join([worker, *case["argv"]])
        env = " ".join(f"{k}={v}" for k, v in case.get("env", {}).items() if k != "PYCOLL_TIMEOUT")
        head = f"{what} on {self.nranks} ranks" + (f" ({env})" if env else "")
        lines = []
        for r, res in sorted(bad.items()):
            lines.append(f"rank {r}: {res['type']}: {res['message']}")
        missing = [r for r in range(self.nranks) if r not in results]
        if missing:
            why = "the job ended" if not self.alive() else f"not done after {timeout:.0f} s"
            if bad:
                why = "still running when the others had failed"
            lines.append(f"ranks {missing}: {why}")
        text = head + ":\n  " + "\n  ".join(lines)
        for r, res in sorted(bad.items())[:2]:
            text += f"\n--- rank {r} traceback ---\n{res['traceback'][-3000:]}"
        text += f"\n--- stdout (all ranks) ---\n{out[-3000:]}\n--- stderr ---\n{err[-4000:]}"
        try:
            self.log.seek(0)
            log = self.log.read().decode(errors="replace")
            if log.strip():
                text += f"\n--- pool log ---\n{log[-2000:]}"
        except (OSError, ValueError):
            pass
        return text

    def close(self, kill: bool = False):
        if self.proc.poll() is None and not kill:
            self.post(self.k, {"stop": True})
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill = True
        if self.proc.poll() is None:  # the ranks first: mpiexec then ends on its own
            for r in range(self.nranks):
                self.signal_rank(r, signal.SIGKILL)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        for fd in (*self.wake, self.done):
            os.close(fd)
        shutil.rmtree(self.box, ignore_errors=True)


def on_namespace_nodes(nranks: int, case: dict) -> tuple:
    """(nodes, counts, case): a case that emulates nodes (``PYCOLL_RANKS_PER_NODE``) runs on
    namespace nodes instead where they can be made (harness/netns.py) and hold its placement,
    found from the host names as on a cluster: the variable is gone from its environment
    (``PYCOLL_TEST_NODES`` says what it was). Else (None, None, case) unchanged.
    ``PYCOLL_TEST_NO_NAMESPACES=1`` keeps every case emulated, ``PYCOLL_TEST_EMULATED_NODES=1``
    in a case's environment that case."""
    given = case.get("env", {}).get("PYCOLL_RANKS_PER_NODE")
    if not given or os.environ.get("PYCOLL_TEST_NO_NAMESPACES") == "1":
        return None, None, case
    if case["env"].get("PYCOLL_TEST_EMULATED_NODES") == "1":  # the case's own choice
        return None, None, case
    from harness import netns

    nodes = netns.shared()
    counts = nodes.placement(nranks, given) if nodes is not None else None
    if counts is None:
        return None, None, case
    env = {k: v for k, v in case["env"].items() if k != "PYCOLL_RANKS_PER_NODE"}
    return nodes, tuple(counts), {**case, "env": {**env, "PYCOLL_TEST_NODES": given}}


class Pools:
    """The pools of a test session, one per (ranks, launch environment), made on first use."""

    def __init__(self):
        self.pools: dict[tuple, RankPool] = {}

    def run(self, mpiexec, nranks, harness, case, launch_env, timeout):
        nodes, counts, case = on_namespace_nodes(nranks, case)
        key = (nranks, tuple(sorted(launch_env.items())), counts)
        pool = self.pools.get(key)
        if pool is None or not pool.alive():
            pool = self.pools[key] = RankPool(mpiexec, nranks, harness, launch_env, nodes,
                                              counts)  # fmt: skip
        try:
            return pool.run(case, timeout)
        except CaseFailed:
            del self.pools[key]
            raise

    def close_with(self, env: dict):
        """Closes the pools whose launch environment holds every item of `env`: their ranks
        end (a GPU test's MPS daemon, say, cannot quit while they hold its clients)."""
        for key in [k for k in self.pools if set(env.items()) <= set(k[1])]:
            self.pools.pop(key).close()

    def close(self):
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


POOLS = Pools()
