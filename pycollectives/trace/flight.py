"""The flight recorder: every communicator keeps a ring of its last calls
(``PYCOLL_FLIGHT_RECORDER`` entries, 1024 by default; 0 turns it off), always on. Each entry
holds the call's sequence number, collective (or send / recv), count, dtype, op, root or peer,
tag, its state (queued, started, ended, failed) and when each state began.

When a communicator fails (a timeout, a mismatch, a peer that died, an abort, a revocation),
each rank writes its ring to ``DIR/<communicator>/rank<R>.json`` (``DIR``: ``PYCOLL_FLIGHT_DIR``,
default ``$TMPDIR/pycollectives-flight``); ``kill -USR1 PID`` makes a process write every
communicator's ring at any moment, from a thread of its own, even while it is stuck. A timeout's
message names its file. Then, over every rank's files::

    python -m pycollectives.trace analyze DIR

names the ranks that are behind, the first call where ranks disagree (and a rank that skipped
one), and what each rank was doing when it wrote its ring.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

STATES = ("empty", "queued", "started", "ended", "failed")
STARTED, ENDED, FAILED = 2, 3, 4  # codes of the native recorder (FlightState)
BARRIER = 100  # its kind for a barrier (kFlightBarrier)


def base_dir(opts) -> str:
    """Where the communicators of a job write their rings (``PYCOLL_FLIGHT_DIR``)."""
    return opts.flight_dir or os.path.join(tempfile.gettempdir(), "pycollectives-flight")


def comm_id(segment_name: str) -> str:
    """A communicator's name in the dump directory: its rank 0's shared-memory segment (the
    same on every rank, unique on the machine)."""
    return segment_name.lstrip("/")


def attach(host, opts, ident: str, rank: int, size: int):
    """Points `host`'s recorder (a ``_C.HostComm``) at its file for rank `rank` of `size`."""
    if opts.flight_entries == 0:
        return
    path = os.path.join(base_dir(opts), ident, f"rank{rank}.json")
    host.set_flight_dump(path, rank, size, ident)


def dump(comm, reason: str = "asked") -> bool:
    """Writes `comm`'s flight record now (a ``pycollectives.Communicator``); False where it
    keeps none (recorder off, or a communicator with no shared-memory part)."""
    backend = comm._host  # HostBackend (its HostComm: .c) or Hierarchical (its node's: .host)
    host = getattr(backend, "c", None) or getattr(backend, "host", None)
    return bool(host is not None and host.flight_dump(reason))


# -- the analyzer --------------------------------------------------------------------------------


