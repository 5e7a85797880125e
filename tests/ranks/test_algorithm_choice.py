"""algorithm=None: chosen from the tuning table, identically on every rank; PYCOLL_ALGO forces
an algorithm where it exists; PYCOLL_DEBUG=INFO logs every choice and why."""

import re
from collections import defaultdict

from harness.launch import run_mpi

LOG = re.compile(r"rank (\d+)/(\d+): (\w+) #(\d+) .* algo=(\w+) \(([^)]*)\)")
REASONS = {"asked", "PYCOLL_ALGO", "single copy", "tuning table", "default"}


def logged_choices(stderr):
    """{seq: {rank: (collective, algorithm, automatic?)}}; every reason one of REASONS."""
    by_seq = defaultdict(dict)
    for m in LOG.finditer(stderr):
        rank, _, coll, seq, algo, why = m.groups()
        assert why in REASONS, why
        by_seq[int(seq)][int(rank)] = (coll, algo, why != "asked")
    return by_seq


def logged_reasons(stderr):
    return {(m.group(3), m.group(6)) for m in LOG.finditer(stderr)}


def test_every_rank_logs_the_same_choice():
    _, err = run_mpi(3, "algorithm_choice.py", env={"PYCOLL_DEBUG": "INFO"}, with_stderr=True)
    by_seq = logged_choices(err)
    assert len(by_seq) == 10, err[-2000:]
    for seq, ranks in by_seq.items():
        assert set(ranks) == {0, 1, 2}, (seq, ranks)
        assert len(set(ranks.values())) == 1, f"ranks disagree on #{seq}: {ranks}"
    assert by_seq[10][0] == ("all_reduce", "ring", False)  # explicit choice, not auto
    assert "algorithm thresholds for 3 ranks: the shipped table" in err  # the suite's setting


def test_pycoll_algo_forces_where_available():
    out, err = run_mpi(
        2,
        "algorithm_choice.py",
        env={"PYCOLL_DEBUG": "INFO", "PYCOLL_ALGO": "tree"},
        with_stderr=True,
    )
    assert "choice all_reduce tree" in out and "choice broadcast tree" in out
    # all_gather has no tree schedule: the tuning table decides.
    assert "choice all_gather tree" not in out
    algos = {v[0]: v[1] for ranks in logged_choices(err).values() for v in ranks.values()}
    assert algos["broadcast"] == "tree"
    why = logged_reasons(err)
    assert ("broadcast", "PYCOLL_ALGO") in why, why
    assert ("all_gather", "PYCOLL_ALGO") not in why, why


def test_thresholds_measured_at_first_use_are_every_ranks(tmp_path):
    # PYCOLL_TUNING=auto (the default; the suite runs on the shipped table): the first
    # communicator measures and caches, the next reads rank 0's cache (workers/host_tuning.py).
    out = run_mpi(3, "host_tuning.py", str(tmp_path))
    assert "host tuning ok 3" in out
