"""The soak command: thousands of random collectives, zero wrong elements."""

from harness.launch import run_mpi


def test_soak_2000_random_collectives_on_4_ranks():
    out = run_mpi(4, "run_module.py", "pycollectives.soak", "--iterations", "2000", timeout=300)
    assert "soak: 2000 collectives on 4 ranks" in out, out
    assert "wrong elements: 0, cross-rank differences: 0" in out, out
