"""ZeRO stages 1-3 against single-process training, on 2 and 4 ranks (numpy)."""

from harness.launch import ONE_NODE_AND_TWO, run_mpi


@ONE_NODE_AND_TWO
def test_zero(nranks, nodes):
    run_mpi(nranks, "zero.py", timeout=180, env=nodes)


def test_zero_example():
    out = run_mpi(2, "run_module.py", "pycollectives.examples.zero", "--steps", "3")
    assert "matches single-process training: yes" in out, out
    assert "per-rank model state:" in out and "= 0.50 of" in out, out
