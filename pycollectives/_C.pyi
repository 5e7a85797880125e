from collections.abc import Callable
from typing import Any

import numpy as np

class CollectiveError(RuntimeError): ...
class CollectiveTimeout(CollectiveError): ...
class CollectiveMismatch(CollectiveError): ...

ALL_PEERS: int
NO_PEER: int
# Names in code order (a name's index is its native code).
COLLECTIVES: tuple[str, ...]
ALGORITHMS: tuple[str, ...]  # "auto" first
DTYPES: tuple[str, ...]
DTYPE_SIZES: tuple[int, ...]  # bytes per element, by dtype code
# An enum.IntEnum of the reduction ops (SUM, PROD, MIN, MAX, AVG), values their codes:
# pycollectives.ReduceOp.
ReduceOp: Any
OP_NAMES: dict[str, Any]  # "SUM" and "sum" -> ReduceOp.SUM, ...
OPS: tuple[str, ...]
ALGORITHMS_FOR: dict[str, tuple[str, ...]]  # the algorithms each collective has
REDUCING: tuple[str, ...]  # collectives that take an op
CALL_FIELDS: tuple[str, ...]  # pycollectives.backends.Call's fields, in the order the core reads

class HostCommOptions:
    slot_bytes: int
    nslots: int
    timeout: float
    stream_bytes: int
    debug: bool
    oneshot_max_bytes: int
    check_mismatch: bool
    p2p_eager_max_bytes: int
    p2p_cma_min_bytes: int
    single_copy_min_bytes: int
    shared_min_bytes: int
    flight_entries: int
    reproducible: bool
    p2p_cma: str  # "on", "off", "fail" (pycollectives.Options: PYCOLL_P2P_CMA)
    slot_stores: str  # "auto", "cached", "streamed" (PYCOLL_SLOT_STORES)
    def __init__(self) -> None: ...

class SlotStorePolicy:
    """The choice between ordinary and non-temporal stores for staging slots
    (csrc/host/slot_stores.h), alone: for tests."""
    def __init__(self, mode: str = "auto") -> None: ...
    def choose(self, kind: int, bytes: int) -> bool: ...
    def record(self, kind: int, bytes: int, streamed: bool, seconds: float) -> None: ...

class SharedBuffer:
    """Memory the ranks of a machine can map (a memfd); a buffer-protocol object of `bytes`
    bytes (Communicator.empty wraps it in a numpy array)."""
    def __init__(self, bytes: int) -> None: ...
    @property
    def nbytes(self) -> int: ...

def is_shared(array) -> bool: ...

class Work:
    def wait(self, timeout: float | None = None) -> bool: ...
    def is_completed(self) -> bool: ...
    @property
    def seq(self) -> int: ...

def table_choice(
    rules: list[tuple[str, int, int, int, str]], collective: str, size: int, bytes: int
) -> str: ...

