"""The sweep's output: nccl-tests' table, the comparison, JSON, and a plot."""

from __future__ import annotations

import json
import sys
import textwrap

HEADER = "#{:>12} {:>12} {:>8} {:>6} {:>5}   {:>9} {:>7} {:>7} {:>6}   {:>9} {:>7} {:>7} {:>6}"
ROW = (
    " {:>12} {:>12} {:>8} {:>6} {:>5}   {:>9.2f} {:>7.2f} {:>7.2f} {:>6}   "
    "{:>9.2f} {:>7.2f} {:>7.2f} {:>6}"
)


def table_header(title: str) -> str:
    return "\n".join(
        [
            f"# {title}",
            "#" + " " * 46 + "out-of-place" + " " * 23 + "in-place",
            HEADER.format(
                "size",
                "count",
                "type",
                "redop",
                "root",
                "time",
                "algbw",
                "busbw",
                "#wrong",
                "time",
                "algbw",
                "busbw",
                "#wrong",
            ),
            HEADER.format(
                "(B)",
                "(elements)",
                "",
                "",
                "",
                "(us)",
                "(GB/s)",
                "(GB/s)",
                "",
                "(us)",
                "(GB/s)",
                "(GB/s)",
                "",
            ),
        ]
    )


def table_row(r: dict) -> str:
    o, i = r["oop"], r["ip"]
    return ROW.format(
        r["size"],
        r["count"],
        r["type"],
        r["redop"],
        r["root"],
        o["time_us"],
        o["algbw"],
        o["busbw"],
        o["wrong"],
        i["time_us"],
        i["algbw"],
        i["busbw"],
        i["wrong"],
    )


def footer(rows: list) -> str:
    wrong = sum(r["oop"]["wrong"] + r["ip"]["wrong"] for r in rows)
    avg = sum(r["oop"]["busbw"] for r in rows) / len(rows) if rows else 0.0
    return (
        f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}\n"
        f"# Avg bus bandwidth    : {avg:.4f}"
    )


def comparison(
    rows: list,
    names: list,
    copy_bw: float,
    memory: str = "memory copy bandwidth per rank, all ranks copying",
    notes: list = (),
) -> str:
    """Each peer's time / ours per size and its share of the bound, the bound, then why peers
    were skipped and `notes` ((peer, text) pairs: what each peer is)."""
    lines = [
        f"# {memory}: {copy_bw:.2f} GB/s",
        "# peers' time / ours timed again just before each peer at the same size "
        "(>1: ours is faster), then the peer's share of the bound (bound / its time); "
        "bound = least possible time, of bound = bound / ours",
        "#{:>12} {:>10} {:>10} {:>8} {}".format(
            "size", "ours us", "bound us", "of bound", " ".join(f"{n:>14}" for n in names)
        ),
    ]
    for r in rows:
        ours, bound = r["oop"]["time_us"], r["bound"]["time_us"]
        cells = []
        for n in names:
            c = r["compare"].get(n, {})
            cell = "n/a" if "ratio" not in c else f"{c['ratio']:.2f}x"
            if c.get("time_us"):
                cell += f" {percent(bound / c['time_us']):>4}"
            cells.append(f"{cell + (' WRONG' if c.get('wrong') else ''):>14}")
        lines.append(
            f" {r['size']:>12} {ours:>10.2f} {bound:>10.2f} {bound / ours:>8.0%} " + " ".join(cells)
        )
    reasons = {(n, c["skipped"]) for r in rows for n, c in r["compare"].items() if "skipped" in c}
    lines += [f"# {n}: {text}" for n, text in notes]
    lines += [f"# {n}: {why}" for n, why in sorted(reasons)]
    return "\n".join(lines)


def _sizes(collective: str, size: int, nranks: int) -> tuple[int, int]:
    """(input bytes, one rank's block bytes) of a pycoll-bench size, by the bench's own layout
    (cli.layout: all-gather and reduce-scatter are sized by the gathered or scattered whole)."""
    import numpy as np

    from pycollectives.bench.cli import layout

    dt = np.dtype(np.uint8)  # layout's byte counts do not depend on the element type
    n_in, n_out, _ = layout(collective, size, dt, nranks) or (0, 0, 0)
    return n_in, min(n_in, n_out) if collective in ("all_gather", "reduce_scatter") else n_in


