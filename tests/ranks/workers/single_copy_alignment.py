"""Collectives and send/recv between arrays at every relative position within a cache line
and a page, against numpy: the copies take a vector path where the destination lies 1-63
bytes after the source modulo 4096 (common/reduce.cpp), and memmove elsewhere.

Usage: mpiexec -n 2 python single_copy_alignment.py
"""

from __future__ import annotations

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc


def main():
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    assert n == 2
    c = pc.Communicator(mpi)
    page = np.zeros(1 << 20, np.uint8)
    base = page.ctypes.data
    count = 3001  # float32: 12 KB, through glibc's `rep movsb` range
    for shift in list(range(0, 68, 4)) + [4096 - 8, 4096 + 20]:
        # x at a page boundary, out `shift` bytes further into its page
        xo = (-base) % 4096
        oo = xo + 65536 + shift
        x = page[xo : xo + 4 * count].view(np.float32)
        x[:] = np.arange(count, dtype=np.float32) + 1000 * r
        out = page[oo : oo + 4 * n * count].view(np.float32)
        c.all_gather(x, out)
        want = np.concatenate([np.arange(count, dtype=np.float32) + 1000 * q for q in range(n)])
        assert np.array_equal(out, want), f"all_gather shift={shift}"
        red = out[:count]
        c.all_reduce(x, red)
        total = sum(np.arange(count, dtype=np.float32) + 1000 * q for q in range(n))
        assert np.array_equal(red, total), f"all_reduce shift={shift}"
        got = out[count : 2 * count]
        got[:] = 0
        peer = 1 - r
        if r == 0:
            c.send(x, peer)
            c.recv(got, peer)
        else:
            c.recv(got, peer)
            c.send(x, peer)
        assert np.array_equal(got, np.arange(count, dtype=np.float32) + 1000 * peer), shift
    c.close()
    mpi.Barrier()
    if r == 0:
        print("alignment")


if __name__ == "__main__":
    run_main(main)
