"""Copies of the host transport: all-gather on 2 ranks in one copy, straight into the peer's
output (workers/single_copy.py: results against mpi4py, the staged fallback where the kernel
refuses cross-memory attach, mismatch detection before anything is written), and copies
between arrays at every relative alignment (workers/single_copy_alignment.py)."""

import pytest
from harness.launch import run_mpi

# Every block but one-element float16/int8 ones; outputs from 1 MiB (the largest) streamed.
LOW = {"PYCOLL_SINGLE_COPY_BYTES": "4", "PYCOLL_STREAM_BYTES": str(1 << 20)}


@pytest.mark.parametrize("cma", ["on", "fail", "off"])
def test_single_copy_all_gather_matches_mpi(cma):
    env = dict(LOW, PYCOLL_P2P_CMA=cma, PYCOLL_DEBUG="INFO")
    out, err = run_mpi(2, "single_copy.py", "data", env=env, with_stderr=True)
    # Where the kernel refuses, the first eligible call finds out and the staged ring runs
    # from then on; with "off" nothing is tried.
    algo = "direct" if cma == "on" else "ring"
    assert out.count(f"algorithm {algo}") == 2, out
    assert ("large all-gathers use the staging slots" in err) == (cma == "fail")
    if cma == "on":
        assert "all_gather #" in err and "algo=direct (single copy)" in err


def test_single_copy_all_gather_count_mismatch_raises_before_writing():
    run_mpi(2, "single_copy.py", "mismatch", env=LOW)


STORES = {
    "cached": None,
    "outputs streamed": {"PYCOLL_STREAM_BYTES": "1024"},
    "slots streamed": {"PYCOLL_SLOT_STORES": "streamed"},
    "both streamed": {"PYCOLL_STREAM_BYTES": "1024", "PYCOLL_SLOT_STORES": "streamed"},
}


@pytest.mark.parametrize("stores", STORES)
def test_copies_between_arrays_at_every_relative_alignment(stores):
    # Destinations 0-64 bytes (and a page and more) after their sources modulo the page size:
    # the copy routine switches between its vector loop and memmove on that distance.
    # Streamed outputs (from 1 KiB) and slots are written with non-temporal stores, which
    # start at their first 16-byte boundary; an output and a slot misaligned differently
    # go through a block.
    run_mpi(2, "single_copy_alignment.py", env=STORES[stores])
