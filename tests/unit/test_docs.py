"""The documentation builds (Sphinx, warnings as errors, as `make docs` builds it) and its API
reference documents every public name of pycollectives, pycollectives.parallel and
pycollectives.torch. The pages' code is run by tests/ranks/test_readme.py."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# pycollectives.torch has no __all__: its documented public names (its docstring, the guide).
TORCH_PUBLIC = ["BACKEND", "DistributedDataParallel", "GradBucket", "communicator",
                "init_process_group"]  # fmt: skip
MODULES = ["pycollectives", "pycollectives.parallel", "pycollectives.torch"]


def needs(module: str, why: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({why}; `make test` installs it)")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The HTML build, made once for the tests of this file."""
    needs("sphinx", "the documentation is built with Sphinx")
    needs("myst_parser", "the pages are Markdown, read by myst-parser")
    needs("torch", "the API reference imports pycollectives.torch")
    out = tmp_path_factory.mktemp("html")
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going",
           "-d", str(out / ".doctrees"), str(DOCS), str(out)]  # fmt: skip
    # From the output folder: no folder on the path shadows the installed package.
    done = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"sphinx-build failed:\n{done.stdout}\n{done.stderr}"
    return out


def inventory(path: Path) -> dict[str, str]:
    """objects.inv (Sphinx's inventory, version 2): {name: domain:role}."""
    data = path.read_bytes()
    lines = data.split(b"\n", 4)
    assert lines[0] == b"# Sphinx inventory version 2", lines[0]
    names = {}
    for line in zlib.decompress(lines[4]).decode().splitlines():
        name, role = line.split(" ", 2)[:2]
        names[name] = role
    return names


def public_names(module: str) -> list[str]:
    """`module.__all__`, read from its source (importing pycollectives.torch takes seconds)."""
    source = Path(importlib.util.find_spec(module).origin)
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    assert module == "pycollectives.torch", f"{module} has no __all__"
    return TORCH_PUBLIC


def test_the_docs_build_without_warnings(built):
    for page in ["index", "api", "performance", "architecture", "guide/communicator"]:
        assert (built / f"{page}.html").is_file(), page


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_documented(built, module):
    documented = inventory(built / "objects.inv")
    py = {name for name, role in documented.items() if role.startswith("py:")}
    missing = [n for n in public_names(module) if f"{module}.{n}" not in py]
    assert not missing, f"{module}: not in the API reference (docs/api.md): {missing}"
