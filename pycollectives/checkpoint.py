"""Checkpoint files that a crash cannot corrupt.

A checkpoint is one ``.npz`` file: named arrays plus a JSON header (``__meta__``). It is
written to a temporary file in the same directory, flushed to disk, then renamed over the
old one, so the file at `path` is always a whole checkpoint: the previous one until the
rename, the new one after it. A process killed while writing leaves only a temporary file,
which the next save removes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

META = "__meta__"
_TMP = ".tmp-"


def _fsync_dir(directory: Path):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_npz(f, arrays: dict):
    np.savez(f, **arrays)


def write_atomically(path, write):
    """Makes the file at `path` hold what `write(f)` writes into a binary file `f`, or leave
    it as it was: written to a temporary file beside it, flushed to disk, then renamed over
    it. Temporary files of an earlier writer killed mid-write are removed first."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{path.name}{_TMP}*"):
        stale.unlink(missing_ok=True)
    tmp = directory / f"{path.name}{_TMP}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)


def save(path, arrays: dict, meta: dict | None = None):
    """Writes `arrays` (name -> host array) and `meta` (a JSON-able dict) to `path`
    atomically: readers see the old file or the new one, never a part of one."""
    if META in arrays:
        raise ValueError(f"{META!r} is reserved for the checkpoint's header")
    header = np.frombuffer(json.dumps(meta or {}).encode(), np.uint8)
    contents = {**{k: np.asarray(v) for k, v in arrays.items()}, META: header}
    write_atomically(path, lambda f: _write_npz(f, contents))


def load(path) -> tuple[dict, dict]:
    """(arrays, meta) of the checkpoint at `path`."""
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files if k != META}
        meta = json.loads(f[META].tobytes().decode()) if META in f.files else {}
    return arrays, meta
