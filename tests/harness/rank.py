"""One rank of a pool (see pool.py): runs case after case in this process, as mpiexec started it.

Usage (by pool.py): mpiexec -n N python rank.py BOX HARNESS PYTEST_PID

Cases arrive as files BOX/case-K.json, K = 0, 1, ..., each announced by a line "K" on the rank's
pipe BOX/wake-R: {"worker": path of a worker script (its ``main()`` is run), or "module"
(``python -m``) or "script" (run as ``__main__``), "argv": [...], "env": {...}}. Each rank runs
the worker's ``main()`` with ``sys.argv`` and the environment set as a job of its own would have
them, on a fresh duplicate of MPI_COMM_WORLD (so that a message a case left unreceived cannot
reach the next one), its stdout and stderr (Python's and the native layer's) in BOX/out-K-R and
BOX/err-K-R, then closes the communicators the case left open and writes BOX/result-K-R.json:
``{"ok": true}`` or the exception, its message and traceback, and says so with a line "K R" on
the pipe BOX/done. After a failure the pool is discarded (peers may be stuck in the failed
case), so a failed case is never followed by another in this process. {"stop": true} ends the
loop.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback
import weakref
from pathlib import Path


class Wake:
    """This rank's wake-up pipe (BOX/wake-R): a line "K" when case K is ready. Waiting on it
    blocks in the kernel, waking every 2 s to exit if the pytest process that owns the pool
    has gone."""

    def __init__(self, path: Path, pytest_pid: int):
        self.fd = os.open(path, os.O_RDWR)
        self.pytest_pid = pytest_pid
        self.pending = b""

    def next(self) -> int:
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.fd], [], [], 2.0)
            if ready:
                self.pending += os.read(self.fd, 4096)
                continue
            if self.pytest_pid <= 0:  # on a namespace node: its end is this process's
                continue
            try:
                os.kill(self.pytest_pid, 0)
            except ProcessLookupError:
                os._exit(3)
        line, self.pending = self.pending.split(b"\n", 1)
        return int(line)


class Redirect:
    """fds 1 and 2 (and so every write, Python's or native) into two files, for one case."""

    def __init__(self, out: Path, err: Path):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)

    def restore(self):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


def load(path: Path):
    """The worker script at `path` as a module, imported once per process (its folder on
    sys.path, for the workers it imports)."""
    mod_name = "pool_worker_" + path.stem
    module = sys.modules.get(mod_name)
    if module is None:
        if str(path.parent) not in sys.path:
            sys.path.insert(1, str(path.parent))
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        gc.freeze()  # what it imported is long-lived: see run_case
    return module


def track_communicators():
    """Every pc.Communicator made from now on, in order (weakly): what a case leaves open is
    closed after it, in the order made (the same on every rank)."""
    import pycollectives as pc

    made = []
    init = pc.Communicator.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    pc.Communicator.__init__ = recording_init
    return made


def run_case(case: dict, made: list) -> dict:
    from mpi4py import MPI

    saved_env = dict(os.environ)  # restored whole: a case may set more (torch's MASTER_PORT)
    # and the native modules, which a case may replace by a fake (cuda_nogpu_fake_native.py,
    # p2p_gpu_staged.py): the next case in this pool gets the real ones
    saved_modules = {k: v for k, v in sys.modules.items() if k.startswith("pycollectives._")}
    os.environ.update(case.get("env", {}))
    saved_argv = sys.argv
    world = MPI.COMM_WORLD
    MPI.COMM_WORLD = world.Dup()  # a communicator of the case's own
    del made[:]
    t0 = time.monotonic()
    result = {"ok": True}
    try:
        if "module" in case:  # python -m MODULE ARGS
            sys.argv = [case["module"], *case["argv"]]
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
        elif "script" in case:  # python SCRIPT ARGS
            sys.argv = [case["script"], *case["argv"]]
            runpy.run_path(case["script"], run_name="__main__")
        else:
            sys.argv = [case["worker"], *case["argv"]]
            load(Path(case["worker"])).main()
    except SystemExit as e:  # a CLI's normal end
        if e.code not in (None, 0):
            result = failure(e)
    except BaseException as e:  # noqa: BLE001 - reported to pytest, which decides
        result = failure(e)
    if result["ok"]:
        try:
            for ref in made:
                comm = ref()
                if comm is not None:
                    comm.close()
            MPI.COMM_WORLD.Free()
        except BaseException as e:  # noqa: BLE001
            result = failure(e, "closing what the case left open")
    del made[:]
    gc.collect()
    # What is left is long-lived (modules the case imported, torch's among them, and their
    # caches): out of the collector's sight from now on. Otherwise every later collection,
    # several a second in a case that makes many small objects, walks all of it again: with
    # torch loaded that was half of a pool rank's CPU time.
    gc.freeze()
    MPI.COMM_WORLD = world
    sys.argv = saved_argv
    package = sys.modules.get("pycollectives")
    for name in [k for k in sys.modules if k.startswith("pycollectives._")]:
        if name not in saved_modules and getattr(sys.modules[name], "__file__", None) is None:
            del sys.modules[name]  # a fake, first imported by the case: gone with it
            if package is not None and hasattr(package, name.rsplit(".", 1)[1]):
                delattr(package, name.rsplit(".", 1)[1])
    for name, module in saved_modules.items():
        sys.modules[name] = module
        if package is not None:
            setattr(package, name.rsplit(".", 1)[1], module)
    os.environ.clear()
    os.environ.update(saved_env)
    result["seconds"] = time.monotonic() - t0
    return result


def failure(e: BaseException, where: str = "") -> dict:
    return {
        "ok": False,
        "type": type(e).__name__,
        "message": (f"{where}: " if where else "") + str(e),
        "traceback": traceback.format_exc(),
    }


def main():
    box, harness, pytest_pid = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    sys.path.insert(0, str(harness))  # checks.py, which every worker imports
    from mpi4py import MPI

    import pycollectives  # noqa: F401 - loaded once, before any case

    rank = MPI.COMM_WORLD.Get_rank()
    (box / f"pid-{rank}").write_text(str(os.getpid()))
    made = track_communicators()
    wake = Wake(box / f"wake-{rank}", pytest_pid)
    done = os.open(box / "done", os.O_WRONLY)
    while True:
        k = wake.next()
        case = json.loads((box / f"case-{k}.json").read_text())
        if case.get("stop"):
            break
        redirect = Redirect(box / f"out-{k}-{rank}", box / f"err-{k}-{rank}")
        # A case that hangs is dumped on request (pool.py sends SIGUSR1 before killing).
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        try:
            result = run_case(case, made)
        finally:
            faulthandler.unregister(signal.SIGUSR1)
            redirect.restore()
        tmp = box / f".result-{k}-{rank}"
        tmp.write_text(json.dumps(result))
        tmp.rename(box / f"result-{k}-{rank}.json")
        os.write(done, b"%d %d\n" % (k, rank))  # one short write: never split between ranks
        if not result["ok"]:
            break  # the pool is discarded; peers may be stuck in the failed case


if __name__ == "__main__":
    main()
