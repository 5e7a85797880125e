"""All-reduce over buffers every rank maps (Communicator.empty; workers/shared_buffers.py:
results against numpy, the staged fallback where a rank's buffers are not shared or mapping is
refused, buffers freed and made again, disagreement raising instead of corrupting), and the
same on the thread ranks of Communicator.local."""

import pytest
from harness.launch import run_mpi

# Every size on the mapped path; out-of-place calls from 8 MiB of input and output streamed.
ALL = {"PYCOLL_SHARED_BYTES": "0", "PYCOLL_DEBUG": "INFO", "PYCOLL_STREAM_BYTES": str(8 << 20)}


@pytest.mark.parametrize("nranks", [2, 3])
def test_shared_all_reduce_matches_numpy(nranks):
    out, err = run_mpi(nranks, "shared_buffers.py", "data", env=ALL, with_stderr=True)
    # Every all-reduce on the buffers took the path (Communicator.empty's own agreement on
    # plain arrays falls back).
    mapped = err.count("one pass over mapped buffers")
    assert mapped >= nranks * 250, mapped


@pytest.mark.parametrize("nranks", [2, 3])
def test_other_collectives_over_shared_buffers(nranks):
    out, err = run_mpi(nranks, "shared_buffers.py", "others", env=ALL, with_stderr=True)
    # 4 cases, each a reduce-scatter and an all-gather twice, a broadcast and two reduces
    # from every root: all over the mapped buffers, on every rank.
    assert err.count("one pass over mapped buffers") == nranks * 4 * (4 + 3 * nranks)


@pytest.mark.parametrize("cma", ["on", "fail"])
def test_plain_array_or_refused_mapping_falls_back(cma):
    env = dict(ALL, PYCOLL_P2P_CMA=cma)
    out, err = run_mpi(2, "shared_buffers.py", "mixed", env=env, with_stderr=True)
    before, after = err.split("now all shared", 1)
    assert "not allocated by Communicator.empty" in before, before
    assert "one pass over mapped buffers" not in before, before
    # Once every rank passes shared buffers they are mapped, unless mapping is refused.
    assert ("one pass over mapped buffers" in after) == (cma == "on"), after
    assert ("mapping a peer's buffer was refused" in after) == (cma == "fail"), after


def test_freed_and_many_buffers():
    run_mpi(2, "shared_buffers.py", "churn", env={"PYCOLL_SHARED_BYTES": "0"})


def test_disagreement_raises_on_every_rank():
    run_mpi(2, "shared_buffers.py", "mismatch", env={"PYCOLL_SHARED_BYTES": "0"})
