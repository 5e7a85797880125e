"""Jobs in a /dev/shm of a container's size: a private tmpfs on /dev/shm in a mount namespace
of their own (as root can), the job under mpiexec inside it (workers/small_shm.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from harness.launch import mpiexec, with_harness, worker_path

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (a tmpfs on /dev/shm in a mount namespace)",
)


def in_small_shm(size: str, nprocs: int, what: str, doctor: bool = False) -> str:
    """The job's output; with `doctor`, the doctor's verdict on /dev/shm before it (one line
    of JSON starting "doctor:")."""
    job = f"{mpiexec()} -n {nprocs} {sys.executable} {worker_path('small_shm.py')} {what}"
    if doctor:
        ask = "from pycollectives import doctor; import json; "
        ask += f"print('doctor:', json.dumps(doctor.check_shm({nprocs})._asdict()))"
        job = f'{sys.executable} -c "{ask}" && {job}'
    script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && {job}"
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    env = with_harness(dict(os.environ, PYCOLL_TIMEOUT="60"))
    env.pop("PYCOLL_STAGING_BYTES", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def slots(out: str) -> set:
    return {int(line.split()[-1]) for line in out.splitlines() if " slot " in line}


@pytest.mark.parametrize(
    "size,nprocs,slot",
    [("24m", 2, 256 << 10), ("32m", 4, 64 << 10), ("64m", 8, 32 << 10)],
    ids=["2-ranks-24m", "4-ranks-32m", "8-ranks-64m"],
)
def test_ranks_fit_a_small_dev_shm(size, nprocs, slot):
    # 64 MB is a container's default: MPICH takes about 42 MB of it for 8 ranks, and ours
    # would need 135 MB with 256 KiB slots. The default slot stays wherever it fits.
    out = in_small_shm(size, nprocs, "fits", doctor=True)
    assert slots(out) == {slot}, out  # the same on every rank
    verdict = json.loads(out.split("doctor: ", 1)[1].splitlines()[0])  # as predicted
    if slot == 256 << 10:
        assert verdict["level"] == "ok", verdict
    else:
        assert verdict["level"] == "warn" and f"{slot >> 10} KiB staging" in verdict["found"]
    notice = [line for line in out.splitlines() if line.startswith("pycollectives: /dev/shm")]
    if slot == 256 << 10:
        assert notice == [], out
    else:
        assert len(notice) == 1, out
        assert f"staging slots of {slot >> 10} KiB instead of 256 KiB" in notice[0], out


def test_below_every_footprint_each_rank_raises_the_same_error():
    out = in_small_shm("64m", 8, "refused")  # 4 MiB left once MPICH has started
    assert "refused: not enough shared memory for 8 ranks" in out, out
