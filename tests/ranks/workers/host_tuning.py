"""Algorithm thresholds measured at first use (backends/host_tuning.py): rank 0's cache is
every rank's, a second communicator reads it without measuring, the user's communicator never
sees the probe's calls, PYCOLL_TUNING=calibrate measures again.

    host_tuning.py CACHE_DIR
"""

import glob
import json
import os
import sys

import numpy as np
from checks import run_main
from mpi4py import MPI

import pycollectives as pc
from pycollectives.backends import host_tuning
from pycollectives.backends.host_tuning import CHOSEN, UNBOUNDED
from pycollectives.ops import ALGORITHMS_FOR

SIZES = (8, 512, 4096, 32768, 1 << 20, 1 << 26)


def choices(comm):
    return [(c, s, comm.algorithm_for(c, s)) for c in CHOSEN for s in SIZES]


def no_probe(*args, **kwargs):
    raise AssertionError("measured again although a calibration was cached")


def main():
    world = MPI.COMM_WORLD
    cache = sys.argv[1]
    # Only rank 0's cache counts: the others look in a folder of their own, which stays empty.
    own = cache if world.rank == 0 else os.path.join(cache, f"rank{world.rank}")
    os.environ.update(PYCOLL_TUNING="auto", PYCOLL_CACHE_DIR=own)
    with pc.Communicator() as comm:
        assert comm.seq == 0, f"the probe's calls reached the user's communicator: {comm.seq}"
        x = np.arange(1000, dtype=np.float32)
        comm.all_reduce(x)
        np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32) * comm.size)
        first = choices(comm)
    assert world.allgather(first) == [first] * world.size, "ranks choose differently"
    files = world.bcast(sorted(glob.glob(os.path.join(cache, "*.json"))))
    assert len(files) == 1, files
    if world.rank != 0:
        assert not os.path.exists(own) or not os.listdir(own), "a rank other than 0 wrote"
    with open(files[0]) as f:
        saved = json.load(f)
    assert saved["key"]["ranks"] == world.size
    rules = [tuple(r) for r in saved["rules"]]
    want = [(c, s, host_tuning.table_choice(rules, c, world.size, s)) for c, s, _ in first]
    assert first == want, (first, want)

    # A second communicator reads rank 0's cache: rules written there (tree where it exists)
    # reach every rank, and nothing is measured.
    world.Barrier()  # every rank has read the file
    if world.rank == 0:
        tree_or_direct = {c: "tree" if "tree" in ALGORITHMS_FOR[c] else "direct" for c in CHOSEN}
        saved["rules"] = [
            [c, world.size, world.size, UNBOUNDED, a] for c, a in tree_or_direct.items()
        ]
        with open(files[0], "w") as f:
            json.dump(saved, f)
    world.Barrier()
    measure, host_tuning.probe = host_tuning.probe, no_probe
    try:
        with pc.Communicator() as comm:
            assert comm.algorithm_for("all_reduce", 1 << 20) == "tree"
            assert comm.algorithm_for("broadcast", 8) == "tree"
            assert comm.algorithm_for("all_gather", 8) == "direct"
    finally:
        host_tuning.probe = measure

    # PYCOLL_TUNING=calibrate measures again and replaces what was cached.
    os.environ["PYCOLL_TUNING"] = "calibrate"
    with pc.Communicator() as comm:
        again = choices(comm)
    world.Barrier()
    with open(files[0]) as f:
        rewritten = json.load(f)
    assert rewritten["measured"] != saved["measured"], "PYCOLL_TUNING=calibrate measured nothing"
    rules = [tuple(r) for r in rewritten["rules"]]
    assert again == [(c, s, host_tuning.table_choice(rules, c, world.size, s)) for c, s, _ in again]

    # Under PYCOLL_REPRODUCIBLE=1 the probe still times each algorithm it asks for: its
    # communicator is not reproducible, which would run every reduction in rank order (and
    # cache those times for every later job, reproducible or not).
    os.environ["PYCOLL_REPRODUCIBLE"] = "1"
    asked = []

    def probe_as_asked(host, *args, **kwargs):
        asked.append(host.choose("all_reduce", 1 << 20))  # no rules there: ring, unless reordered
        return measure(host, *args, **kwargs)

    host_tuning.probe = probe_as_asked
    try:
        pc.Communicator().close()
    finally:
        host_tuning.probe = measure
    assert asked == ["ring"], asked
    print("host tuning ok", world.size)


if __name__ == "__main__":
    run_main(main)
