"""Where GradientBucketer's buckets come from: the communicator's memory, shared on the host and
registered on the GPU, so that their all-reduces take the paths that read peers' buffers."""

from __future__ import annotations

import types

import numpy as np

from pycollectives.parallel.data.bucketer import GradientBucketer


class RecordingComm:
    """The part of a Communicator the bucketer allocates through; records each allocation."""

    def __init__(self):
        self.calls = []

    def zeros(self, shape, dtype=np.float32, device=None):
        self.calls.append((shape, np.dtype(dtype), device))
        return np.zeros(shape, dtype)


def fake_cupy(device_id):
    """A stand-in for cupy (its name, zeros, and the current device's id); numpy arrays."""
    module = types.ModuleType("cupy")
    module.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype)
    module.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=device_id))
    return module


SHAPES = [((1000,), np.float32), ((300, 4), np.float32), ((50,), np.float64)]


def test_gpu_buckets_are_registered_memory_on_the_current_gpu():
    comm = RecordingComm()
    b = GradientBucketer(comm, SHAPES, bucket_cap_mb=0.004, first_bucket_mb=0.004,
                         array_module=fake_cupy(3))  # fmt: skip
    assert len(b.buckets) >= 2
    assert [(c[0], c[1]) for c in comm.calls] == [(k.size, k.dtype) for k in b.buckets]
    assert all(device == 3 for _, _, device in comm.calls), comm.calls


def test_host_buckets_are_shared_memory():
    comm = RecordingComm()
    b = GradientBucketer(comm, SHAPES)
    assert len(comm.calls) == len(b.buckets)
    assert all(device is None for _, _, device in comm.calls), comm.calls


def test_without_the_communicators_memory_plain_arrays():
    b = GradientBucketer(object(), SHAPES, array_module=fake_cupy(0))
    assert all(isinstance(k.buffer, np.ndarray) for k in b.buckets)
