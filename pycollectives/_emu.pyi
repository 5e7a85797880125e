"""pycollectives._emu: the emulated device, the CUDA transport's device code run on the host
(tests only; see csrc/emu/). Built where PYCOLL_EMULATOR=ON, as the Makefile builds a
checkout; a plain pip install leaves it out."""

from typing import Any

class EmuOptions:
    slot_bytes: int
    nslots: int
    nblocks: int
    threads: int
    kernel_mode: bool
    timeout: float
    oneshot_max_bytes: int
    direct_max_bytes: int
    fault_seq: int
    fault_step: int
    fault_exit: bool
    def __init__(self) -> None: ...

class EmuComm:
    """The CUDA transport's device code run on the host (tests; see csrc/emu/)."""

    def __init__(self, rank: int, size: int, options: EmuOptions) -> None: ...
    @property
    def segment_name(self) -> str: ...
    @property
    def flags_name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def plans_cached(self) -> int: ...
    @property
    def plans_built(self) -> int: ...
    @property
    def segment_bytes(self) -> int: ...
    @property
    def poisoned(self) -> bool: ...
    def attach(self, segments: list[str], flags: list[str]) -> None: ...
    def unlink(self) -> None: ...
    def abort(self, reason: str) -> None: ...
    def run(
        self,
        collective: str,
        x: Any,
        out: Any,
        root: int = 0,
        op: int = 0,
        algorithm: int = 0,
        *,
        counts: list[int] | None = None,
        in_splits: list[int] | None = None,
        out_splits: list[int] | None = None,
    ) -> None: ...
    def capture(
        self, collective: str, x: Any, out: Any, root: int = 0, op: int = 0, algorithm: int = 0
    ) -> EmuGraph: ...
    def replay(self, graph: EmuGraph) -> None: ...
    @property
    def plans_pinned(self) -> int: ...
    @property
    def blocks_run(self) -> int: ...

class EmuGraph:
    """A captured kernel-mode launch, replayed as a CUDA graph is (csrc/emu/emu_comm.h)."""

    @property
    def seq(self) -> int: ...
