"""Eight blocking all-reduces of $CALLPATH_BYTES (8 by default) on numpy float32 arrays; rank 0
runs under gdb_follow.py. With CALLPATH_PKG set, the package is imported from there (a copy
holding a debug build of _C), not from the editable install."""

import os
import sys

if os.environ.get("CALLPATH_PKG"):
    sys.meta_path = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable")]
    sys.path.insert(0, os.environ["CALLPATH_PKG"])

import numpy as np  # noqa: E402

import pycollectives as pc  # noqa: E402

with pc.Communicator() as comm:
    x = np.ones(max(1, int(os.environ.get("CALLPATH_BYTES", "8")) // 4), np.float32)
    out = np.empty_like(x)
    for _ in range(8):
        comm.all_reduce(x, out)
    assert out[0] == comm.size
    if comm.rank == 0:
        print("callpath worker done, seq", comm.seq)
