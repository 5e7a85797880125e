"""Configuration of a communicator, read once from arguments and the environment.

``Options.resolve(...)`` reads every ``PYCOLL_*`` knob, checks it, and is then the one source
the host, hierarchical and CUDA paths are configured from (``host_options()`` and
``cuda_options()`` fill the native option structs). Explicit arguments win over the
environment; the environment wins over the defaults.

============================  ===============  ==================================================
variable                      default          what
============================  ===============  ==================================================
PYCOLL_TIMEOUT                300              seconds a wait for a peer may last
PYCOLL_STAGING_BYTES          256 KiB          one host staging slot (a multiple of 64)
PYCOLL_STAGING_SLOTS          4                slots per host channel (2..64)
PYCOLL_STREAM_BYTES           16 MiB           out-of-place host outputs this large bypass
                                               the cache
PYCOLL_SLOT_STORES            auto             host staging slots written with ordinary
                                               (cached) or non-temporal (streamed) stores;
                                               auto measures which is faster, per kind of call
PYCOLL_ONESHOT_BYTES          (native)         direct all-reduce: one-shot up to here (host, GPU)
PYCOLL_ALGO                   (auto)           force ring, tree or direct where it exists
PYCOLL_TUNING                 auto             where the host's algorithm thresholds come
                                               from: auto (measured on the machine at first
                                               use, then cached), calibrate (measure again),
                                               shipped (the package's table) or a tuning
                                               file's path (backends/host_tuning.py)
PYCOLL_CACHE_DIR              $XDG_CACHE_HOME/ where measured thresholds are cached
                              pycollectives
PYCOLL_INTER_ALGO             (hierarchical)   flat algorithm between nodes
PYCOLL_REPRODUCIBLE           0                1: every reduction sums in rank order, so its
                                               bits depend on the inputs alone, whatever the
                                               algorithm, path or node placement
PYCOLL_NET_PIECE_BYTES        1 MiB            MPI message size between nodes
PYCOLL_DEBUG                  (off)            INFO or TRACE: a line per collective on stderr
PYCOLL_CHECK_MISMATCH         1                0 turns mismatch detection off (to measure it),
                                               but for GPU kernel mode, which checks on the device
PYCOLL_P2P_CMA                on               access to peers' memory: cross-memory attach for
                                               send/recv and large all-gathers, mapping shared
                                               buffers (on, off; fail: test)
PYCOLL_P2P_EAGER_BYTES        4 KiB            send/recv: eager sends up to here (one slot at most)
PYCOLL_P2P_DIRECT_BYTES       4 MiB            send/recv, all-to-all, gather, scatter: direct
                                               writes from this size up (and all-to-all, gather,
                                               scatter blocks over send/recv from 64 KiB or it)
PYCOLL_SINGLE_COPY_BYTES      4 MiB            all-gather blocks this large (2 ranks) are
                                               written straight into the peer's output
PYCOLL_SHARED_BYTES           16 KiB           all-reduces this large on Communicator.empty
                                               buffers run over the mapped buffers (reduce-
                                               scatter, all-gather, broadcast, reduce: 8x)
PYCOLL_FLIGHT_RECORDER        1024             entries of each communicator's flight recorder,
                                               the ring of its last calls (0: off)
PYCOLL_FLIGHT_DIR             $TMPDIR/         where a failing communicator (or SIGUSR1)
                              pycollectives-   writes its ring: DIR/<communicator>/rank<R>.json
                              flight
PYCOLL_CUDA_STAGING_BYTES     1 MiB            one GPU staging slot
PYCOLL_CUDA_STAGING_SLOTS     4                slots per GPU channel
PYCOLL_CUDA_BLOCKS            16               thread blocks per launch; ``auto``: the GPU's
                                               SMs over the ranks that share it, at most 64;
                                               kernel mode takes fewer (or stepped mode) where
                                               not every rank's can be resident at once
PYCOLL_CUDA_LL_BYTES          32 KiB           GPU kernel mode: messages up to here in the LL
                                               format, data and flag in one store (0: off)
PYCOLL_CUDA_SYNC              (auto)           kernel or stepped (one launch per step, the
                                               host waiting between them)
PYCOLL_CUDA_STEPPED_TWOSHOT   1                GPU stepped mode: all-reduce, reduce, broadcast,
                                               all-gather, reduce-scatter, gather, scatter and
                                               all-to-all through scratch a chunk at a time
                                               (0: the steps)
PYCOLL_CUDA_LOOKAHEAD         0                GPU ring all-reduce: the next piece's first
                                               message before this piece's last, two in flight
                                               per channel (1: on)
PYCOLL_CUDA_STEPPED_EVENTS    1                GPU stepped mode: registered calls and scratch
                                               fence on the GPU (counters or interprocess
                                               events), the host never waiting for the GPU
                                               (0: the host waits, then meets the peers)
PYCOLL_CUDA_FENCE_COUNTERS    1                GPU stepped mode's fences on counters where every
                                               GPU has stream memory operations (0: always on
                                               interprocess events)
PYCOLL_CUDA_PUSH              0                GPU messages between two ranks by writes into the
                                               receiver's memory, each rank polling its own
                                               (1: on; off until measured)
PYCOLL_CUDA_COPY_ENGINES      0                GPU stepped mode: all-gathers and broadcasts over
                                               registered buffers by copies, no kernel (1: on)
PYCOLL_CUDA_REGISTER_BYTES    0 (off)          registration on first use: all-reduces,
                                               reduces, broadcasts, reduce-scatters and
                                               all-gathers of at least this many bytes on
                                               arrays no one registered run zero-copy over
                                               every rank's allocation (off until measured)
============================  ===============  ==================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pycollectives import _C
from pycollectives.ops import ALGORITHMS

TUNING_FILE = Path(__file__).with_name("tuning.json")
SYNC_MODES = ("kernel", "stepped")
SLOT_STORES = ("auto", "cached", "streamed")


def env_number(name, default, kind, environ=None):
    """``kind(environ[name])``, `default` when unset or empty; ValueError naming the variable
    when it does not parse."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def checked_timeout(seconds) -> float:
    """`seconds` as a float: how long an operation may wait for a peer; ValueError unless it
    is positive."""
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, got {seconds}")
    return float(seconds)


