import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

_STARTED = {}


def pytest_sessionstart(session):
    import time

    _STARTED["at"] = time.time()


def pytest_sessionfinish(session, exitstatus):
    from harness.pool import POOLS

    POOLS.close()
    # Ranks the fault tests kill leave MPICH's segments behind; remove those of this run that
    # no process maps any more (as pycollectives.launch does after a failed job).
    from pycollectives.launch import remove_orphaned_shm

    if "at" in _STARTED:
        remove_orphaned_shm(_STARTED["at"])
