"""Bandwidth arithmetic, as nccl-tests defines it, and the memory-traffic bound.

algbw = size / time. busbw = algbw * factor, the factor turning algbw into the bandwidth each
rank's busiest link must carry: all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n,
where size is the full gathered buffer (all_gather's output, reduce_scatter's input);
broadcast and reduce 1.

The physical bound counts the memory traffic (bytes read + bytes written) one rank cannot
avoid, for size S (n ranks):
  all_reduce   2S            read its input, write its output
  broadcast    2S            read the data once, write it once
  reduce       (n+1)S        the root reads every rank's S and writes S
  all_gather   S + S/n       write the gathered S, read its own S/n
  reduce_scatter S + S/n     read the whole input S, write its S/n block
A copy of B bytes per second moves 2B bytes of traffic per second, so with B the copy
bandwidth one rank gets while every rank copies at once (measured on buffers far larger than
the caches), no implementation takes less than traffic / 2B. Messages that fit in cache can
beat it; it is a bound for large messages. With --device cuda, B is the device-to-device copy
bandwidth of the rank's GPU while every rank copies at once: ranks that share one GPU share its
memory bandwidth, so B is their share of it.
"""

from __future__ import annotations

from pycollectives.ops import COLLECTIVES as _CORE
from pycollectives.ops import bus_factor

# What the sweeps cover: every collective of the core, and point-to-point as nccl-tests has it.
COLLECTIVES = (*_CORE, "sendrecv")
__all__ = ["COLLECTIVES", "algbw", "busbw", "bus_factor", "collectives_for"]


def collectives_for(device: str) -> tuple:
    """What a sweep of "all" covers on `device` ("cpu" or "cuda": the CUDA transport has no
    point-to-point messages)."""
    return COLLECTIVES if device == "cpu" else _CORE


def algbw(size_bytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes per second)."""
    return size_bytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw(collective: str, nranks: int, size_bytes: int, seconds: float) -> float:
    return algbw(size_bytes, seconds) * bus_factor(collective, nranks)


def bound_traffic(collective: str, size_bytes: int, nranks: int) -> float:
    """Bytes one rank must read plus write, at least (see the module docstring)."""
    s = float(size_bytes)
    if collective in ("all_reduce", "broadcast"):
        return 2 * s
    if collective == "reduce":
        return (nranks + 1) * s
    if collective in ("all_gather", "reduce_scatter", "gather", "scatter"):
        return s + s / nranks  # the busiest rank's share of one copy of the whole
    if collective in ("all_to_all", "sendrecv"):
        return 2 * s  # every rank's whole buffer is read once and written once
    raise ValueError(f"unknown collective {collective!r}")


def bound_time(collective: str, size_bytes: int, nranks: int, copy_bw_gbs: float) -> float:
    """Least possible seconds given the per-rank copy bandwidth in GB/s."""
    return bound_traffic(collective, size_bytes, nranks) / (2 * copy_bw_gbs * 1e9)


def parse_size(text: str) -> int:
    """'8', '64K', '16M', '1G' (powers of 1024) -> bytes."""
    t = str(text).strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" and t[-1:] else t
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 8, 64K, 16M, 1G)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def sizes(lo: int, hi: int, factor: float) -> list[int]:
    if factor <= 1:
        raise ValueError("the size factor must be > 1")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        nxt = int(s * factor)
        s = nxt if nxt > s else s + 1
    return out