def _blocks(raw: str) -> int:
    """``PYCOLL_CUDA_BLOCKS``: a count, or ``auto`` (0: chosen per GPU, auto_cuda_blocks)."""
    if raw.strip().lower() == "auto":
        return 0
    n = int(raw)
    if n < 1:
        raise ValueError(raw)
    return n


_blocks.__name__ = "block count or auto"

# At most this many blocks per launch when chosen per GPU: each is a channel with its own flags
# and its own share of every staging slot, so more make each step's share smaller.
AUTO_CUDA_BLOCKS_MAX = 64


def auto_cuda_blocks(sm_count: int, sharing: int) -> int:
    """Blocks per launch for ``PYCOLL_CUDA_BLOCKS=auto``: the GPU's SMs split among the
    `sharing` ranks on it (one block per SM), between 1 and AUTO_CUDA_BLOCKS_MAX."""
    return max(1, min(AUTO_CUDA_BLOCKS_MAX, sm_count // max(1, sharing)))


def env_choice(name, default, choices, environ, aliases=None):
    """``environ[name]`` stripped and lower-cased (`default` when unset or empty), through
    `aliases`; ValueError naming the variable and the choices when it is not one of them."""
    value = (environ.get(name) or default).strip().lower()
    value = (aliases or {}).get(value, value)
    if value not in choices:
        expected = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return value


# Settings whose names changed: set under the old name, they are refused with the new one
# rather than ignored. "host" named the GPU's stepped mode, which only "host memory" now does.
RENAMED = {
    "PYCOLL_CUDA_HOST_TWOSHOT": "PYCOLL_CUDA_STEPPED_TWOSHOT",
    "PYCOLL_CUDA_HOST_EVENTS": "PYCOLL_CUDA_STEPPED_EVENTS",
}


def _refuse_renamed(environ):
    for old, new in RENAMED.items():
        if environ.get(old):
            raise ValueError(f"{old} is now {new}")
    if (environ.get("PYCOLL_CUDA_SYNC") or "").strip().lower() == "host":
        raise ValueError("PYCOLL_CUDA_SYNC=host is now PYCOLL_CUDA_SYNC=stepped")


def _algorithm(name, environ):
    raw = (environ.get(name) or "").strip().lower() or None
    if raw is not None and raw not in ALGORITHMS:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(ALGORITHMS)}")
    return raw


TUNING_SOURCES = ("auto", "calibrate", "shipped")


def _tuning(environ) -> str:
    """``PYCOLL_TUNING``: one of TUNING_SOURCES, or the path of a tuning file that exists."""
    raw = (environ.get("PYCOLL_TUNING") or "auto").strip()
    if raw.lower() in TUNING_SOURCES:
        return raw.lower()
    if not os.path.isfile(raw):
        raise ValueError(
            f"PYCOLL_TUNING={raw!r}: expected {', '.join(TUNING_SOURCES)} or a tuning file's path"
        )
    return raw


def load_tuning(path=TUNING_FILE) -> list:
    """Rules (collective, min_ranks, max_ranks, max_bytes, algorithm) from a tuning file
    written by benchmarks/tune.py; the first matching rule wins, ring when none does."""
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return []
    return [
        (
            r["collective"],
            int(r["min_ranks"]),
            int(r["max_ranks"]),
            int(r["max_bytes"]),
            r["algorithm"],
        )
        for r in table.get("rules", [])
    ]


@dataclasses.dataclass(frozen=True)
class Options:
    timeout: float = 300.0
    staging_bytes: int = 256 * 1024
    staging_slots: int = 4
    stream_bytes: int = 16 << 20
    slot_stores: str = "auto"
    oneshot_bytes: int | None = None  # None: each transport's own default
    algorithm: str | None = None
    tuning: str = "auto"  # auto, calibrate, shipped or a tuning file's path
    cache_dir: str = ""  # "": $XDG_CACHE_HOME/pycollectives or ~/.cache/pycollectives
    inter_algorithm: str | None = None
    reproducible: bool = False
    net_piece_bytes: int = 1 << 20
    debug: bool = False
    check_mismatch: bool = True
    p2p_cma: str = "on"
    p2p_eager_bytes: int = 4096
    p2p_direct_bytes: int = 4 << 20
    single_copy_bytes: int = 4 << 20
    shared_bytes: int = 16 << 10
    # Whether the staging slot size was asked for (argument or PYCOLL_STAGING_BYTES): if not,
    # slots shrink to fit a small /dev/shm (backends/host.py, fit_staging).
    staging_asked: bool = False
    flight_entries: int = 1024
    flight_dir: str = ""  # "": $TMPDIR/pycollectives-flight
    cuda_staging_bytes: int = 1 << 20
    cuda_staging_slots: int = 4
    cuda_blocks: int = 16
    cuda_stepped_twoshot: bool = True
    cuda_lookahead: bool = False
    cuda_push: bool = False
    cuda_copy_engines: bool = False
    cuda_stepped_events: bool = True
    cuda_fence_counters: bool = True
    cuda_ll_bytes: int = 32 << 10
    cuda_register_bytes: int = 0
    cuda_sync: str | None = None

    @classmethod
    def resolve(
        cls, *, timeout=None, staging_bytes=None, staging_slots=None, reproducible=None,
        environ=None,
    ):  # fmt: skip
        """The options of a communicator: the arguments given, else the environment, else the
        defaults; ValueError for anything out of range."""
        env = os.environ if environ is None else environ
        d = cls()

        def pick(arg, name, default, kind):
            return kind(arg) if arg is not None else env_number(name, default, kind, env)

        def switch(name, default):  # 0 or 1, off or on
            on = env_choice(name, "1" if default else "0", ("0", "1"), env, {"off": "0", "on": "1"})
            return on == "1"

        _refuse_renamed(env)
        sync = env_choice("PYCOLL_CUDA_SYNC", "auto", (*SYNC_MODES, "auto"), env, {"": "auto"})
        cma = env_choice(
            "PYCOLL_P2P_CMA", "on", ("on", "off", "fail"), env, {"0": "off", "1": "on"}
        )
        slot_stores = env_choice("PYCOLL_SLOT_STORES", "auto", SLOT_STORES, env)
        opts = cls(
            timeout=pick(timeout, "PYCOLL_TIMEOUT", d.timeout, float),
            staging_bytes=pick(staging_bytes, "PYCOLL_STAGING_BYTES", d.staging_bytes, int),
            staging_asked=staging_bytes is not None or "PYCOLL_STAGING_BYTES" in env,
            staging_slots=pick(staging_slots, "PYCOLL_STAGING_SLOTS", d.staging_slots, int),
            stream_bytes=pick(None, "PYCOLL_STREAM_BYTES", d.stream_bytes, int),
            slot_stores=slot_stores,
            oneshot_bytes=pick(None, "PYCOLL_ONESHOT_BYTES", None, int),
            algorithm=_algorithm("PYCOLL_ALGO", env),
            tuning=_tuning(env),
            cache_dir=env.get("PYCOLL_CACHE_DIR", ""),
            inter_algorithm=_algorithm("PYCOLL_INTER_ALGO", env),
            reproducible=(
                switch("PYCOLL_REPRODUCIBLE", d.reproducible)
                if reproducible is None
                else bool(reproducible)
            ),
            net_piece_bytes=pick(None, "PYCOLL_NET_PIECE_BYTES", d.net_piece_bytes, int),
            debug=env.get("PYCOLL_DEBUG", "").upper() in ("INFO", "TRACE"),
            check_mismatch=env.get("PYCOLL_CHECK_MISMATCH", "1") != "0",
            p2p_cma=cma,
            p2p_eager_bytes=pick(None, "PYCOLL_P2P_EAGER_BYTES", d.p2p_eager_bytes, int),
            p2p_direct_bytes=pick(None, "PYCOLL_P2P_DIRECT_BYTES", d.p2p_direct_bytes, int),
            single_copy_bytes=pick(None, "PYCOLL_SINGLE_COPY_BYTES", d.single_copy_bytes, int),
            shared_bytes=pick(None, "PYCOLL_SHARED_BYTES", d.shared_bytes, int),
            flight_entries=pick(None, "PYCOLL_FLIGHT_RECORDER", d.flight_entries, int),
            flight_dir=env.get("PYCOLL_FLIGHT_DIR", ""),
            cuda_staging_bytes=pick(None, "PYCOLL_CUDA_STAGING_BYTES", d.cuda_staging_bytes, int),
            cuda_staging_slots=pick(None, "PYCOLL_CUDA_STAGING_SLOTS", d.cuda_staging_slots, int),
            cuda_blocks=pick(None, "PYCOLL_CUDA_BLOCKS", d.cuda_blocks, _blocks),
            cuda_ll_bytes=pick(None, "PYCOLL_CUDA_LL_BYTES", d.cuda_ll_bytes, int),
            cuda_register_bytes=pick(
                None, "PYCOLL_CUDA_REGISTER_BYTES", d.cuda_register_bytes, int
            ),
            cuda_sync=None if sync == "auto" else sync,
            cuda_stepped_twoshot=switch("PYCOLL_CUDA_STEPPED_TWOSHOT", d.cuda_stepped_twoshot),
            cuda_lookahead=switch("PYCOLL_CUDA_LOOKAHEAD", d.cuda_lookahead),
            cuda_push=switch("PYCOLL_CUDA_PUSH", d.cuda_push),
            cuda_copy_engines=switch("PYCOLL_CUDA_COPY_ENGINES", d.cuda_copy_engines),
            cuda_stepped_events=switch("PYCOLL_CUDA_STEPPED_EVENTS", d.cuda_stepped_events),
            cuda_fence_counters=switch("PYCOLL_CUDA_FENCE_COUNTERS", d.cuda_fence_counters),
        )
        opts.check()
        return opts

    def check(self):
        checked_timeout(self.timeout)
        if self.staging_bytes < 64 or self.staging_bytes % 64:
            raise ValueError(
                f"staging_bytes must be a positive multiple of 64, got {self.staging_bytes}"
            )
        if not 2 <= self.staging_slots <= 64:
            # A step may hold an incoming slot while it waits for an outgoing one.
            raise ValueError(f"staging_slots must be in [2, 64], got {self.staging_slots}")
        if not 0 <= self.cuda_blocks <= 128:
            raise ValueError(
                f"PYCOLL_CUDA_BLOCKS must be in [1, 128] or auto, got {self.cuda_blocks}"
            )
        for field, name, low, high in _BOUNDS:
            value = getattr(self, field)
            if value is not None and not (value >= low and (high is None or value <= high)):
                bound = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"{name} must be {bound}, got {value}")

    def replace(self, **changes) -> Options:
        opts = dataclasses.replace(self, **changes)
        opts.check()
        return opts

    def host_options(self):
        """The native options of the shared-memory transport."""
        return _native_options(_C.HostCommOptions(), self, _HOST_FIELDS)

    def cuda_options(self, native, device=0, blocks=None):
        """The native options of the CUDA transport (`native`: the ``_cuda`` module) on
        `device`, with `blocks` per launch where the residency check chose them
        (backends/cuda/residency.py), else ``PYCOLL_CUDA_BLOCKS`` (``auto``: a block per SM)."""
        o = _native_options(native.CudaCommOptions(), self, _CUDA_FIELDS)
        o.nblocks = blocks or self.cuda_blocks or auto_cuda_blocks(native.sm_count(device), 1)
        o.algorithm = self.algorithm or "auto"  # PYCOLL_ALGO: applied natively, as on the host
        return o


