"""gdb script (gdb -batch -x gdb_follow.py --args python worker.py): follows one collective's
call descriptor from HostComm::execute until it returns, line by line, and writes the files the
descriptor was in, in order, to $CALLPATH_OUT (JSON). See tools/callpath/README.md."""

import json
import os

import gdb

CARRIED = ("pycoll::CollectiveCall", "pycoll::ResolvedCall")  # what "the call" is, as it goes
SOURCE = os.environ.get("CALLPATH_SOURCE", "/csrc/")
FIRST_SEQ = int(os.environ.get("CALLPATH_SEQ", "5"))
MAX_STEPS = 200_000

for command in (
    "set pagination off",
    "set confirm off",
    "set breakpoint pending on",
    "set print thread-events off",
    "skip -gfi /usr/include/*",
    "skip -gfi /usr/include/*/*",
    "skip -gfi /usr/include/*/*/*",
    "skip -gfi /usr/include/*/*/*/*",
    "skip -gfi */pybind11/*",
    "handle SIGUSR1 SIGUSR2 SIGPIPE nostop noprint pass",
):
    gdb.execute(command, to_string=True)


def is_call(t) -> bool:
    """Whether `t` is the call (a CollectiveCall, one derived from it, or a ResolvedCall), or a
    reference or pointer to it."""
    t = t.strip_typedefs()
    while t.code in (gdb.TYPE_CODE_PTR, gdb.TYPE_CODE_REF, gdb.TYPE_CODE_RVALUE_REF):
        t = t.target().strip_typedefs()
    if t.code != gdb.TYPE_CODE_STRUCT:
        return False
    if str(t.unqualified()) in CARRIED:
        return True
    return any(f.is_base_class and is_call(f.type) for f in t.fields())


def mentions_call(t, depth=0) -> bool:
    """Whether an argument of type `t` is the call, or (`this`, one level down) an object that
    holds it in a field of its own."""
    try:
        if is_call(t):
            return True
        if depth == 0:
            t = t.strip_typedefs()
            while t.code in (gdb.TYPE_CODE_PTR, gdb.TYPE_CODE_REF, gdb.TYPE_CODE_RVALUE_REF):
                t = t.target().strip_typedefs()
            if t.code == gdb.TYPE_CODE_STRUCT:
                return any(f.type is not None and is_call(f.type) for f in t.fields())
    except gdb.error:
        pass
    return False


_carries = {}


def carries(frame) -> bool:
    """Whether the function of `frame` has the call in hand: an argument (`this` included)
    that is, points to or holds it."""
    fn = frame.function()
    if fn is None:
        return False
    key = fn.symtab.filename + ":" + fn.print_name
    if key not in _carries:
        found = False
        try:
            block = frame.block()
            while block is not None and block.function is None:
                block = block.superblock
            for sym in block or ():
                if sym.is_argument and mentions_call(sym.type):
                    found = True
                    break
        except RuntimeError:
            pass
        _carries[key] = found
    return _carries[key]


bp = gdb.Breakpoint("pycoll::HostComm::execute")
gdb.execute("run", to_string=True)
while int(gdb.parse_and_eval("seq")) < FIRST_SEQ:  # the calls before are warm-ups
    gdb.execute("continue", to_string=True)
bp.delete()
top = gdb.selected_frame()
where = []  # (file, function) of the innermost frame holding the call, at each line
steps = 0
while steps < MAX_STEPS:
    gdb.execute("step", to_string=True)
    steps += 1
    try:
        f = gdb.selected_frame()
    except gdb.error:
        break
    g, inside = f, False
    while g is not None:
        if g == top:
            inside = True
            break
        g = g.older()
    if not inside:
        break  # execute returned
    # A function without the call cannot hand it on: run it to its end (its lines, a copy
    # loop's say, are not the call's way).
    if f != top and not carries(f):
        gdb.execute("finish", to_string=True)
        continue
    sal = f.find_sal()
    path = sal.symtab.fullname() if sal.symtab else ""
    if SOURCE in path:
        entry = (path.split(SOURCE, 1)[1], f.function().print_name)
        if not where or where[-1] != entry:
            where.append(entry)
with open(os.environ["CALLPATH_OUT"], "w") as out:
    json.dump({"steps": steps, "where": where}, out, indent=0)
gdb.execute("continue", to_string=True)
