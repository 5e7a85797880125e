"""The torch backend's C++ half is built where torch is."""

from __future__ import annotations


def test_the_cpp_backend_is_built_where_torch_is():
    # make test builds against the installed torch; without the C++ half the backend would
    # still work, through Python, and nothing else would notice.
    from pycollectives import _torch  # noqa: F401
