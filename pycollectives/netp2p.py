"""Point-to-point messages between nodes, over MPI.

Inside a node, send/recv run over shared memory (``HostComm.p2p``); between nodes they are MPI
messages on communicators of their own, so they never meet the collectives' traffic. Each
message is announced by a header (count, dtype) on one communicator, carried on a second, and
answered by the receiver's verdict on a third: a size or dtype mismatch raises
``CollectiveMismatch`` on both ends (the receiver drains the message into scratch space, so
nothing is corrupted), and a message between one pair with one tag never overtakes another
(MPI's own ordering). Every wait is bounded by the communicator's timeout.
"""

from __future__ import annotations

import time

import numpy as np

from pycollectives import arrays
from pycollectives.errors import CollectiveMismatch, CollectiveTimeout


class MpiP2P:
    def __init__(self, mpi):
        from mpi4py import MPI

        self._MPI = MPI
        self.headers, self.data, self.verdicts = (mpi.Dup() for _ in range(3))
        self.tag_ub = mpi.Get_attr(MPI.TAG_UB)

    def close(self):
        for c in (self.headers, self.data, self.verdicts):
            c.Free()

    def check(self, ops):
        """ValueError for what MPI cannot carry (checked before anything moves)."""
        for o in ops:
            if o.tag > self.tag_ub:
                raise ValueError(
                    f"p2p: tag {o.tag} to rank {o.peer} on another node exceeds MPI's largest "
                    f"tag {self.tag_ub}"
                )

    def run(self, ops, timeout: float):
        """Runs the (already checked) P2POps `ops` with global peers to completion."""
        deadline = time.monotonic() + timeout
        pending, headers, verdicts = [], [], []
        for o in ops:
            info = arrays.describe(o.array)
            head = np.array([info.count, info.dtype], np.int64)
            if o.kind == "send":
                verdict = np.zeros(3, np.int64)
                pending += [
                    self.headers.Isend(head, dest=o.peer, tag=o.tag),
                    self.data.Isend(_bytes(o.array), dest=o.peer, tag=o.tag),
                    self.verdicts.Irecv(verdict, source=o.peer, tag=o.tag),
                ]
                verdicts.append((o, head, verdict))
            else:
                theirs = np.empty(2, np.int64)
                headers.append((o, head, theirs, self.headers.Irecv(theirs, o.peer, o.tag)))
        errors = []
        for o, mine, theirs, req in headers:
            self._wait([req], deadline, o)
            same = bool(np.array_equal(mine, theirs))
            # A mismatched message is drained into scratch space, never into the caller's array.
            into = _bytes(o.array) if same else np.empty(_nbytes(theirs), np.uint8)
            self._wait([self.data.Irecv(into, source=o.peer, tag=o.tag)], deadline, o)
            reply = np.array([int(same), *mine], np.int64)
            pending.append(self.verdicts.Isend(reply, dest=o.peer, tag=o.tag))
            if not same:
                errors.append(_mismatch(o, mine, theirs, "recv from"))
        self._wait(pending, deadline, None)
        for o, mine, verdict in verdicts:
            if not verdict[0]:
                errors.append(_mismatch(o, mine, verdict[1:], "send to"))
        if errors:
            raise CollectiveMismatch("; ".join(errors))

    def _wait(self, reqs, deadline, op):
        """Waits for `reqs`, backing off (spin, then sleep up to 1 ms) until `deadline`."""
        nap = 0.0
        while not self._MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                for r in reqs:
                    if r != self._MPI.REQUEST_NULL:
                        r.Cancel()
                what = "p2p" if op is None else f"p2p {op.kind} with rank {op.peer} (tag {op.tag})"
                raise CollectiveTimeout(f"{what}: timed out waiting for the peer")
            time.sleep(nap)
            nap = min(1e-3, nap * 2 + 1e-6)


def _bytes(a):
    return np.asarray(a).reshape(-1).view(np.uint8)


def _nbytes(head) -> int:
    from pycollectives.ops import DTYPES

    name = DTYPES[int(head[1])] if 0 <= int(head[1]) < len(DTYPES) else "uint8"
    return int(head[0]) * arrays.DTYPE_SIZES[name]


def _mismatch(op, mine, theirs, verb) -> str:
    from pycollectives.ops import DTYPES

    def show(h):
        return f"{int(h[0])} x {DTYPES[int(h[1])]}"

    return (
        f"p2p {verb} rank {op.peer} (tag {op.tag}): this rank has {show(mine)}, rank "
        f"{op.peer} has {show(theirs)}"
    )
