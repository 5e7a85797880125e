"""How deep one small call goes before it reaches the native code: Python frames of the package
entered and crossings into its native modules, for an 8 B all-reduce on a numpy array and on a
cupy array (the CUDA module and cupy stood in for, as benchmarks/gpu_python_cost.py does: no
GPU needed; the blocking cupy call's one-step path reaches the emulated module's NullComm, a
device that checks and records each call). Counted with sys.setprofile over one call after a
warm-up; one process.

    python benchmarks/call_path.py [--show]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_python_cost  # noqa: E402 - found through the line above

NATIVE = ("pycollectives._C", "pycollectives._cuda", "pycollectives._emu", "pycollectives._net")


def _native_owner(fn) -> str | None:
    """The native module a builtin belongs to: a function of it, a method of its types, or a
    function pybind11 made (bound to the capsule that holds its record)."""
    module = getattr(fn, "__module__", None)
    if module in NATIVE:
        return module
    owner = type(getattr(fn, "__self__", None))
    if owner.__name__ == "PyCapsule":
        return "native"
    module = getattr(owner, "__module__", None)
    return module if module in NATIVE else None


def trace(call, stand_in_file: str | None = None):
    """(package frames, native crossings) of `call()`: the package's Python functions entered,
    and calls into a native module (or into the stand-in for one, defined in `stand_in_file`)."""
    package = os.path.dirname(os.path.abspath(sys.modules["pycollectives"].__file__))
    frames, crossings = [], []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call":
            path = os.path.abspath(code.co_filename)
            if stand_in_file and path == stand_in_file and frame.f_back is not None:
                caller = os.path.abspath(frame.f_back.f_code.co_filename)
                if caller.startswith(package):  # the package calling its native module
                    crossings.append(code.co_qualname)
            elif path.startswith(package):
                frames.append(f"{os.path.relpath(path, package)}:{code.co_qualname}")
        elif event == "c_call":
            owner = _native_owner(arg)
            if owner is not None:
                crossings.append(f"{owner}.{getattr(arg, '__name__', arg)}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return frames, crossings


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", action="store_true", help="list the frames and crossings")
    args = ap.parse_args()
    cupy = gpu_python_cost.install_stand_ins()
    import numpy as np
    from mpi4py import MPI

    import pycollectives as pc

    comm = pc.Communicator(MPI.COMM_SELF)
    x = np.ones(2, np.float32)
    g, g_out = cupy.ndarray(1 << 40, 2), cupy.ndarray((1 << 40) + 4096, 2)
    cases = (
        ("numpy all_reduce(x)", lambda: comm.all_reduce(x), None),
        ("cupy all_reduce(x, out)", lambda: comm.all_reduce(g, g_out),
         os.path.abspath(gpu_python_cost.__file__)),
    )  # fmt: skip
    print("# one 8 B call after a warm-up: the package's Python frames, crossings into native code")
    for name, fn, stand_in in cases:
        for _ in range(3):
            fn()
        frames, crossings = trace(fn, stand_in)
        print(f"{name:26s} {len(frames):3d} frames {len(crossings):3d} crossings")
        if args.show:
            for f in frames:
                print(f"    {f}")
            for c in crossings:
                print(f"  > {c}")
    comm.close()


if __name__ == "__main__":
    main()
