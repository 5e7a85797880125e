"""Every collective x algorithm on 1-5 ranks against numpy and MPI references
(see workers/collectives.py)."""

import pytest
from harness.launch import run_mpi

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
RANKS = [1, 2, 3, 4, 5]


# 5 ranks on a 2-core machine take a minute for the five collectives with default slots: 3
# and 4 ranks run the default slots, 5 ranks the small ones (more pieces per call, the same
# schedules).
# 2 ranks with small slots: the quick tier's pass over every collective (make test-quick).
RANKS_STAGING = [
    pytest.param(n, s, marks=[pytest.mark.quick] if (n, s) == (2, "small") else [])
    for n in RANKS
    for s in ("small", "default")
    if (n, s) != (5, "default")
]


# Every (algorithm, in place) variant of every case on 1-4 ranks with small slots and on 3
# with default ones; elsewhere each case runs one variant in turn (PYCOLL_TEST_COVER, see
# workers/collectives.py), every variant still meeting every count and op.
FULL = {(1, "small"), (2, "small"), (3, "small"), (4, "small"), (3, "default")}


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("nranks,staging", RANKS_STAGING)
def test_collective_matrix(nranks, collective, staging):
    # Tiny slots, written with non-temporal stores, and outputs from 1 KiB streamed past the
    # cache; default ones with cached writes.
    small = {"PYCOLL_STREAM_BYTES": "1024", "PYCOLL_SLOT_STORES": "streamed"}
    env = dict(small) if staging == "small" else {}
    if (nranks, staging) not in FULL:
        env["PYCOLL_TEST_COVER"] = "rotate"
    run_mpi(nranks, "collectives.py", collective, staging, env=env)


@pytest.mark.parametrize("nranks", [2, 3])
def test_collective_matrix_over_torch_tensors(nranks):
    # The same test bodies over torch CPU tensors (harness/arrayimpl.py; on a GPU,
    # tests/gpu/test_gpu.py runs them over cupy): every collective in one run, each case one
    # variant in turn.
    out = run_mpi(
        nranks, "collectives.py", ",".join(COLLECTIVES), "small", "--arrays", "torch",
        env={"PYCOLL_TEST_COVER": "rotate"},
    )  # fmt: skip
    assert out.count("arrays=torch") == len(COLLECTIVES), out


@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_twoshot_all_reduce(nranks):
    # Direct all-reduce switches to two-shot above a size; a zero limit makes every size use it.
    run_mpi(
        nranks, "collectives.py", "all_reduce", "small", "direct", env={"PYCOLL_ONESHOT_BYTES": "0"}
    )
