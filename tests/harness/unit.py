"""Helpers for the unit tests (tests/unit): a benchmark script loaded as a module, and
functions run at once, each on a thread of its own."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    """benchmarks/NAME.py, run afresh as a module named NAME and registered in sys.modules
    under that name (a dataclass of the script looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def on_threads(fns) -> list:
    """Each of `fns` called on a thread of its own, all at once: what each returned or raised
    (each thread waited for 30 s at most)."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - compared by the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out
