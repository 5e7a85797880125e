#!/usr/bin/env bash
# The sweeps of docs/performance.md, on 2 ranks, against every CPU peer (MPI, gloo, oneCCL, DeepSpeed), with
# the memory bound, float32 sum, 8 B - 64 MiB, each size the best of 3 rounds of ours and every
# peer in turn, each timed for at least 50 ms (-T), every result checked (-c 1):
# all-reduce idle, beside one busy process per core (--contention), and on buffers from
# Communicator.empty (--shared: every rank's memory mapped by the others; the peers get the
# same buffers); all-gather, reduce-scatter and broadcast on plain arrays and on shared
# buffers. Writes the tables, JSON and plots under benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
R=benchmarks/results
mkdir -p $R
PEERS=mpi,gloo,oneccl,deepspeed
sweep() {  # name, then pycoll-bench's arguments
    local name=$1
    shift
    "$BIN/mpiexec" -n 2 "$BIN/python" -m pycollectives.bench "$@" -c 1 --rounds 3 -T 0.05 \
        --compare $PEERS --json $R/$name.json --plot $R/$name.png | tee $R/$name.txt
}
sweep bench-all_reduce-2ranks all_reduce -b 8 -e 64M -f 2 -n 20 -w 5
sweep bench-all_reduce-shared-2ranks all_reduce -b 8 -e 64M -f 4 -n 20 -w 5 --shared
sweep bench-all_reduce-contention-2ranks all_reduce -b 8 -e 64M -f 4 -n 20 -w 5 --contention
for coll in all_gather reduce_scatter broadcast; do
    sweep bench-$coll-2ranks $coll -b 8 -e 64M -f 4 -n 20 -w 5
    sweep bench-$coll-shared-2ranks $coll -b 8 -e 64M -f 4 -n 20 -w 5 --shared
done