def load(directory) -> dict:
    """{communicator id: {rank: dump}} of every ``rank*.json`` under `directory`."""
    out: dict = {}
    for f in sorted(Path(directory).rglob("rank*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        doc["file"] = str(f)
        out.setdefault(doc.get("comm", f.parent.name), {})[doc["rank"]] = doc
    return out


def describe(entry: dict) -> str:
    """``all_reduce #5 (4 x float32, sum)``, ``send to 1 (tag 3, 10 x int32)``."""
    call = entry["call"]
    if call in ("send", "recv"):
        where = "to" if call == "send" else "from"
        what = f"{entry['count']} x {entry['dtype']}"
        return f"{call} {where} rank {entry['peer']} (tag {entry['tag']}, {what})"
    if "outer_seq" in entry:  # a node-local phase of call #outer_seq across nodes
        size = f" ({entry['count']} x {entry['dtype']})" if "count" in entry else ""
        return f"node-local {call}{size} of #{entry['outer_seq']}"
    if call == "barrier":
        return f"barrier #{entry['seq']}"
    details = [f"{entry['count']} x {entry['dtype']}"]
    if "op" in entry:
        details.append(entry["op"])
    if "root" in entry:
        details.append(f"root {entry['root']}")
    return f"{call} #{entry['seq']} ({', '.join(details)})"


def _signature(entry: dict) -> tuple:
    return tuple(entry.get(k) for k in ("call", "count", "dtype", "op", "root"))


def _collectives(doc: dict) -> dict:
    """{seq: entry} of a dump's collectives (and barriers): the calls the user made, not the
    node-local phases of a call across nodes (which carry its ``outer_seq``)."""
    return {e["seq"]: e for e in doc["calls"] if e["seq"] and "outer_seq" not in e}


def analyze_comm(ident: str, docs: dict) -> list[str]:
    """The analyzer's lines for one communicator's dumps ({rank: dump})."""
    size = max(d["size"] for d in docs.values())
    lines = [f"communicator {ident}: {size} ranks, rings from {len(docs)}"]
    missing = [r for r in range(size) if r not in docs]
    if missing:
        lines.append(
            f"  no ring from rank(s) {', '.join(map(str, missing))}: the process died or "
            "was killed before writing one (ask a live one with kill -USR1 PID)"
        )
    calls = {r: _collectives(d) for r, d in docs.items()}
    reached = {r: max(c) if c else 0 for r, c in calls.items()}
    front, last = max(reached.values(), default=0), min(reached.values(), default=0)
    if front == last:
        lines.append(f"  every rank reached collective #{front}")
    else:
        # The furthest behind hold the others up; those in between wait for them.
        for r in sorted(r for r, s in reached.items() if s == last):
            entry = calls[r].get(last)
            what = f"{describe(entry)} ({entry['state']})" if entry else "none"
            others = ", ".join(f"rank {q} #{s}" for q, s in sorted(reached.items()) if s != last)
            lines.append(f"  rank {r} is furthest behind: its last collective is {what}; {others}")
    # The first sequence number where ranks called different things.
    common = set.intersection(*(set(c) for c in calls.values())) if calls else set()
    for seq in sorted(common):
        sigs = {r: _signature(c[seq]) for r, c in calls.items()}
        if len(set(sigs.values())) == 1:
            continue
        majority, _ = Counter(sigs.values()).most_common(1)[0]
        lines.append(f"  first disagreement at #{seq}:")
        groups: dict = {}
        for r, s in sorted(sigs.items()):
            groups.setdefault(s, []).append(r)
        for ranks in groups.values():
            r0 = ranks[0]
            lines.append(f"    rank(s) {', '.join(map(str, ranks))}: {describe(calls[r0][seq])}")
        for s, ranks in groups.items():
            if s == majority:
                continue
            for r in ranks:
                lines.extend(_skip_or_extra(r, seq, calls, sigs, majority))
        break
    else:
        if len(calls) > 1:
            lines.append("  no disagreement in the calls every ring still holds")
    for r in sorted(docs):
        d = docs[r]
        open_calls = [e for e in d["calls"] if e["state"] in ("queued", "started")]
        if open_calls:
            doing = "; ".join(f"{e['state']} {describe(e)}{_since(e, d)}" for e in open_calls[-4:])
        else:
            last = d["calls"][-1] if d["calls"] else None
            doing = "in no call of this communicator" + (
                f"; the last, {describe(last)}, {last['state']}" if last else ""
            )
        lines.append(f"  rank {r} (pid {d['pid']}, {d['host']}) when it wrote its ring: {doing}")
        lines.append(f"    because: {d['reason']}")
    return lines


def _skip_or_extra(r, seq, calls, sigs, majority) -> list[str]:
    """Whether rank r's calls from #seq on are the others' shifted by one (a skipped call) or
    the others' are its own shifted (an extra call)."""
    mine = calls[r]
    others = [q for q, s in sigs.items() if s == majority]
    ref = calls[others[0]]
    if seq + 1 in ref and _signature(ref[seq + 1]) == sigs[r]:
        return [f"    rank {r} skipped {describe(ref[seq])}: its #{seq} is the others' #{seq + 1}"]
    if seq + 1 in mine and _signature(mine[seq + 1]) == majority:
        return [
            f"    rank {r} made an extra call, {describe(mine[seq])}, before the others' #{seq}"
        ]
    return [f"    rank {r} did not make {describe(ref[seq])}: it made {describe(mine[seq])}"]


def _since(entry, doc) -> str:
    t = entry["started_ns"] or entry["queued_ns"]
    if not t:
        return ""
    return f" for {(doc['dumped_ns'] - t) / 1e9:.2f} s"


def analyze(directory) -> str:
    """The analyzer's report on every communicator's rings under `directory`."""
    comms = load(directory)
    if not comms:
        return f"no flight records (rank*.json) under {directory}"
    out = []
    latest = {ident: max(d["dumped_wall"] for d in docs.values()) for ident, docs in comms.items()}
    for ident in sorted(comms, key=latest.get, reverse=True):  # the latest failure first
        out.extend(analyze_comm(ident, comms[ident]))
    return "\n".join(out)
