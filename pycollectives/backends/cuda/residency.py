"""Kernel mode's residency: how many blocks a launch may have so that every launch that can be
in flight on a GPU is resident at once.

In kernel mode block b of a rank waits on the device for block b of every peer, and a launch's
other blocks wait at the gate for its block 0 (device/step_kernel.h). A block that waits holds
its SM until it ends, so a launch whose blocks cannot all become resident beside every other
rank's launch on the same GPU (ranks that share it under MPS) waits for SMs that only its own
waiting peers could free: every rank hangs until the timeout. A rank has one launch in flight
at a time (a launch on another stream waits on the host's event for the one before:
DeviceComm::launch_kernel_mode, csrc/device/orchestration.h), so the bound is

    ranks on the GPU x blocks per launch  <=  the GPU's SMs x blocks one SM holds,

and each rank's blocks must also fit the SMs its own process may use (MPS's active thread
percentage). Every rank reports its GPU (UUID, not device number: two numbers can name one
GPU, and one number two GPUs on two machines' views) and decides from every rank's report, so
the choice is the same everywhere. The emulated device enforces the same bound with SMs of
its own (EmuOptions::sms) and decides through this module too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pycollectives.options import AUTO_CUDA_BLOCKS_MAX


@dataclass(frozen=True)
class GpuShare:
    """What one rank reports of its GPU."""

    uuid: bytes  # the GPU (cudaDeviceProp::uuid)
    sms: int  # its multiprocessors
    per_sm: int  # blocks of the step kernel one SM holds at once (occupancy; 0: none fit)
    sm_limit: int  # SMs this rank's process may use (MPS active thread percentage), <= sms


@dataclass(frozen=True)
class Residency:
    """The decision: the mode, the blocks per launch, and why they differ from the request
    ("" when they do not)."""

    mode: str
    blocks: int
    why: str = ""


def mps_sm_limit(sms: int, environ=None) -> int:
    """The SMs a process may use under ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (all of them when it
    is unset or not a number)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        pct = float(raw)
    except ValueError:
        return sms
    if not 0 < pct < 100:
        return sms
    return max(1, int(sms * pct / 100))


def gpu_name(uuid: bytes) -> str:
    return "GPU-" + bytes(uuid).hex()[:8]


def plan_residency(shares: list[GpuShare], requested: int, mode: str) -> Residency:
    """The blocks per launch (and the mode) for ranks that report `shares` (indexed by rank),
    `requested` blocks (0: ``auto``, as many as fit, at most AUTO_CUDA_BLOCKS_MAX) in `mode`
    ("kernel" or "stepped", from choose_sync_mode).

    Kernel mode takes the request where it fits, fewer blocks where one block per rank still
    fits, and stepped mode (whose launches never wait for another process) where not even that
    does. Stepped mode keeps any request (``auto``: the same split of the SMs, at least 1)."""
    if not shares:
        raise ValueError("plan_residency: no rank reported its GPU")
    sharing: dict[bytes, int] = {}
    for s in shares:
        sharing[s.uuid] = sharing.get(s.uuid, 0) + 1
    # The most blocks each rank's launch may have, and the rank that allows fewest.
    fit, tight = None, None
    for r, s in enumerate(shares):
        on_gpu = (s.sms * s.per_sm) // sharing[s.uuid]
        own = s.sm_limit * s.per_sm
        cap = min(on_gpu, own)
        if fit is None or cap < fit:
            fit, tight = cap, r
    s = shares[tight]
    n = sharing[s.uuid]
    where = (
        f"{n} rank{'s' if n > 1 else ''} share{'' if n > 1 else 's'} {gpu_name(s.uuid)} "
        f"({s.sms} SMs, {s.per_sm} block{'s' if s.per_sm != 1 else ''} of the kernel per SM"
        + (f", {s.sm_limit} SMs per process under MPS" if s.sm_limit < s.sms else "")
        + ")"
    )
    if mode == "stepped":
        return Residency("stepped", requested or max(1, min(AUTO_CUDA_BLOCKS_MAX, fit)))
    if mode != "kernel":
        raise ValueError(f"plan_residency: unknown mode {mode!r}")
    if fit < 1:
        return Residency(
            "stepped",
            requested or 1,
            f"stepped mode instead of kernel mode: {where}, so not even one block of every "
            "rank's launch can be resident at once",
        )
    if requested == 0:
        return Residency("kernel", min(AUTO_CUDA_BLOCKS_MAX, fit))
    if requested <= fit:
        return Residency("kernel", requested)
    return Residency(
        "kernel",
        fit,
        f"{fit} blocks per launch instead of PYCOLL_CUDA_BLOCKS={requested}: {where}, so at most "
        f"{fit} blocks of every rank's launch can be resident at once",
    )
