"""What the parallel-training examples share: synthetic data every rank can regenerate, and
the closing comparison with the same training in one process."""

from __future__ import annotations

import os

import numpy as np


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
