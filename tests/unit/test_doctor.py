"""python -m pycollectives.doctor: each check's verdict, the /dev/shm arithmetic by hand, the
exit status."""

from __future__ import annotations

import json
import subprocess
import sys

from pycollectives import _C, doctor

MIB = 1 << 20


def test_the_command_runs_and_this_machine_can_start_a_job():
    cmd = [sys.executable, "-m", "pycollectives.doctor", "-n", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {f["check"]: f for f in json.loads(proc.stdout)}
    assert {"mpi", "cma", "shm", "cpus", "gpu", "torch", "emulated"} <= set(checks), checks
    assert checks["cma"]["level"] == "ok", checks["cma"]  # root here: permitted


def test_shm_need_by_hand():
    # 8 ranks, 256 KiB slots, 4 per channel: 16,832,512 bytes a rank (the segment's layout:
    # a page of header, flag lines, fingerprints, board slots, 8 channels of 4 slots, p2p
    # request and data rings), 134.7 MB for 8, and MPICH's 42 MiB besides.
    assert _C.segment_bytes(8, 256 << 10, 4) == 16_832_512
    assert doctor.MPI_SHM_PER_RANK * 8 == 42 * MIB
    need = 8 * 16_832_512 + 42 * MIB
    assert doctor.check_shm(8, free=int(need / 0.75) + 42 * MIB).level == "ok"


def test_shm_verdicts_for_a_containers_64_mib():
    # 64 MiB - 42 MiB of MPICH's = 22 MiB; 3/4 of it holds 8 ranks' 32 KiB slots (17.2 MB),
    # as the 8-rank job in a 64 MiB tmpfs found (tests/ranks/test_small_shm.py).
    f = doctor.check_shm(8, free=64 * MIB)
    assert f.level == "warn" and "32 KiB staging slots" in f.found, f
    f = doctor.check_shm(8, free=48 * MIB)
    assert f.level == "FAIL" and "not even 16 KiB" in f.found and "--shm-size" in f.fix, f
    f = doctor.check_shm(8, free=40 * MIB)
    assert f.level == "FAIL" and "MPICH itself will not fit" in f.found, f
    assert doctor.check_shm(8, free=40 * MIB, mpi=False).level == "warn"


def test_the_exit_status_says_whether_a_job_can_start(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "check_shm", lambda n: doctor.Finding("shm", "FAIL", "none"))
    assert doctor.main(["-n", "2"]) == 1
    assert "a job of 2 ranks cannot start" in capsys.readouterr().out
    monkeypatch.setattr(doctor, "check_shm", lambda n: doctor.Finding("shm", "ok", "plenty"))
    assert doctor.main(["-n", "2"]) == 0


def test_a_setting_that_does_not_parse_is_a_failure_naming_it(monkeypatch):
    monkeypatch.setenv("PYCOLL_STAGING_SLOTS", "99")
    f = doctor.check_shm(2)
    assert f.level == "FAIL" and "staging_slots" in f.found and "PYCOLL_" in f.fix, f
