"""What a rank's death costs: the elastic path (survivors shrink and go on, a replacement
joins) against the restart path (the whole job again from its checkpoint), on N ranks.

    python benchmarks/elastic_recovery.py [-n 4] [--repeat 3]

Elastic: ``python -m pycollectives.launch -n N --elastic --replace 1 --
python -m pycollectives.examples.elastic --fail-rank 2 --fail-at-step 40 --full-size-by 60``,
which prints the time from the death (the dying rank writes the time just before it kills
itself) to the survivors' next completed step, and how long after its process started the
replacement was taken in. Restart: ``python -m pycollectives.launch -n N --max-restarts 1 --
python -m pycollectives.examples.train --fail-rank 2 --fail-at-step 40`` against the same job
undisturbed; the cost of the death is the difference of their wall times. Medians of
`--repeat` runs, each job's wall time as the user waits for it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time

LAUNCH = [sys.executable, "-m", "pycollectives.launch"]


def timed(cmd: list) -> tuple[float, str]:
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return took, done.stdout + done.stderr


def elastic(n: int, fail: bool) -> tuple[float, float | None, float | None]:
    """(wall s, death -> next completed step ms, replacement taken in s after it started)."""
    args = ["--steps", "120"]
    if fail:
        args += ["--fail-rank", "2", "--fail-at-step", "40", "--full-size-by", "60"]
    cmd = [*LAUNCH, "-n", str(n), "--elastic", "--replace", "1" if fail else "0", "--",
           sys.executable, "-m", "pycollectives.examples.elastic", *args]  # fmt: skip
    wall, out = timed(cmd)
    if not fail:
        return wall, None, None
    ms = re.search(r"done on \d+ ranks ([0-9.]+) ms after the death", out)
    joined = re.search(r"joined at step \d+ as rank \d+ of \d+, ([0-9.]+) s after", out)
    if not ms or not joined:
        sys.exit(f"the elastic run did not report its recovery:\n{out}")
    return wall, float(ms[1]), float(joined[1])


def restart(n: int, fail: bool) -> float:
    with tempfile.TemporaryDirectory() as ckpt:
        args = ["--checkpoint-dir", ckpt, "--device", "cpu"]
        if fail:
            args += ["--fail-rank", "2", "--fail-at-step", "40"]
        cmd = [*LAUNCH, "-n", str(n), "--max-restarts", "1" if fail else "0", "--",
               sys.executable, "-m", "pycollectives.examples.train", *args]  # fmt: skip
        return timed(cmd)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    med = statistics.median
    e_ok = [elastic(a.n, False)[0] for _ in range(a.repeat)]
    e_fail = [elastic(a.n, True) for _ in range(a.repeat)]
    r_ok = [restart(a.n, False) for _ in range(a.repeat)]
    r_fail = [restart(a.n, True) for _ in range(a.repeat)]
    print(f"{a.n} ranks, medians of {a.repeat} runs")
    print("elastic (examples.elastic, 120 steps):")
    print(f"  undisturbed job           {med(e_ok):7.2f} s")
    print(f"  rank 2 killed at step 40  {med(r[0] for r in e_fail):7.2f} s "
          f"(+{med(r[0] for r in e_fail) - med(e_ok):.2f} s)")  # fmt: skip
    print(f"  death -> next completed step  {med(r[1] for r in e_fail):7.1f} ms "
          f"(runs: {', '.join(f'{r[1]:.1f}' for r in e_fail)})")  # fmt: skip
    print(f"  replacement taken in          {med(r[2] for r in e_fail):7.2f} s after it started "
          f"(runs: {', '.join(f'{r[2]:.2f}' for r in e_fail)})")  # fmt: skip
    print("restart (examples.train, checkpoint every epoch, --max-restarts 1):")
    print(f"  undisturbed job           {med(r_ok):7.2f} s")
    print(f"  rank 2 killed at step 40  {med(r_fail):7.2f} s (+{med(r_fail) - med(r_ok):.2f} s)")


if __name__ == "__main__":
    main()
