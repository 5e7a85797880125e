"""What the parallel-training examples share: the digits data set and synthetic data every
rank can regenerate, and the closing comparison with the same training in one process."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import numpy as np


def digits_mlp_parser(description: str, epochs: int) -> argparse.ArgumentParser:
    """The argument parser of an example that trains an MLP on the digits on every rank, with
    the options they share: --epochs (default `epochs`), --batch-size (per rank), --hidden
    (units), --lr; the example adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--epochs", type=int, default=epochs)
    ap.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    return ap


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, as ``sklearn.datasets.load_digits(return_X_y=True)`` gives them:
    (1797 x 64 pixel values 0-16 as float64, labels as int64). Read from the file scikit-learn
    ships (datasets/data/digits.csv.gz) without importing it: the import, scipy's with it, takes
    two seconds of every rank's start."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits data set comes with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # a scikit-learn that keeps it elsewhere
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return x, y.astype(np.int64)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def digits_split(seed: int = 0):
    """((x_train, y_train), (x_test, y_test)): the digits shuffled by `seed`, a fifth held out
    for testing, pixels scaled to [0, 1] as float32."""
    pixels, labels = digits()
    x = (pixels / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], labels[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def classification_data(n: int, n_in: int, n_classes: int, seed: int = 0, dtype=np.float64):
    """(x, labels): `n` points of `n_classes` Gaussian clusters in `n_in` dimensions, the same on
    every rank for the same arguments."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.5, (n_classes, n_in))
    labels = rng.integers(0, n_classes, n)
    x = centers[labels] + rng.normal(0.0, 1.0, (n, n_in))
    return x.astype(dtype), labels.astype(np.int64)


def batches(x, labels, batch_size: int) -> list:
    """Successive (x, labels) batches of `batch_size` rows."""
    return [(x[i : i + batch_size], labels[i : i + batch_size])
            for i in range(0, len(x) - batch_size + 1, batch_size)]  # fmt: skip


def train_one_process(model, batches, optimizer: str, lr: float, **opt_kw) -> list:
    """The reference every example compares with: `model` trained in this process on each
    whole batch (mean cross-entropy), with optimizer `optimizer`; returns its parameters."""
    from pycollectives.parallel import nn, optim

    opt = optim.make(optimizer, model.params, lr, **opt_kw)
    for x, labels in batches:
        model.zero_grad()
        out, caches = model.forward(x)
        model.backward(nn.softmax_cross_entropy(out, labels)[1], caches)
        opt.step(model.grads)
    return model.params


def limit_blas_threads(n: int):
    """At most `n` BLAS threads in this process (the calling thread's included): ranks sharing
    a machine's cores must not each start a thread per core, which on 2 cores makes a step tens
    of times slower. Needs threadpoolctl (scikit-learn brings it); without it, the BLAS
    default stands. Returns the limiter (``restore_original_limits()`` undoes it), or None."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(max(1, int(n)), user_api="blas")


def blas_share(ranks_here: int) -> int:
    """BLAS threads per rank when `ranks_here` ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_here))


def tolerance(dtype) -> float:
    """How far parameters trained in parallel may drift from one process's: sums run in a
    different order, nothing else differs."""
    return 1e-9 if np.dtype(dtype) == np.float64 else 1e-4


def max_abs_diff(got, want) -> float:
    return max((float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)),
               default=0.0)  # fmt: skip


def print_match(diff: float, dtype) -> bool:
    """Prints ``matches single-process training: yes|no (max |diff| = d)`` for the largest
    difference `diff`; True when it is within the tolerance of `dtype`."""
    ok = diff <= tolerance(dtype)
    print(f"matches single-process training: {'yes' if ok else 'no'} (max |diff| = {diff:.3g})",
          flush=True)  # fmt: skip
    return ok


def report_match(got, want, dtype) -> bool:
    """``print_match`` of parameters `got` against `want`."""
    if len(got) != len(want) or any(np.shape(a) != np.shape(b) for a, b in zip(got, want)):
        print("matches single-process training: no (parameter shapes differ)", flush=True)
        return False
    return print_match(max_abs_diff(got, want), dtype)
