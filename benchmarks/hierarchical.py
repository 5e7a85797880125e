"""All-reduce over several nodes: hierarchical vs flat ring vs MPI_Allreduce, same run.

    PYCOLL_RANKS_PER_NODE=2 mpiexec -n 4 python benchmarks/hierarchical.py [--json FILE]

With PYCOLL_RANKS_PER_NODE the machine is split into emulated nodes; "inter-node" messages
then travel through MPI's own shared-memory path, so this measures the algorithms and our
MPI transport, not a network. Columns: hierarchical (shared memory inside a node, one shard
per rank between nodes), flat ring (the ring schedule over all ranks, every link an MPI
message), and MPI_Allreduce. Time = slowest rank's mean per call, best of --rounds batches;
busbw = bytes / time * 2(n-1)/n, as nccl-tests.
"""

from __future__ import annotations

from functools import partial

from mpi4py import MPI

import pycollectives as pc
from pycollectives.bench.formulas import bus_factor
from pycollectives.bench.scripts import float32_sizes, machine, sweep_options, write_json
from pycollectives.bench.timing import best_per_call


def main():
    args = sweep_options(__doc__.splitlines()[0], rounds=3)

    mpi = MPI.COMM_WORLD
    n = mpi.Get_size()
    comm = pc.Communicator(mpi)
    topo = comm.topology
    factor = bus_factor("all_reduce", n)
    rows = []
    if comm.rank == 0:
        print(
            f"# all_reduce float32 sum, {n} ranks on {topo.num_nodes} nodes ({topo.describe()}), "
            f"{', '.join(machine().values())}"
        )
        print(
            f"# {'bytes':>10} {'hier us':>10} {'ring us':>10} {'mpi us':>10} {'hier busbw':>11} "
            f"{'ring busbw':>11} {'mpi busbw':>10} {'vs ring':>8} {'vs mpi':>7}"
        )
    sizes = float32_sizes(args.min_bytes, args.max_bytes, 4, 64 << 20, 3, 5000)
    for nbytes, x, out, iters in sizes:
        hier = partial(comm.all_reduce, x, out)
        ring = partial(comm.all_reduce, x, out, algorithm="ring")
        theirs = partial(mpi.Allreduce, x, out)
        best = best_per_call(mpi, (hier, ring, theirs), iters, args.rounds, min(iters, 20))
        row = {"bytes": nbytes}
        for name, t in zip(("hier", "ring", "mpi"), best):
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_busbw_GBs"] = nbytes / t / 1e9 * factor
        rows.append(row)
        if comm.rank == 0:
            print(
                f"  {nbytes:>10} {row['hier_us']:>10.1f} {row['ring_us']:>10.1f} "
                f"{row['mpi_us']:>10.1f} {row['hier_busbw_GBs']:>11.2f} "
                f"{row['ring_busbw_GBs']:>11.2f} {row['mpi_busbw_GBs']:>10.2f} "
                f"{best[1] / best[0]:>7.2f}x {best[2] / best[0]:>6.2f}x",
                flush=True,
            )
    if comm.rank == 0 and args.json:
        write_json(args.json, {"ranks": n, "nodes": topo.nodes, "rows": rows})
    comm.close()


if __name__ == "__main__":
    main()
