"""Type stubs for the private inter-node transport (built when MPI headers are present)."""

from typing import Any

import numpy as np

class NetComm:
    def __init__(self, comm: Any, piece_bytes: int, window: int, timeout: float) -> None: ...
    timeout: float
    @property
    def poisoned(self) -> bool: ...
    def run(
        self,
        collective: str,
        algorithm: str,
        group: list[int],
        x: np.ndarray,
        out: np.ndarray,
        count: int,
        dtype: int,
        op: int,
        root: int,
        divisor: int,
        seq: int,
    ) -> None: ...

class NetCheck:
    """The check across nodes' exchange among a column's ranks (``csrc/net/net_check.h``).
    Collective to make: duplicates `comm`."""

    def __init__(self, comm: Any, timeout: float) -> None: ...
    timeout: float
    def close(self) -> None: ...
    def exchange(self, group: list[int], what: str, status: bytes) -> list[bytes]:
        """Every member's status, in `group` order (ours at our place)."""
    def exchange_into(
        self, group: list[int], what: str, status: bytes, x: np.ndarray, out: np.ndarray
    ) -> tuple[list[bytes], bool]:
        """exchange, `x` riding along; member k's x lands in out's k-th block. (statuses,
        whether every member's had x's size)."""
    def exchange_reduce(
        self,
        group: list[int],
        what: str,
        status: bytes,
        x: np.ndarray,
        out: np.ndarray,
        dtype: int,
        op: int,
        divisor: int,
    ) -> tuple[list[bytes], bool]:
        """exchange, `x` riding along; when every status equals ours, `out` = op over every
        member's x in group order. (statuses, whether it reduced)."""

class NetP2PWork:
    """A batch of point-to-point operations in flight (``NetP2P.start``)."""

    @property
    def seq(self) -> int: ...
    def wait(self, timeout: float | None = None) -> bool:
        """Progresses every pending operation until this batch is done; rethrows its error;
        CollectiveTimeout if not done after `timeout` seconds (None: its own deadline)."""
    def is_completed(self) -> bool: ...

class NetP2P:
    """Send/recv with other nodes over MPI, each posted at once and progressing on its own
    (``csrc/net/net_p2p.h``). Collective to make: duplicates `comm` four times. Messages of
    at most `inline_bytes` ride in their header and complete once sent."""

    def __init__(
        self, comm: Any, timeout: float, block_bytes: int = 1 << 30, inline_bytes: int = 4096
    ) -> None: ...
    takes_arrays: bool  # False: start() takes the native description of each op
    timeout: float
    @property
    def tag_ub(self) -> int: ...
    @property
    def error(self) -> str | None:
        """Why the engine is unusable, or None."""
    def start(self, ops: list[tuple[bool, int, int, int, int, int]]) -> NetP2PWork:
        """Posts `ops` as ``pycollectives._C.check_p2p`` describes them (send, address, count,
        dtype code, MPI rank, tag); the caller keeps the arrays alive until the work is done."""
    def set_nodes(self, node_of: list[int], node: int) -> None:
        """Each rank's node and this rank's: the ranks ``run_away`` takes."""
    def run_away(self, ops: list[Any], rank: int, size: int) -> bool:
        """Runs a batch of ``P2POp`` (checked as the host path checks them) where every peer is
        on another node: posted and waited for in this call (bounded by the deadline), the
        progress thread not woken; False, nothing posted, where some peer is on this node."""
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...
