import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness.pool import POOL_ENV  # noqa: E402 - found through the line above

# The rank pools' environment in every process the suite starts: one BLAS thread (ranks
# outnumber the cores, and OpenBLAS's idle threads spin after each call: 1.7% of the suite's
# CPU, in own-job workers, before this) and a malloc that keeps freed arrays (see pool.py).
for _name, _value in POOL_ENV.items():
    os.environ.setdefault(_name, _value)

_STARTED = {}


def pytest_sessionstart(session):
    import time

    _STARTED["at"] = time.time()


def pytest_sessionfinish(session, exitstatus):
    from harness.launch import close_zygote
    from harness.netns import close_shared
    from harness.pool import POOLS

    POOLS.close()
    close_zygote()
    close_shared()
    # Ranks the fault tests kill leave MPICH's segments behind; remove those of this run that
    # no process maps any more (as pycollectives.launch does after a failed job).
    from pycollectives.launch import remove_orphaned_shm

    if "at" in _STARTED:
        remove_orphaned_shm(_STARTED["at"])
