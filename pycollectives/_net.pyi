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