# Options bounded below (and above): (field, the name an error gives, low, high or None).
# None values (unset) pass.
_BOUNDS = (
    ("oneshot_bytes", "PYCOLL_ONESHOT_BYTES", 0, None),
    ("p2p_eager_bytes", "PYCOLL_P2P_EAGER_BYTES", 0, None),
    ("single_copy_bytes", "PYCOLL_SINGLE_COPY_BYTES", 0, None),
    ("shared_bytes", "PYCOLL_SHARED_BYTES", 0, None),
    ("cuda_ll_bytes", "PYCOLL_CUDA_LL_BYTES", 0, None),
    ("cuda_register_bytes", "PYCOLL_CUDA_REGISTER_BYTES", 0, None),
    ("flight_entries", "PYCOLL_FLIGHT_RECORDER", 0, 1 << 20),
    ("net_piece_bytes", "PYCOLL_NET_PIECE_BYTES", 1, None),
)

# (native field, Options field) of each transport's native options; an Options field that is
# None (unset) leaves the native default.
_COMMON_FIELDS = (
    ("timeout", "timeout"),
    ("oneshot_max_bytes", "oneshot_bytes"),
    ("debug", "debug"),
    ("check_mismatch", "check_mismatch"),
    ("flight_entries", "flight_entries"),
    ("reproducible", "reproducible"),
)
_HOST_FIELDS = _COMMON_FIELDS + (
    ("slot_bytes", "staging_bytes"),
    ("nslots", "staging_slots"),
    ("stream_bytes", "stream_bytes"),
    ("slot_stores", "slot_stores"),
    ("p2p_cma", "p2p_cma"),
    ("p2p_eager_max_bytes", "p2p_eager_bytes"),
    ("p2p_cma_min_bytes", "p2p_direct_bytes"),
    ("single_copy_min_bytes", "single_copy_bytes"),
    ("shared_min_bytes", "shared_bytes"),
)
_CUDA_FIELDS = _COMMON_FIELDS + (
    ("slot_bytes", "cuda_staging_bytes"),
    ("nslots", "cuda_staging_slots"),
    ("ll_max_bytes", "cuda_ll_bytes"),
    ("stepped_twoshot", "cuda_stepped_twoshot"),
    ("register_on_use_bytes", "cuda_register_bytes"),
    ("push", "cuda_push"),
    ("copy_engines", "cuda_copy_engines"),
    ("lookahead", "cuda_lookahead"),
    ("stepped_events", "cuda_stepped_events"),
)


def _native_options(native, opts: Options, fields):
    for theirs, ours in fields:
        value = getattr(opts, ours)
        if value is not None:
            setattr(native, theirs, value)
    return native
