"""The training job that `make run` launches trains, and its replicas end bit-identical."""

import re

from harness.launch import run_mpi


def test_train_example_learns_and_replicas_agree():
    out = run_mpi(2, "run_module.py", "pycollectives.examples.train", "--epochs", "4")
    acc = float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))
    assert acc > 0.8, out
    assert "replicas bit-identical across 2 ranks: yes" in out


def test_train_relaunches_itself_with_ranks_flag():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pycollectives.examples.train", "--ranks", "2", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "with 2 ranks" in proc.stdout
    assert "replicas bit-identical across 2 ranks: yes" in proc.stdout


def test_torch_ddp_example_trains_on_the_backend():
    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = run_mpi(2, "run_module.py", "pycollectives.examples.torch_ddp", "--epochs", "3")
    m = re.search(r"pycollectives: 2 ranks, \d+ steps .* test accuracy ([0-9.]+)", out)
    assert m and float(m.group(1)) > 0.8, out
    assert "replicas identical: yes" in out, out
