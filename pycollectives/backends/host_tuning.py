"""The host's algorithm thresholds, measured on the machine at first use.

A host communicator picks ring, tree or direct for a collective by the size of its input, from
rules ``(collective, min_ranks, max_ranks, max_bytes, algorithm)`` (the first that matches
wins). Where each algorithm wins depends on the machine: its caches, how far apart the ranks'
cores sit, how many ranks share a core. So the first communicator of a rank count on a machine
measures them (``probe``, on a communicator of its own that the user's never sees):

- every algorithm of every collective with a choice, on float32 sums, at the input sizes of
  ``PROBE_SIZES`` (8 B to 2 MiB, a factor of 8 apart), in rounds that take each algorithm in
  turn, a batch of calls each; per size and algorithm the fastest round (a call is only ever
  slowed by what runs beside it) of the slowest rank in it (every rank waits for it);
- between two measured sizes each algorithm's time is taken as affine in the size, an α–β line
  through its two measurements (``fitted_time``); the rules follow the least of the lines,
  switching only to an algorithm at least ``MARGIN`` faster than the one they hold, so that
  near-ties do not split them into slivers (``rules_from``); for one more factor of 8 above
  the largest size the lines through the last two measurements go on (large messages are
  decided by the lines' slopes, the β that the largest sizes measure best), and above that the
  algorithm the rules hold carries on.

The rules are cached per machine, rank count and staging slots (``cache_file``), in
``PYCOLL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pycollectives``, else
``~/.cache/pycollectives``). Rank 0 reads the cache and hands what it found to every rank, so
all ranks choose alike; a probe's times are exchanged, so every rank fits the same rules.

``PYCOLL_TUNING`` says where the rules come from: ``auto`` (the cache, measured on first use),
``calibrate`` (measure again and replace the cache), ``shipped`` (the table shipped with the
package, measured on one 2-core VM), or the path of a tuning file
(``benchmarks/algorithms.py --merge`` writes them). ``PYCOLL_ALGO`` still forces one algorithm.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pycollectives import _C
from pycollectives.backends.base import gathered_or_raise
from pycollectives.ops import ALGORITHMS_FOR, SUM, collective_code
from pycollectives.options import load_tuning

# The collectives whose algorithm is chosen by size.
CHOSEN = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
PROBE_SIZES = tuple(8 << (3 * i) for i in range(7))  # 8 B ... 2 MiB
ROUNDS = 5
# Calls per timed batch: enough that a batch of small calls outlasts the clock's resolution and
# a wake-up, and that a batch is the steady state rather than the change from the algorithm
# before (with batches of 2 calls at 32 KiB, reduce-scatter's direct came out 1-4% faster than
# its ring on 2 ranks, where the sweep has it 11-14% slower; with 16, 13-16% slower);
# MIN_BATCH from 512 KiB.
BATCH_BYTES = 1 << 20
MIN_BATCH, MAX_BATCH = 2, 16
# The rules keep an algorithm until another is this much faster (a fraction of its time).
MARGIN = 0.03
UNBOUNDED = 1 << 62
STEPS_PER_INTERVAL = 8  # sizes the lines are compared at between two measured sizes
# How far above the largest measured size the lines are compared (a factor of it): far enough to
# see a slope decide, not so far that a slope's error is multiplied many times over.
EXTRAPOLATE = 8
# The version of the probe and the fit (what probe times, how rules_from reads it), in the
# cache's key: a calibration cached by another is measured again.
FIT = 4


# -- the rules from the measurements -------------------------------------------------------------


def fitted_time(sizes, times, nbytes) -> float:
    """An algorithm's time at `nbytes`, on the α–β line through its measurements at the two
    measured sizes around it; above the largest, on the line through the last two, never
    falling (a time that fell there is noise, not a rate)."""
    if nbytes > sizes[-1] and len(sizes) > 1:
        slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        return times[-1] + (nbytes - sizes[-1]) * max(slope, 0.0)
    for i in range(len(sizes) - 1):
        lo, hi = sizes[i], sizes[i + 1]
        if lo <= nbytes <= hi:
            return times[i] + (nbytes - lo) * (times[i + 1] - times[i]) / (hi - lo)
    raise ValueError(f"{nbytes} bytes is below the measured {sizes[0]}..{sizes[-1]}")


def compared_sizes(sizes) -> list:
    """The sizes the lines are compared at: the measured ones and STEPS_PER_INTERVAL - 1
    between each two, evenly spaced in the logarithm, and as many again up to EXTRAPOLATE
    times the largest."""
    out = []
    bounds = [*sizes, sizes[-1] * EXTRAPOLATE]
    for lo, hi in zip(bounds, bounds[1:]):
        steps = range(STEPS_PER_INTERVAL)
        out += [round(lo * (hi / lo) ** (j / STEPS_PER_INTERVAL)) for j in steps]
    return sorted(set(out + [sizes[-1] * EXTRAPOLATE]))


def rules_from(measured: dict, nranks: int, margin: float = MARGIN) -> list:
    """Tuning rules for `nranks` ranks from ``measured[collective] = {"bytes": [input sizes],
    algorithm: [seconds per call at each]}``: per collective, ranges of input sizes and the
    algorithm that holds each (see the module's docstring)."""
    rules = []
    for collective, m in measured.items():
        sizes = m["bytes"]
        algos = [a for a in m if a != "bytes"]
        held, last = None, None
        for nbytes in compared_sizes(sizes):
            t = {a: fitted_time(sizes, m[a], nbytes) for a in algos}
            best = min(algos, key=t.get)
            if held is None:
                held = best
            elif best != held and t[best] < (1 - margin) * t[held]:
                rules.append((collective, nranks, nranks, last, held))
                held = best
            last = nbytes
        rules.append((collective, nranks, nranks, UNBOUNDED, held))
    return rules


def table_choice(rules: list, collective: str, nranks: int, nbytes: int) -> str:
    """The algorithm `rules` give `collective` of `nbytes` of input on `nranks` ranks, as the
    host communicator reads them (the first rule that matches; ring, else direct, where none
    does): the communicator's own reading (``_C.table_choice``)."""
    return _C.table_choice(rules, collective, nranks, nbytes)


# -- the probe ------------------------------------------------------------------------------------


def _layout(collective: str, nbytes: int, nranks: int) -> tuple[int, int]:
    """(input, output) float32 elements of a probe call of about `nbytes` of input: the input
    its choice is keyed on (all-gather: one rank's block; reduce-scatter: the whole)."""
    count = max(1, nbytes // 4)
    if collective == "all_gather":
        return count, count * nranks
    if collective == "reduce_scatter":
        block = max(1, count // nranks)
        return block * nranks, block
    return count, count


def probe(host, nranks: int, sizes=PROBE_SIZES, rounds: int = ROUNDS) -> dict:
    """This rank's time per call, per round, of every algorithm of every collective in CHOSEN
    at each of `sizes`, on `host` (a ``_C.HostComm`` of its own: the calls advance its
    sequence and train its slot stores). Each time is the mean of a batch of calls after one
    untimed call (the batch is the steady state a training loop sees, not the first call
    after another algorithm's). The calls go the way a user's blocking call on numpy arrays
    goes (the one-step ``run_now``), so that the fixed cost of another way in does not dilute
    the algorithms' differences. The same calls in the same order on every rank."""
    biggest = max(_layout(c, s, nranks)[i] for c in CHOSEN for s in sizes for i in (0, 1))
    src = np.ones(biggest, np.float32)
    dst = np.empty(biggest, np.float32)
    run_now = host.run_now
    measured = {}
    for collective in CHOSEN:
        algos = ALGORITHMS_FOR[collective]
        code = collective_code(collective)
        m = measured[collective] = {"bytes": [], **{a: [] for a in algos}}
        for nbytes in sizes:
            n_in, n_out = _layout(collective, nbytes, nranks)
            x, out = src[:n_in], (None if collective == "broadcast" else dst[:n_out])
            args = {a: (code, x, out, SUM, 0, a, False, None) for a in algos}
            batch = max(MIN_BATCH, min(MAX_BATCH, BATCH_BYTES // (4 * n_in)))
            times = {a: [] for a in algos}
            for _ in range(rounds):
                for a in algos:
                    call = args[a]
                    if not run_now(*call):
                        raise RuntimeError(f"the probe's {collective} did not run in one step")
                    t0 = time.perf_counter()
                    for _ in range(batch):
                        run_now(*call)
                    times[a].append((time.perf_counter() - t0) / batch)
            m["bytes"].append(4 * n_in)
            for a in algos:
                m[a].append(times[a])
    return measured


def slowest(per_rank: list) -> dict:
    """The measurements every rank fits, from every rank's ``probe``: per collective, algorithm
    and size, the fastest round (a call is only ever slowed by what runs beside it) of the
    slowest rank in that round (every rank waits for it)."""
    out = {}
    for c, m in per_rank[0].items():
        out[c] = {"bytes": m["bytes"]}
        for a in m:
            if a != "bytes":
                out[c][a] = [
                    min(max(r[c][a][i][k] for r in per_rank) for k in range(len(rounds)))
                    for i, rounds in enumerate(m[a])
                ]
    return out


# -- the cache ------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(nranks: int, opts) -> dict:
    """What a calibration holds for: this machine (its name, processor and the CPUs this process
    may run on), the rank count, the staging slots, this version of the package, the probe's
    sizes and the fit."""
    from pycollectives import __version__  # the package imports this module

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": cpus,
        "ranks": nranks,
        "staging_bytes": opts.staging_bytes,
        "staging_slots": opts.staging_slots,
        "version": __version__,
        "probe_sizes": list(PROBE_SIZES),
        "fit": FIT,
    }


def cache_dir(opts) -> Path:
    if opts.cache_dir:
        return Path(opts.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pycollectives"


def cache_file(opts, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(opts) / f"host-tuning-{key['ranks']}ranks-{digest}.json"


def read_cached(path: Path, key: dict) -> list | None:
    """The rules cached in `path` for `key`; None where there are none (no file, another key,
    or a file that does not parse: it is measured again)."""
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") != key:
            return None
        return [tuple(r) for r in saved["rules"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cached(path: Path, key: dict, measured: dict, rules: list, seconds: float):
    """Write the calibration whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"key": key, "probe_seconds": seconds, "measured": measured, "rules": rules}
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# -- what a communicator is given -----------------------------------------------------------------


def tuning_rules(group, opts, make_host) -> tuple[list, str]:
    """(rules, where they came from) for a host communicator over `group`, as
    ``opts.tuning`` says. `make_host()` makes the communicator a probe runs on (every rank
    calls it together). Every rank gets the same rules."""
    if opts.tuning == "shipped" or opts.algorithm is not None or group.size == 1:
        # PYCOLL_ALGO forces what the table would choose (the table stays for the collectives
        # the forced algorithm lacks); one rank moves nothing.
        return load_tuning(), "the shipped table"
    if opts.tuning not in ("auto", "calibrate"):
        return load_tuning(opts.tuning), f"{opts.tuning} (PYCOLL_TUNING)"
    key = machine_key(group.size, opts)
    path = cache_file(opts, key)
    cached = read_cached(path, key) if group.rank == 0 and opts.tuning == "auto" else None
    cached = gathered_or_raise(group, "cannot read the tuning cache", cached)[0]
    if cached is not None:
        return cached, f"{path} (measured before)"
    if getattr(group, "members", None) is not None:
        # A shrink after a failure measures nothing: the survivors go on at once.
        return load_tuning(), "the shipped table (a shrink measures nothing)"
    started = time.perf_counter()
    mine = probe(make_host(), group.size)  # the probe's communicator is gone once it returns
    measured = slowest(gathered_or_raise(group, "cannot calibrate the algorithms", mine))
    rules = rules_from(measured, group.size)
    seconds = time.perf_counter() - started
    if group.rank == 0:
        try:
            write_cached(path, key, measured, rules, seconds)
            where = f"cached in {path}"
        except OSError as e:
            where = f"not cached ({e}; PYCOLL_CACHE_DIR names a folder to cache in)"
        print(
            f"pycollectives: measured this machine's algorithm thresholds for {group.size} ranks "
            f"in {seconds:.1f} s, {where} (PYCOLL_TUNING)",
            file=sys.stderr,
            flush=True,
        )
    return rules, "measured just now"
