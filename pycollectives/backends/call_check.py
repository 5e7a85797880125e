"""The check across nodes: one verdict, on every rank, on whether every rank made the same call.

A collective over several nodes (``pycollectives.backends.hierarchical``) checks its ranks'
calls in two steps, each riding on one it takes anyway:

1. Inside each node, its first node-local phase (a reduce-scatter, or a barrier where the call
   has none to start with) carries the record of the whole call in its fingerprint (``outer``:
   sequence number, collective, count, dtype, op, root, per-rank counts, algorithm). The node's
   ranks compare theirs there, so each learns its node's *status*: the one record every rank of
   the node made, or, when they differ, every rank's (read from the node's shared memory, the
   same on each of them).
2. Between nodes, each rank sends its node's status to the other members of its column (the
   ranks with its local rank, one per node) and receives theirs (``_net.NetCheck`` over MPI, or
   an all-gather over gloo). Every node is in every column, so every rank now holds every
   node's status, the same set everywhere, before any byte of the user's arrays is written.

Where they differ, every rank raises the same ``CollectiveMismatch``, built from every rank's
record; a rank whose node disagreed still takes part in step 2, so nobody waits for it. A small
all-reduce's shards ride with the statuses (``NetCheck.exchange_reduce``): its check costs no
message of its own.
"""

from __future__ import annotations

import struct

from pycollectives import _C
from pycollectives.errors import CollectiveMismatch

_SAME, _EACH = 1, 2  # a node's status: one record for all its ranks, or each rank's
_RECORD = struct.Struct("<4Q")
_KIND = struct.Struct("<I")
_SAME_KIND = _KIND.pack(_SAME)


def same_status(record) -> bytes:
    """The status of a node whose ranks all made the call `record`."""
    return _KIND.pack(_SAME) + _RECORD.pack(*record)


def each_status(records) -> bytes:
    """The status of a node whose ranks' calls differ: each one's record, in local-rank order."""
    return _KIND.pack(_EACH) + b"".join(_RECORD.pack(*r) for r in records)


def is_same(status: bytes) -> bool:
    """Whether a node's status says all its ranks made one call."""
    return status[: _KIND.size] == _SAME_KIND


def status_width(ranks_per_node: int) -> int:
    """The largest status of a node of `ranks_per_node` ranks, in bytes."""
    return _KIND.size + ranks_per_node * _RECORD.size


def _records(status: bytes, ranks: int):
    """Each of a node's `ranks` ranks' record, from its status (None where it is unreadable)."""
    if len(status) < _KIND.size:
        return [None] * ranks
    (kind,) = _KIND.unpack_from(status)
    body = status[_KIND.size :]
    if kind == _SAME and len(body) == _RECORD.size:
        return [_RECORD.unpack(body)] * ranks
    if kind == _EACH and len(body) == ranks * _RECORD.size:
        return [_RECORD.unpack_from(body, i * _RECORD.size) for i in range(ranks)]
    return [None] * ranks


def verdict(statuses: list, nodes: list) -> None:
    """Returns when every node's status (`statuses[i]`, node i's ranks being `nodes[i]`) says its
    ranks made one call, the same on every node; else raises ``CollectiveMismatch`` naming the
    ranks and the fields that differ: the same text on every rank, which holds the same
    statuses."""
    if statuses.count(statuses[0]) == len(statuses) and is_same(statuses[0]):
        return
    raise CollectiveMismatch(mismatch_message(statuses, nodes))


def mismatch_message(statuses: list, nodes: list) -> str:
    by_rank = {}
    for status, ranks in zip(statuses, nodes):
        for rank, record in zip(ranks, _records(status, len(ranks))):
            by_rank[rank] = record
    groups: dict = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    # The call most ranks made (the lowest rank's, among equals) is the one others differ from.
    order = sorted(groups, key=lambda r: (-len(groups[r]), groups[r][0]))
    ref = order[0]
    if ref is None:
        what = "a collective across nodes"
        fields = "unreadable status"
    else:
        what = f"{_C.describe_record(ref).split(' ', 1)[0]} #{ref[0]}"
        seen = []
        for r in order[1:]:
            d = "unreadable status" if r is None else _C.record_differences(ref, r)
            for f in d.split(", "):
                if f and f not in seen:
                    seen.append(f)
        fields = ", ".join(seen)
    # Each call as its collective and, where they differ, its sequence number, then its fields.
    numbered = len({r[0] for r in order if r is not None}) > 1
    parts = []
    for r in order:
        ranks = groups[r]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        if r is None:
            parts.append(f"{who} sent an unreadable status")
            continue
        name, _, details = _C.describe_record(r).partition(" ")
        call = f"{name} #{r[0]} {details}" if numbered else f"{name} {details}"
        parts.append(f"{who} {'runs' if len(ranks) == 1 else 'run'} {call.strip()}")
    return f"{what}: ranks disagree on the collective ({fields}): " + "; ".join(parts)
