"""Microbenchmarks in the style of nccl-tests: ``python -m pycollectives.bench --help``."""
