"""An alpha-beta cost model of the collectives, evaluated on the schedules themselves.

    python -m pycollectives.cost_model [--profile here|h100] [--plot PATH] [--json PATH]

Each message costs ``alpha + bytes / beta`` on its link, and each reduced byte ``gamma`` on the
rank that reduces it; a rank injects one message at a time (its port is busy ``bytes / beta``),
and a step starts when the rank is free and every message it consumes has arrived. The steps
come from the schedule code (``_C.schedule``: the same steps the executors run), so the model
counts exactly the messages, bytes and reductions of every ring, tree and direct schedule.

- ``simulate`` replays every rank's steps as events (exact for the model, for up to ~64 ranks);
- ``estimate`` serves thousands of ranks: from the steps of a few sample ranks it takes the
  busiest rank's step count S, bytes sent B and bytes reduced R, and charges
  ``(S + 2 * depth) * alpha + B / beta + R * gamma`` (depth: tree height, 0 for ring/direct) —
  a pipeline of S steps in lockstep, plus the fill and drain of a tree (for trees this is
  optimistic: it assumes the pieces of both trees overlap perfectly, which the in-order
  executor does not achieve; tests bound the gap against the simulation);
- hierarchical collectives are the sum of their phases (see
  pycollectives.backends.hierarchical), the intra-node phases on intra-node links and the
  inter-node phase on one NIC rail per rank.

Link parameters come from measurements on this machine (``benchmarks/model_calibrate.py``
writes ``pycollectives/cost_model_calibration.json``), or from a hardware profile (``h100``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from pycollectives import _C
from pycollectives.ops import bus_factor

CALIBRATION_FILE = Path(__file__).with_name("cost_model_calibration.json")


@dataclass(frozen=True)
class Link:
    """One class of link: seconds per message, bytes per second, seconds per reduced byte.
    `bcast_once`: a message to every peer is written once (shared memory), not once per peer.
    `piece_bytes`: the transport's largest message (its staging slot); schedules are cut into
    pieces of this size. On a CPU, buffers that stay in the last-level cache move faster: a
    collective on more than `cache_bytes` runs at `beta_large` (0: no such distinction).
    Messages above `rendezvous_bytes` pay `rendezvous_alpha` more (MPI's rendezvous handshake)."""

    alpha: float
    beta: float
    gamma: float = 0.0
    bcast_once: bool = False
    piece_bytes: int = 1 << 20
    beta_large: float = 0.0
    cache_bytes: int = 0
    rendezvous_bytes: int = 0
    rendezvous_alpha: float = 0.0

    def latency(self, message_bytes: int) -> float:
        if self.rendezvous_bytes and message_bytes > self.rendezvous_bytes:
            return self.alpha + self.rendezvous_alpha
        return self.alpha

    def bandwidth(self, nbytes: int) -> float:
        if self.cache_bytes and nbytes > self.cache_bytes and self.beta_large:
            return self.beta_large
        return self.beta


@dataclass(frozen=True)
class Machine:
    intra: Link
    inter: Link
    name: str = ""


@dataclass
class Costs:
    """What the busiest rank of a schedule does."""

    steps: int = 0  # steps that wait for a message
    messages: int = 0  # messages it sends
    bytes_sent: int = 0  # bytes it sends (a shared-memory broadcast counted once)
    bytes_reduced: int = 0  # bytes of incoming partial results it reduces


# -- schedules ---------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _steps(algorithm, collective, rank, n, count, piece):
    return tuple(
        _parse(s, rank, n)
        for s in _C.schedule(algorithm, collective, rank, n, count, 0, piece=piece, acc_bytes=4)
    )


def _parse(s, rank, n):
    """(sources, destinations, bytes per message, broadcast?, bytes reduced) of one step, from
    what the schedule code says the step receives and sends."""
    nbytes = 4 * s["count"]  # float32 elements and float32 partial sums
    srcs = tuple(s["recv_from"])
    bcast = _C.ALL_PEERS in s["send_to"]
    dsts = tuple(q for q in range(n) if q != rank) if bcast else tuple(s["send_to"])
    reduced = nbytes * len(srcs) if s["reduces"] else 0
    return srcs, dsts, nbytes, bcast, reduced


def schedule_costs(algorithm, collective, n, count, piece, ranks=None, bcast_once=False):
    """Costs of the busiest rank (max of each field over `ranks`, default all) of a schedule
    of `count` float32 elements on `n` ranks, in messages of at most `piece` elements."""
    worst = Costs()
    for r in ranks if ranks is not None else range(n):
        c = Costs()
        for srcs, dsts, nbytes, bcast, reduced in _steps(algorithm, collective, r, n, count, piece):
            c.steps += 1 if srcs else 0
            c.messages += len(dsts)
            c.bytes_sent += nbytes * (1 if bcast and bcast_once else len(dsts))
            c.bytes_reduced += reduced
        worst = Costs(*(max(a, b) for a, b in zip(asdict(worst).values(), asdict(c).values())))
    return worst


# -- time --------------------------------------------------------------------------------------


def simulate(algorithm, collective, n, nbytes, link_of, piece_bytes):
    """Seconds for the schedule on n ranks, replaying every rank's steps; `link_of(r, q)` gives
    the Link from rank r to rank q."""
    count = max(0, nbytes // 4)
    piece = max(1, piece_bytes // 4)
    steps = [_steps(algorithm, collective, r, n, count, piece) for r in range(n)]
    ptr, clock, port = [0] * n, [0.0] * n, [0.0] * n
    sent, used = defaultdict(list), defaultdict(int)
    progress = True
    while progress:
        progress = False
        for r in range(n):
            while ptr[r] < len(steps[r]):
                srcs, dsts, b, bcast, reduced = steps[r][ptr[r]]
                if any(used[(q, r)] >= len(sent[(q, r)]) for q in srcs):
                    break
                t = clock[r]
                for q in srcs:
                    t = max(t, sent[(q, r)][used[(q, r)]])
                    used[(q, r)] += 1
                if reduced:
                    t += reduced * max(link_of(q, r).gamma for q in srcs)
                start = max(t, port[r])
                once = False
                for q in dsts:
                    link = link_of(r, q)
                    if not (bcast and link.bcast_once and once):
                        port[r] = max(port[r], start) + b / link.bandwidth(nbytes)
                    once = True
                    sent[(r, q)].append(port[r] + link.latency(b))
                clock[r] = max(t, port[r]) if dsts else t
                ptr[r] += 1
                progress = True
    if any(ptr[r] < len(steps[r]) for r in range(n)):
        raise RuntimeError(f"{algorithm} {collective} on {n} ranks did not finish (deadlock)")
    return max(clock) if n else 0.0


def _chain(algorithm, collective, n):
    """Hops the last piece travels: a ring passes each chunk through every rank (twice for
    all-reduce); a tree goes up and down its height; direct is one hop."""
    if n <= 1:
        return 0
    if algorithm == "ring":
        return (n - 1) * (2 if collective == "all_reduce" else 1)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n))
    return 2 if collective == "all_reduce" else 1


def estimate(algorithm, collective, n, nbytes, link):
    """Seconds for the schedule on n ranks over links `link`, from a few sample ranks."""
    if n <= 1:
        return 0.0
    count = max(0, nbytes // 4)
    sample = sorted({0, 1, n // 3, n // 2, n - 1})
    piece = max(1, link.piece_bytes // 4)
    c = schedule_costs(
        algorithm, collective, n, count, piece, ranks=sample, bcast_once=link.bcast_once
    )
    # Pipelined: the busiest rank's steps, or the longest chain of hops if that is longer;
    # a tree also fills and drains.
    fill = 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 0
    mean_message = c.bytes_sent // max(1, c.messages)
    return (
        (max(c.steps + fill, _chain(algorithm, collective, n))) * link.latency(mean_message)
        + c.bytes_sent / link.bandwidth(nbytes)
        + c.bytes_reduced * link.gamma
    )


def predict(collective, algorithm, nbytes, nodes, ranks_per_node, machine: Machine):
    """Seconds for one collective of `nbytes` (input of all-reduce/broadcast/reduce, one
    rank's shard of all-gather/reduce-scatter) on nodes x ranks_per_node ranks. `algorithm`:
    ring, tree, direct (flat over all ranks; a flat schedule crossing nodes runs at the pace
    of its inter-node links) or hierarchical (ring inside nodes, `inter` between them)."""
    n = nodes * ranks_per_node
    if algorithm != "hierarchical" and not algorithm.startswith("hierarchical:"):
        link = machine.inter if nodes > 1 else machine.intra
        if n <= 16:
            return simulate(algorithm, collective, n, nbytes, lambda r, q: link, link.piece_bytes)
        return estimate(algorithm, collective, n, nbytes, link)
    inter_algo = algorithm.partition(":")[2] or "ring"
    L, N = ranks_per_node, nodes
    intra = lambda coll, b: predict(coll, "ring", b, 1, L, machine) if L > 1 else 0.0  # noqa: E731
    inter = lambda coll, b: (  # noqa: E731
        predict(coll, inter_algo, b, 1, N, Machine(machine.inter, machine.inter)) if N > 1 else 0.0
    )
    if collective == "all_reduce":
        shard = 4 * -(-(nbytes // 4) // L)
        return (
            intra("reduce_scatter", shard) + inter("all_reduce", shard) + intra("all_gather", shard)
        )
    if collective == "reduce_scatter":
        return intra("reduce_scatter", N * nbytes) + inter("reduce_scatter", nbytes)
    if collective == "all_gather":
        return inter("all_gather", nbytes) + intra("all_gather", N * nbytes)
    if collective == "broadcast":
        return inter("broadcast", nbytes) + intra("broadcast", nbytes)
    return intra("reduce", nbytes) + inter("reduce", nbytes)


# -- profiles ----------------------------------------------------------------------------------

# 8x H100 SXM per node. NVLink 4 is 450 GB/s per direction per GPU on paper; peer copies
# measure ~390 GB/s (the figure p2p bandwidth tests report), which is what a ring can stream.
# alpha: one NVLink hop of a flag-synchronised kernel, ~1 us. The reduction is fused into the
# copy kernel and hides behind the link (gamma 0). A GPU ring runs ~8 channels of 512 KiB
# slices at once: one 4 MiB piece stands for them. Between nodes: one 400 Gb/s NDR InfiniBand
# NIC per GPU (rail-optimised), ~48 GB/s achievable, ~4 us per message.
H100 = Machine(
    intra=Link(alpha=1.0e-6, beta=390e9, gamma=0.0, piece_bytes=4 << 20),
    inter=Link(alpha=4.0e-6, beta=48e9, gamma=0.0, piece_bytes=4 << 20),
    name="8x H100 SXM per node, NVLink 4 + 8x 400G InfiniBand",
)
# Published by NVIDIA for nccl-tests all_reduce on one 8x H100 node.
NCCL_H100_BUSBW_GBS = (360.0, 370.0)
NCCL_H100_SMALL_LATENCY_US = 15.0


def load_calibration(path=CALIBRATION_FILE):
    with open(path) as f:
        return json.load(f)


def here(calibration=None) -> Machine:
    """This machine: shared memory inside a node, MPI between emulated nodes (fitted)."""
    cal = calibration or load_calibration()
    p = cal["params"]
    return Machine(
        intra=Link(**p["intra"], bcast_once=True), inter=Link(**p["inter"]), name=cal["machine"]
    )


# -- command line ------------------------------------------------------------------------------


def _busbw(collective, n, nbytes, seconds):
    size = nbytes * n if collective in ("all_gather", "reduce_scatter") else nbytes
    return size / seconds / 1e9 * bus_factor(collective, n)


def calibration_check(cal):
    """(what, measured s, predicted s, relative error) for every stored measurement."""
    m = here(cal)
    rows = []
    for point in cal["measurements"]:
        t = predict(
            point["collective"], point["algorithm"], point["bytes"], point["nodes"],
            point["ranks_per_node"], m,
        )  # fmt: skip
        rows.append((point, point["seconds"], t, t / point["seconds"] - 1))
    return rows


def nccl_check():
    big = 1 << 30
    t_big = predict("all_reduce", "ring", big, 1, 8, H100)
    t_small = predict("all_reduce", "ring", 8, 1, 8, H100)
    return _busbw("all_reduce", 8, big, t_big), t_small * 1e6


def scaling(machine, sizes=(8, 64 << 10, 1 << 30), per_node=8, max_gpus=4096):
    rows = []
    gpus = per_node
    while gpus <= max_gpus:
        nodes = gpus // per_node
        for nbytes in sizes:
            row = {"gpus": gpus, "bytes": nbytes}
            for algo in ("ring", "tree", "hierarchical"):
                t = predict("all_reduce", algo, nbytes, nodes, per_node, machine)
                row[algo + "_us"] = t * 1e6
                row[algo + "_busbw"] = _busbw("all_reduce", gpus, nbytes, t)
            rows.append(row)
        gpus *= 2
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="alpha-beta model of the collectives")
    ap.add_argument("--plot", help="save the 8-4096 GPU scaling plot here (PNG)")
    ap.add_argument("--json", help="write calibration check, NCCL check and scaling as JSON")
    ap.add_argument("--max-gpus", type=int, default=4096)
    args = ap.parse_args(argv)
    report = {}
    try:
        cal = load_calibration()
    except FileNotFoundError:
        cal = None
        print("no calibration file: run benchmarks/model_calibrate.py")
    if cal is not None:
        print(f"# calibration on {cal['machine']}: fitted {json.dumps(cal['params'])}")
        print(f"# {'collective':<11} {'algorithm':<13} {'topo':>5} {'bytes':>10} "
              f"{'measured us':>12} {'model us':>10} {'error':>7}")  # fmt: skip
        worst = 0.0
        for p, got, want, err in calibration_check(cal):
            worst = max(worst, abs(err))
            print(f"  {p['collective']:<11} {p['algorithm']:<13} "
                  f"{p['nodes']}x{p['ranks_per_node']:<3} {p['bytes']:>10} "
                  f"{got * 1e6:>12.1f} {want * 1e6:>10.1f} {err:>+7.0%}")  # fmt: skip
        print(f"# largest calibration error {worst:.0%}")
        report["calibration_worst_error"] = worst
    bw, lat = nccl_check()
    lo, hi = NCCL_H100_BUSBW_GBS
    print(f"# {H100.name}")
    print(f"  8-GPU ring all_reduce busbw at 1 GiB: model {bw:.0f} GB/s, NCCL published "
          f"{lo:.0f}-{hi:.0f} GB/s ({bw / ((lo + hi) / 2) - 1:+.0%})")  # fmt: skip
    pub = NCCL_H100_SMALL_LATENCY_US
    print(f"  8-GPU ring all_reduce latency at 8 B: model {lat:.1f} us, NCCL published "
          f"~{pub:.0f} us ({lat / pub - 1:+.0%})")  # fmt: skip
    report["nccl_check"] = {"busbw_GBs": bw, "latency_us": lat}
    rows = scaling(H100, max_gpus=args.max_gpus)
    report["scaling"] = rows
    print(f"# all_reduce on {H100.name}: predicted time (us) and busbw (GB/s)")
    print(f"# {'gpus':>5} {'bytes':>11} {'ring us':>10} {'tree us':>10} {'hier us':>10} "
          f"{'ring bw':>8} {'tree bw':>8} {'hier bw':>8}")  # fmt: skip
    for r in rows:
        print(f"  {r['gpus']:>5} {r['bytes']:>11} {r['ring_us']:>10.1f} {r['tree_us']:>10.1f} "
              f"{r['hierarchical_us']:>10.1f} {r['ring_busbw']:>8.1f} {r['tree_busbw']:>8.1f} "
              f"{r['hierarchical_busbw']:>8.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    big, small = max(r["bytes"] for r in rows), min(r["bytes"] for r in rows)
    for algo, style in (("ring", "o-"), ("tree", "s-"), ("hierarchical", "^-")):
        xs = [r["gpus"] for r in rows if r["bytes"] == big]
        a.plot(xs, [r[algo + "_busbw"] for r in rows if r["bytes"] == big], style, label=algo)
        b.plot(xs, [r[algo + "_us"] for r in rows if r["bytes"] == small], style, label=algo)
    a.set(xscale="log", xlabel="GPUs", ylabel="busbw (GB/s)", title=f"all_reduce {big >> 20} MiB")
    b.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="time (us)",
          title=f"all_reduce {small} B")  # fmt: skip
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"model: {H100.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