def model_choice(collective: str, size: int, nranks: int) -> str | None:
    """The algorithm the cost model (pycollectives.cost_model, this machine's calibration)
    finds fastest for `collective` of `size` bytes as pycoll-bench sizes it, on one node (the
    model takes one rank's block for all-gather and reduce-scatter); None without a model."""
    from pycollectives import cost_model
    from pycollectives.ops import ALGORITHMS_FOR

    try:
        machine = cost_model.here()
    except (OSError, ValueError, KeyError):
        return None
    per = _sizes(collective, size, nranks)[1]
    algos = ALGORITHMS_FOR.get(collective, ())
    times = {a: cost_model.predict(collective, a, per, 1, nranks, machine) for a in algos}
    return min(times, key=times.get) if times else None


def shipped_choice(collective: str, size: int, nranks: int) -> str:
    """The algorithm the tuning table shipped with the package picks for `collective` as
    pycoll-bench sizes it (``PYCOLL_TUNING=shipped``)."""
    from pycollectives.backends.host_tuning import table_choice
    from pycollectives.options import load_tuning

    return table_choice(load_tuning(), collective, nranks, _sizes(collective, size, nranks)[0])


def choices(rows: list, forced: list, algorithm_for, nranks: int, others=None) -> str:
    """Per size: the fastest of the forced algorithms measured (peers named as algorithms),
    the automatic choice (`algorithm_for(collective, input bytes)`, as a call with the
    bench's arrays asks it) and the other choices (`others`: name -> ``f(collective, size,
    nranks)``, e.g. the shipped table's and the cost model's), each with its measured time
    over the fastest's (1.00: it is the fastest); then, per choice, at how many sizes it is
    within 10% of the fastest."""
    others = others or {}
    names = ["auto", *others]
    lines = [
        "# the algorithm each size gets: measured with each forced (--compare), the fastest; "
        f"{', '.join(names)}: each one's choice and its time / the fastest's",
        "#{:>12} {:>8}".format("size", "fastest") + "".join(f" {n:>8} {'ratio':>6}" for n in names),
    ]
    near, sizes = dict.fromkeys(names, 0), 0
    for r in rows:
        # The forced algorithms' own times (with --rounds, each one's best), not their ratios
        # to ours timed beside each: a slow moment of that second timing of ours would make
        # the algorithm beside it look fast.
        times = {
            n: r["compare"][n]["time_us"] for n in forced if "time_us" in r["compare"].get(n, {})
        }
        if not times:
            continue
        best = min(times, key=times.get)
        coll, size = r["collective"], r["size"]
        picked = {"auto": algorithm_for(coll, _sizes(coll, size, nranks)[0])}
        picked.update((n, f(coll, size, nranks)) for n, f in others.items())
        sizes += 1
        line = f" {size:>12} {best:>8}"
        for n in names:
            ratio = times[picked[n]] / times[best] if picked[n] in times else None
            near[n] += ratio is not None and ratio <= 1.1
            line += f" {picked[n] or 'n/a':>8} {'n/a' if ratio is None else f'{ratio:.2f}':>6}"
        lines.append(line)
    lines.append(
        "# within 10% of the fastest: " + ", ".join(f"{n} {near[n]}/{sizes}" for n in names)
    )
    return "\n".join(lines)


def percent(v: float) -> str:
    """A share of the bound: "<1%" below one percent."""
    return "<1%" if v < 0.01 else f"{v:.0%}"


def write_json(path: str, meta: dict, rows: list):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def plot(path: str, rows: list, names: list, title: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install pycollectives[plot])") from None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for coll in dict.fromkeys(r["collective"] for r in rows):
        rs = [r for r in rows if r["collective"] == coll]
        x = [r["size"] for r in rs]
        tag = f" {coll}" if len({r["collective"] for r in rows}) > 1 else ""
        ax.plot(x, [r["oop"]["busbw"] for r in rs], marker="o", label=f"pycollectives{tag}")
        for n in names:
            ys = [r["compare"].get(n, {}).get("busbw") for r in rs]
            if any(y is not None for y in ys):
                ax.plot(
                    x,
                    [y if y is not None else float("nan") for y in ys],
                    marker=".",
                    label=f"{n}{tag}",
                )
        ax.plot(
            x,
            [r["bound"]["busbw"] for r in rs],
            linestyle="--",
            color="gray",
            label=f"memory bound{tag}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)  # whole, however long
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class Progress:
    """A bar on stderr, only when it is a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()

    def step(self, text: str):
        self.done += 1
        if self.enabled:
            w = 30
            fill = w * self.done // max(self.total, 1)
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (w - fill)}] {self.done}/{self.total} {text} ")
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")
