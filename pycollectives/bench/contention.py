"""``--contention``: one busy process per core beside the ranks, as a training job's compute
threads would be, for as long as the sweep runs (ours and every peer alike).

Rank 0 starts them; they are plain CPU-bound loops at the ranks' own priority, touching no
memory to speak of, so they take cores, not memory bandwidth. Each dies with the rank that
started it (PR_SET_PDEATHSIG), so a killed benchmark leaves none behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

SPIN = "import os\nos.write(1, b'.')\nwhile True:\n    pass\n"  # says when it runs
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Contention:
    """Context manager: `n` busy processes (default: one per core) started by rank 0."""

    def __init__(self, mpi, n: int | None = None):
        self.mpi = mpi
        self.n = len(os.sched_getaffinity(0)) if n is None else n
        self.procs = []

    def __enter__(self):
        if self.mpi.rank == 0:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", SPIN],
                        preexec_fn=_die_with_parent,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                    )
                )
            for p in self.procs:  # every one is spinning before anything is measured
                p.stdout.read(1)
        self.mpi.Barrier()
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
            p.stdout.close()
        self.procs = []
        self.mpi.Barrier()
        return False
