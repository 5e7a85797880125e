"""What the parallel-training examples share: synthetic data every rank can regenerate, and
the closing comparison with the same training in one process."""

from __future__ import annotations

import numpy as np


def classification_data(n: int, n_in: int, n_classes: int, seed: int = 0, dtype=np.float64):
    """(x, labels): `n` points of `n_classes` Gaussian clusters in `n_in` dimensions, the same on
    every rank for the same arguments."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.5, (n_classes, n_in))
    labels = rng.integers(0, n_classes, n)
    x = centers[labels] + rng.normal(0.0, 1.0, (n, n_in))
    return x.astype(dtype), labels.astype(np.int64)


def tolerance(dtype) -> float:
    """How far parameters trained in parallel may drift from one process's: sums run in a
    different order, nothing else differs."""
    return 1e-9 if np.dtype(dtype) == np.float64 else 1e-4


def max_abs_diff(got, want) -> float:
    return max((float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)),
               default=0.0)  # fmt: skip


def report_match(got, want, dtype) -> bool:
    """Prints ``matches single-process training: yes|no (max |diff| = d)``; True when it does."""
    if len(got) != len(want) or any(np.shape(a) != np.shape(b) for a, b in zip(got, want)):
        print("matches single-process training: no (parameter shapes differ)", flush=True)
        return False
    d = max_abs_diff(got, want)
    ok = d <= tolerance(dtype)
    print(f"matches single-process training: {'yes' if ok else 'no'} (max |diff| = {d:.3g})",
          flush=True)  # fmt: skip
    return ok
