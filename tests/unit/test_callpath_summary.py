"""tools/callpath/summary.py's counts, by hand."""

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "tools" / "callpath" / "summary.py"


def test_stays_returns_descents_by_hand():
    spec = importlib.util.spec_from_file_location("callpath_summary", PATH)
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    f = "fn"
    where = [("host/a.cpp", f), ("host/a.cpp", "g"), ("algo/call.h", f), ("host/a.cpp", f),
             ("runtime/w.h", f), ("host/b.cpp", f), ("host/a.cpp", f)]  # fmt: skip
    stays, returns, descents = summary.summary(where)
    # Two lines in a.cpp are one stay; a.cpp is left and come back to twice (returns), call.h
    # and w.h lie below host (descents); b.cpp is host too.
    assert stays == ["host/a.cpp", "algo/call.h", "host/a.cpp", "runtime/w.h", "host/b.cpp",
                     "host/a.cpp"]  # fmt: skip
    assert returns == 2
    assert descents == 2
