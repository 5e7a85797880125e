"""A timeline of the job: ``PYCOLL_TRACE=path`` writes a Chrome trace (JSON, openable in
Perfetto or chrome://tracing) of every collective and point-to-point call, and of the spans
a program marks (``trace.span``; the training example marks its steps).

Each rank writes its own file when it exits (and whenever a communicator closes): `path`
with ``{rank}`` replaced by the rank, or, without ``{rank}``, ``<stem>.rank<R><suffix>``
(``trace.json`` -> ``trace.rank0.json``). One process per rank (``pid`` = rank); on it, one
track for the calling thread and one per communicator for the asynchronous collectives its
progress thread runs. Every collective event carries its bytes, algorithm, sequence number
and rank. ``python -m pycollectives.trace merge -o all.json trace.rank*.json`` merges ranks
into one file (ranks of one machine share its clock).

    PYCOLL_TRACE=trace.json mpiexec -n 4 python -m pycollectives.examples.train
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from pycollectives import _C
from pycollectives.checkpoint import write_atomically

_PATH = os.environ.get("PYCOLL_TRACE") or None
_now = time.perf_counter_ns  # CLOCK_MONOTONIC: the clock of the native Work's times too

_lock = threading.Lock()
# Finished events as (name, start ns, end ns, track, args[, category]): dicts at write time.
_events: list = []
_pending: list = []  # (event, native work) of asynchronous calls not yet seen complete
_tracks: dict = {}  # tid -> track name
_comm_ids = itertools.count(1)
_rank = None


def enabled() -> bool:
    """Whether this process writes a trace (``PYCOLL_TRACE`` was set when it started, or
    ``enable`` was called)."""
    return _PATH is not None


def enable(path: str):
    """Traces from now on into `path` (as ``PYCOLL_TRACE``): communicators made after this
    call record their calls; ones made before stay as they are."""
    global _PATH
    _PATH = str(path)


def _process_rank() -> int:
    from pycollectives.launch import rank_from_env

    return rank_from_env()


def _us(ns: int) -> float:
    return ns / 1000.0


class _Span:
    __slots__ = ("name", "args", "t0")

    def __init__(self, name, args):
        self.name, self.args = name, args

    def __enter__(self):
        self.t0 = _now()
        return self

    def __exit__(self, *exc):
        _events.append((self.name, self.t0, _now(), 0, self.args, "user"))
        return False


def span(name: str, **args):
    """A context manager that records `name` (with `args`) as one span of this thread's
    track; a no-op unless tracing."""
    return _Span(name, args) if _PATH is not None else nullcontext()


def _algorithm(comm, name, code, nbytes) -> str:
    if code:
        return _C.ALGORITHMS[code]
    try:
        return comm.algorithm_for(name, nbytes)
    except (ValueError, TypeError, AttributeError, RuntimeError):
        return "auto"


def _nbytes(a) -> int:
    return int(getattr(a, "nbytes", 0) or 0)


def instrument(comm):
    """Records `comm`'s calls (a no-op unless tracing): wraps its dispatch in place."""
    if _PATH is None:
        return
    global _rank
    if _rank is None:
        _rank = _process_rank()
        atexit.register(write)
    cid = next(_comm_ids)
    calling, progress = 0, cid
    _tracks[calling] = "calls"
    _tracks[progress] = f"communicator {cid} ({comm.size} ranks): asynchronous"
    run, batch_p2p, barrier = comm._run, comm.batch_p2p, comm.barrier
    algorithms: dict = {}  # (collective, algorithm code, bytes) -> name: asked once
    dtypes: dict = {}

    def record(name, t0, result, async_op, args):
        t1 = _now()
        args["rank"] = comm.rank
        args["communicator"] = cid
        native = getattr(result, "_native", None) if async_op else None
        if native is not None:
            args["seq"] = getattr(native, "seq", None)
            args["async"] = True
            with _lock:
                _pending.append(((name, t0, t1, progress, args), native))
        else:
            if "seq" in args and args["seq"] is None:
                args["seq"] = comm.seq  # this call's number: the count of calls so far
            _events.append((name, t0, t1, calling, args))  # list.append is atomic

    def traced_run(call, result):
        name, x, out = call.collective, call.x, call.out
        t0 = _now()
        r = run(call, result)
        nbytes = _nbytes(x)
        key = (name, call.algorithm, nbytes)
        algo = algorithms.get(key)
        if algo is None:
            algo = algorithms[key] = _algorithm(comm, name, call.algorithm, nbytes)
        dt = getattr(x, "dtype", None)
        dname = dtypes.get(dt)
        if dname is None:
            dname = dtypes[dt] = str(dt or "")
        args = {"bytes": nbytes, "out_bytes": _nbytes(out), "dtype": dname, "algorithm": algo,
                "seq": None}  # fmt: skip
        if call.root and name in ("broadcast", "reduce", "gather", "scatter"):
            args["root"] = call.root
        record(name, t0, r, call.async_op, args)
        return r

    def traced_batch_p2p(ops, async_op=False, stream=None, _result=None):
        ops = list(ops)
        t0 = _now()
        r = batch_p2p(ops, async_op, stream, _result)
        kinds = sorted({o.kind for o in ops})
        name = kinds[0] if len(kinds) == 1 and len(ops) == 1 else "batch_p2p"
        args = {"bytes": sum(_nbytes(o.array) for o in ops),
                "ops": [f"{o.kind} {'to' if o.kind == 'send' else 'from'} {o.peer} tag {o.tag}"
                        for o in ops]}  # fmt: skip
        record(name, t0, r if async_op else None, async_op, args)
        return r

    def traced_barrier(async_op=False):
        t0 = _now()
        r = barrier(async_op)
        record("barrier", t0, r, async_op, {"bytes": 0, "seq": None})
        return r

    comm._run, comm.batch_p2p, comm.barrier = traced_run, traced_batch_p2p, traced_barrier


