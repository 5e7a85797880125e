"""Pipeline parallelism (GPipe, 1F1B) against one process's training, and its helpers."""

import pytest
from harness.launch import ONE_NODE_AND_TWO, run_mpi

ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@ONE_NODE_AND_TWO
def test_pipeline_matches_one_process(nranks, nodes):
    """Both schedules: gradients of one step, several optimizer steps, and bad input; on one
    node and on two (every other stage boundary crosses MPI)."""
    run_mpi(nranks, "pipeline.py", timeout=120, env={**ONE_BLAS_THREAD, **nodes})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_example(schedule):
    out = run_mpi(2, "run_module.py", "pycollectives.examples.pipeline", "--schedule", schedule,
                  "--steps", "8", timeout=120)  # fmt: skip
    assert "matches single-process training: yes" in out, out
    assert "bubble fraction: measured" in out and "theoretical (p-1)/(m+p-1) = 0.11" in out, out
