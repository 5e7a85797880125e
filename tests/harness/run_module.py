"""Runs `python -m MODULE ARGS...` under mpiexec (workers are launched as scripts)."""

import runpy
import sys

if __name__ == "__main__":
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__")
