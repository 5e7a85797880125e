"""The GPU suite's order: the tests of one path or protocol each first, then the collective
matrices (every collective on 2, 3 and 4 ranks, two stagings), 2 ranks first. The kit's gpu
stage (tools/gpu/run.sh) runs last with what time is left, and a suite cut short should have
checked every path once rather than every collective three times."""

from __future__ import annotations

MATRICES = ("test_gpu_collective_matrix", "test_gpu_new_collectives")


def pytest_collection_modifyitems(config, items):
    def key(item):
        if getattr(item, "originalname", None) not in MATRICES:
            return (0, 0)
        return (1, item.callspec.params["nranks"])

    items.sort(key=key)  # stable: everything else keeps its order
