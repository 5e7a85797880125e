"""The documentation's code runs as written: every ```python block of README.md and of the
pages under docs/, as a user would copy it into a file, under mpiexec on the number of ranks
its first line names (``# mpiexec -n N python ...``; one process otherwise). A block that
appears in two places (the README's torch example is also the torch page's) runs once, under
the name of its first place. Blocks for a GPU (cupy) or torch skip where those are missing."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from harness.launch import run_mpi

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LAUNCH = re.compile(r"#\s*mpiexec -n (\d+) python")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of `path`."""
    blocks, code, start = [], None, 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if code is None and stripped == "```python":
            code, start = [], i
        elif code is not None and stripped == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


def all_blocks() -> list[tuple[str, str]]:
    """(where: file and line, code) of every block, each code once, in the order of PAGES."""
    seen: dict[str, str] = {}
    for page in PAGES:
        if "_build" in page.parts:
            continue
        for line, code in python_blocks(page):
            seen.setdefault(code, f"{page.relative_to(ROOT)}:{line}")
    return [(where, code) for code, where in seen.items()]


BLOCKS = all_blocks()


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 5, BLOCKS
    assert any(where.startswith("README.md:") for where, _ in BLOCKS), BLOCKS
    assert any(where.startswith("docs/") for where, _ in BLOCKS), BLOCKS


def _param(where, code):
    marks = [pytest.mark.gpu] if "import cupy" in code else []
    return pytest.param(code, id=where, marks=marks)


@pytest.mark.parametrize("code", [_param(where, code) for where, code in BLOCKS])
def test_docs_block_runs(code, tmp_path):
    if "import cupy" in code:
        from pycollectives.backends.cuda.env import cuda_available

        if not cuda_available()[0]:
            pytest.skip("needs a GPU")
    if "torch" in code and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    launch = LAUNCH.match(code.splitlines()[0])
    script = tmp_path / "block.py"
    script.write_text(code)
    run_mpi(int(launch.group(1)) if launch else 1, str(script), timeout=180)