def _settle():
    """Moves asynchronous calls that have completed to the events, with the times their
    progress thread ran them."""
    with _lock:
        waiting = []
        for event, native in _pending:
            if not native.is_completed():
                waiting.append((event, native))
                continue
            times = getattr(native, "times", None)  # host work: when its thread ran it
            if times is not None and times[1]:
                event = (event[0], times[0], times[1], *event[3:])
            _events.append(event)
        _pending[:] = waiting


def _chrome(event, rank) -> dict:
    name, t0, t1, tid, args = event[:5]
    cat = event[5] if len(event) > 5 else "collective"
    return {"name": name, "cat": cat, "ph": "X", "ts": _us(t0), "dur": _us(t1 - t0),
            "pid": rank, "tid": tid, "args": args}  # fmt: skip


def trace_path(rank: int, path: str | None = None) -> Path:
    """Where rank `rank` writes its trace."""
    path = path or _PATH
    if "{rank}" in path:
        return Path(path.replace("{rank}", str(rank)))
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


def _document(events, ranks) -> dict:
    meta = []
    for r in sorted(ranks):
        meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write():
    """Writes this rank's trace file (atomically) with everything recorded so far."""
    if _PATH is None or _rank is None:
        return
    _settle()
    with _lock:
        events = [_chrome(e, _rank) for e in list(_events)]
        tracks = dict(_tracks)
    for tid, name in tracks.items():
        events.append({"name": "thread_name", "ph": "M", "pid": _rank, "tid": tid,
                       "args": {"name": name}})  # fmt: skip
    text = json.dumps(_document(events, [_rank])).encode()
    write_atomically(trace_path(_rank), lambda f: f.write(text))


def merge(paths, out):
    """Merges per-rank trace files into one."""
    events, ranks = [], set()
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for e in doc["traceEvents"]:
            if e.get("ph") == "M" and e["name"].startswith("process_"):
                continue
            ranks.add(e["pid"])
            events.append(e)
    Path(out).write_text(json.dumps(_document(events, ranks)))
    return len(events)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pycollectives.trace",
        description="merge per-rank PYCOLL_TRACE files; analyze flight records",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge per-rank traces into one Chrome trace")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("traces", nargs="+")
    a = sub.add_parser(
        "analyze", help="who is behind, where ranks disagree, what each waits for (flight records)"
    )
    a.add_argument("directory", help="PYCOLL_FLIGHT_DIR or one communicator's directory in it")
    args = ap.parse_args(argv)
    if args.cmd == "analyze":
        from pycollectives.trace import flight

        print(flight.analyze(args.directory))
        return 0
    n = merge(args.traces, args.output)
    print(f"{args.output}: {n} events from {len(args.traces)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