class HostComm:
    def __init__(self, rank: int, size: int, options: HostCommOptions) -> None: ...
    @property
    def segment_name(self) -> str: ...
    def attach(self, names: list[str]) -> None: ...
    def unlink(self) -> None: ...
    def enable_shared(self) -> None: ...
    @property
    def shared_enabled(self) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def seq(self) -> int: ...
    timeout: float
    @property
    def slot_bytes(self) -> int: ...
    @property
    def nslots(self) -> int: ...
    @property
    def poisoned(self) -> bool: ...
    @property
    def poison_reason(self) -> str: ...
    def abort(self, reason: str) -> None: ...
    def revoke(self) -> None: ...
    def set_flight_dump(self, path: str, rank: int, size: int, comm: str) -> None: ...
    def flight_dump(self, reason: str) -> bool: ...
    def flight_begin(
        self, kind: int, count: int, dtype: int, op: int, root: int, seq: int, queued: bool
    ) -> int: ...
    def flight_mark(self, id: int, state: int) -> None: ...
    @property
    def flight_records(self) -> list[tuple[int, ...]]: ...
    def board_exchange(self, value: int, payload: bytes = ...) -> list[tuple[int, int, bytes]]: ...
    def set_tuning(self, rules: list[tuple[str, int, int, int, str]]) -> None: ...
    def set_forced(self, algorithm: str) -> None: ...
    def choose(self, collective: str, bytes: int) -> str: ...
    @property
    def run_now(self) -> Callable[[int, Any, Any, Any, Any, Any, Any, Any], bool]:
        """run_now(collective code, x, out, op, root, algorithm, async_op, stream): runs a
        blocking call on numpy arrays, or on torch CPU tensors once set_torch_tensors has been
        called (op a ReduceOp or its name, root an int, algorithm None or a name) in one step
        and returns True; returns False, having done nothing, for any other call."""
    def run_now_via(
        self,
        device_api: Any,
        comm: int,
        keep: Any,
        array_type: type,
        current_stream: Any,
        device: int,
    ) -> Callable[[int, Any, Any, Any, Any, Any, Any, Any], bool]:
        """run_now that also queues blocking calls on arrays of exactly `array_type` (read by
        cupy's attributes) on `device` through a device transport's C interface (`device_api`
        capsule, `comm` its address, kept alive by `keep`), on the call's stream or
        `current_stream()`; the arrays stay referenced until the device has finished."""
    def run_call(self, call: Any, outer: CallRecord | None = None) -> Work | None:
        """Any collective: a pycollectives.backends.Call, or a plain tuple of its fields in
        order (collective, x, out, op, root, algorithm, async_op, stream, counts, in_splits,
        out_splits), with native codes for op and algorithm. counts: per-rank block sizes of
        an uneven all_gather (x.size == counts[rank], out.size == sum(counts)) or
        reduce_scatter (the reverse). all_to_all: block j of x goes to rank j, out is
        rank-major; splits None for equal blocks, else both, the elements sent to / received
        from each rank. gather's out and scatter's x (size * the other's size, rank-major) on
        the root; None elsewhere. `outer`: the record of the call across nodes this is a
        node-local phase of (call_record), compared by the ranks along with the call's own."""
    def barrier(self, async_op: bool = False, outer: CallRecord | None = None) -> Work | None: ...
    def set_rank_names(self, names: list[int]) -> None:
        """Messages name rank r as names[r] (its rank in the communicator over nodes)."""
    def outer_records(self, seq: int) -> list[CallRecord]:
        """Every rank's `outer` record of collective #seq, in rank order (waits, bounded, for
        ranks yet to publish theirs); works on a poisoned communicator."""
    def p2p(
        self, ops: list[tuple[str, np.ndarray, int, int]], async_op: bool = False
    ) -> Work | None:
        """Point-to-point ops ("send" | "recv", array, peer, tag), all checked before anything
        moves. Blocking: returns None once every op is complete. async_op: returns a Work.

        >>> comm._host.c.p2p([("send", x, (r + 1) % n, 0), ("recv", y, (r - 1) % n, 0)])
        """

def schedule(
    algorithm: str,
    collective: str,
    rank: int,
    size: int,
    count: int,
    root: int = 0,
    *,
    piece: int,
    acc_bytes: int = 4,
    oneshot_max_bytes: int = ...,
    shard_align: int = 1,
    counts: list[int] | None = None,
    send_counts: list[int] | None = None,
    recv_counts: list[int] | None = None,
) -> list[dict[str, Any]]: ...
def set_torch_tensors(tensor_type: type, dtype_codes: dict, strided: Any) -> None:
    """Lets run_now take blocking calls on CPU tensors of exactly `tensor_type` (torch.Tensor),
    strided and contiguous, of the dtypes in `dtype_codes` (torch dtype -> DType code), as it
    takes numpy arrays. Once per process; later calls change nothing."""

def check_p2p(
    ops: list[tuple[str, Any, int, int]], rank: int, size: int
) -> list[tuple[bool, int, int, int, int, int]]:
    """HostComm.p2p's argument checks (TypeError / ValueError), moving nothing; returns the ops
    as (send, address, count, dtype code, peer, tag), as ``_net.NetP2P.start`` takes them."""

def check_args(call: tuple, rank: int, size: int) -> tuple[int, int]:
    """A pycollectives.backends.Call's checks (as run_call's); (count, dtype code)."""

CallRecord = tuple[int, int, int, int]

def call_record(call: tuple, rank: int, size: int, seq: int) -> tuple[int, int, CallRecord]:
    """check_args's checks; (count, dtype code, the record of the call as collective #seq:
    sequence number, count, packed fields, per-rank counts' hash), as ranks compare them."""

def barrier_record(seq: int) -> CallRecord:
    """The record of a barrier as collective #seq."""

def describe_record(record: CallRecord) -> str:
    """ "all_reduce count=6 dtype=float32 op=sum algorithm=auto"."""

def record_differences(a: CallRecord, b: CallRecord) -> str:
    """The fields in which two records differ ("sequence number, count, dtype")."""

def segment_bytes(size: int, slot_bytes: int, nslots: int) -> int: ...
def fold_rows(rows: Any, out: Any, dtype: int, op: int, divisor: int) -> None:
    """out = op over the rows of `rows` in row order, as the direct schedules fold."""
