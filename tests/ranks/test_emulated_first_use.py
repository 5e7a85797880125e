"""Registration on first use on the emulated device (csrc/device/first_use.h): collectives on
device arrays no one registered run zero-copy over every rank's allocation once the ranks have
traded where their buffers lie. See workers/emulated_first_use.py."""

import pytest
from harness.launch import run_mpi

from .test_emulated_registered import _shard, _traffic

pytestmark = pytest.mark.emulated


def _run(nranks, mode, part):
    """The worker's `part` on `nranks` ranks in `mode`, which rank 0 ends by naming."""
    out = run_mpi(nranks, "emulated_first_use.py", mode, part)
    assert f"first_use {part} {mode} ranks={nranks}" in out, out


@pytest.mark.parametrize("mode,nranks", [("kernel", 3), ("stepped", 2)])
def test_first_use_collectives(mode, nranks):
    # The five collectives that run over shared buffers, every dtype and op, in place and not,
    # at offsets that differ between ranks; each allocation sent and mapped once; below the
    # size, or with a host array on one rank, the staged path on every rank.
    _run(nranks, mode, "collectives")


@pytest.mark.parametrize("mode", ["kernel", "stepped"])
def test_first_use_after_free_and_reallocation(mode):
    # Every round each rank frees its buffer and allocates one of the same size at the same
    # address: the peers map the new allocation. (Keyed by address, the mapping of the freed
    # one was reused: every element wrong from the second round; remembering what was sent by
    # address alone: "sent before but is not mapped here".)
    _run(2, mode, "realloc")


def test_first_use_traffic():
    # A first-use all-reduce moves what the two-shot over registered buffers moves (2nS in
    # all; the worked case in test_emulated_registered.test_registered_traffic), with every
    # rank's buffer at an offset of its own.
    n, count = 3, 3072
    rows = _traffic(n, count, "traffic", ("first_use",), worker="emulated_first_use.py")
    got = rows["first_use"]
    for r in range(n):
        s = 4 * _shard(count, n, r)
        assert got[r] == (s, (n - 1) * s, s, (n - 1) * s), (r, got[r])
    assert sum(sum(t) for t in got.values()) == 2 * n * 4 * count


@pytest.mark.parametrize("mode", ["kernel", "stepped"])
def test_first_use_mismatch(mode):
    _run(2, mode, "mismatch")


@pytest.mark.parametrize("nranks", [2, 3])
def test_copy_engines_in_stepped_mode(nranks):
    # PYCOLL_CUDA_COPY_ENGINES: stepped mode's registered (and first-use) all-gathers and
    # broadcasts as copies between the fences, no launch; the bytes copied counted; back to
    # back with every queue late in turn. Planted and caught: the second fence skipped (a
    # peer's copy read an input already overwritten: 3000 of 3000 elements wrong).
    _run(nranks, "stepped", "copy_engines")
