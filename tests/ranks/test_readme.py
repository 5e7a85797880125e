"""The README's code runs as written: every ```python block, as a user would copy it into a
file, under mpiexec on the number of ranks its first line names (``# mpiexec -n N python
...``; one process otherwise). Blocks for a GPU (cupy) or torch skip where those are missing."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from harness.launch import run_mpi

README = Path(__file__).resolve().parents[2] / "README.md"
LAUNCH = re.compile(r"#\s*mpiexec -n (\d+) python")


def python_blocks() -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block."""
    blocks, code, start = [], None, 0
    for i, line in enumerate(README.read_text().splitlines(), 1):
        stripped = line.strip()
        if code is None and stripped == "```python":
            code, start = [], i
        elif code is not None and stripped == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5, BLOCKS


def _param(line, code):
    marks = [pytest.mark.gpu] if "import cupy" in code else []
    return pytest.param(line, code, id=f"line{line}", marks=marks)


@pytest.mark.parametrize("line,code", [_param(line, code) for line, code in BLOCKS])
def test_readme_block_runs(line, code, tmp_path):
    if "import cupy" in code:
        from pycollectives.backends.cuda.env import cuda_available

        if not cuda_available()[0]:
            pytest.skip("needs a GPU")
    if "torch" in code and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    first = code.splitlines()[0]
    launch = LAUNCH.match(first)
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    run_mpi(int(launch.group(1)) if launch else 1, str(script), timeout=180)
