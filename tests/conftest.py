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

# Bytecode written, where the environment says PYTHONDONTWRITEBYTECODE=1: each of the suite's
# 550 processes otherwise compiles the package and the workers it imports anew (0.06 s of CPU
# each). It goes where Python puts it by default, the checkout's __pycache__ folders (ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The host's algorithm thresholds from the table shipped with the package, not measured on first
# use (backends/host_tuning.py): which algorithm a call takes then does not depend on what a
# probe measured on a loaded machine, and no job pays for a probe. The tests of the
# measurement (test_algorithm_choice.py) ask for it.
os.environ.setdefault("PYCOLL_TUNING", "shipped")

# Flight records (pycollectives.trace.flight) of the communicators the tests fail on purpose go
# to a folder of this run's, removed at its end, not to $TMPDIR/pycollectives-flight.
if "PYCOLL_FLIGHT_DIR" not in os.environ:
    import tempfile

    os.environ["PYCOLL_FLIGHT_DIR"] = _FLIGHT_DIR = tempfile.mkdtemp(prefix="pycoll-flight-")
else:
    _FLIGHT_DIR = None

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
    if _FLIGHT_DIR is not None:
        import shutil

        shutil.rmtree(_FLIGHT_DIR, ignore_errors=True)
