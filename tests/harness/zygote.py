"""A process that imports torch once and forks the ranks of env:// launches from itself.

Importing torch costs 2.7 CPU-s on a 2-core machine, and every rank of an env:// launch (the
nodes' tests, the env bootstrap) imports it for its store and gloo: most of what such a launch
took. A rank forked from here finds torch and numpy imported; everything else (pycollectives,
mpi4py, the worker) it imports itself, after its environment is in place, as a launched process
would, and it ends as one does (exit handlers, output flushed).

Protocol, a line each way: a request on stdin is JSON {"argv": [script, ...], "env": {...},
"out": path, "err": path}; the answer on stdout is "started PID" once that rank is forked, and
"exited PID CODE" (CODE as subprocess reports it: -N for signal N) when it ends. {"kill": PID}
kills a rank (SIGKILL) with no answer: PID is this process's, which on a namespace node
(harness/netns.py, where it runs inside the node) is not the test's.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import sys

from pool import POOL_ENV  # noqa: E402 - this file's folder, the harness

# The pools' environment, as everywhere in the suite (conftest): one BLAS and OpenMP thread
# keeps this process single-threaded, which it must be, since a fork copies only the thread
# that forks.
for _name, _value in POOL_ENV.items():
    os.environ.setdefault(_name, _value)

import numpy  # noqa: E402, F401 - imported once here, for every rank forked below
import torch  # noqa: E402, F401

BASE_PATH = list(sys.path[1:])  # without this file's own folder


def become(request: dict, keep_closed: list[int]):
    """In the forked child: the rank `request` describes. Returns only by raising SystemExit
    (the worker's own, or 0 at its end), which ends this process as the worker's would."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keep_closed:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, path in ((1, request["out"]), (2, request["err"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0)  # noqa: SIM115 - the process's own, for its life
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *BASE_PATH]
    sys.argv = list(request["argv"])
    import runpy

    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def main():
    reply = os.dup(1)  # answers go here; a rank's fd 1 is its own output file
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    requests = os.fdopen(0, "rb", buffering=0)
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                os.write(reply, b"exited %d %d\n" % (pid, os.waitstatus_to_exitcode(status)))
        if 0 in ready:
            data = requests.read(65536)
            if not data:  # the test run is over
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:  # its pid is this namespace's (a namespace node's)
                    try:
                        os.kill(request["kill"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    continue
                pid = os.fork()
                if pid == 0:
                    become(request, [reply, wake_r, wake_w])
                os.write(reply, b"started %d\n" % pid)


if __name__ == "__main__":
    main()
