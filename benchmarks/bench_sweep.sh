#!/usr/bin/env bash
# The README's sweep: all-reduce float32 on 2 ranks, 8 B - 64 MiB, against MPI and gloo, with
# the memory bound; writes the table, JSON and plot under benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
mkdir -p benchmarks/results
"$BIN/mpiexec" -n 2 "$BIN/python" -m pycollectives.bench all_reduce -b 8 -e 64M -f 4 -n 50 -w 10 \
    -c 1 --compare mpi,gloo --json benchmarks/results/bench-all_reduce-2ranks.json \
    --plot benchmarks/results/bench-all_reduce-2ranks.png | tee benchmarks/results/bench-all_reduce-2ranks.txt
