"""The GPU suite's order: the tests of one path or protocol each first, then the collective
matrices (every collective on 2, 3 and 4 ranks, two stagings), 2 ranks first. The kit's gpu
stage (tools/gpu/run.sh) runs last with what time is left, and a suite cut short should have
checked every path once rather than every collective three times. The newest path tests
run after the others."""

from __future__ import annotations

MATRICES = ("test_gpu_collective_matrix", "test_gpu_new_collectives")
# Path tests that have never run on a GPU: after the others, so that one that hangs until its
# bound costs no other path its turn within the kit's time.
NEWEST = ("test_gpu_event_probe", "test_gpu_shapes_past_the_cache_and_replays_between_streams")


def pytest_collection_modifyitems(config, items):
    def key(item):
        if getattr(item, "originalname", None) in NEWEST:
            return (0, 1)
        if getattr(item, "originalname", None) not in MATRICES:
            return (0, 0)
        return (1, item.callspec.params["nranks"])

    items.sort(key=key)  # stable: everything else keeps its order
