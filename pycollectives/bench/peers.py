"""What users would run instead, driven through the same buffers: MPI's own collectives
(mpi4py), torch.distributed over gloo, NCCL. Each returns a callable or the reason it can't."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from pycollectives.ops import ALGORITHMS_FOR, REDUCING

MPI_OPS = ("sum", "prod", "min", "max")


def mpi_runner(mpi, coll, op, root, dt):
    """MPI's collective for (coll, op, dtype), or a reason string."""
    from mpi4py import MPI

    if dt.kind not in "iuf" or dt.itemsize == 2:
        return f"MPI has no {dt.name}"
    if coll in REDUCING and op not in MPI_OPS:
        return f"MPI has no {op}"
    mop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}.get(op, MPI.SUM)

    def run(x, out, in_place):
        if coll == "all_reduce":
            mpi.Allreduce(MPI.IN_PLACE if in_place else x, x if in_place else out, op=mop)
        elif coll == "all_gather":
            mpi.Allgather(MPI.IN_PLACE if in_place else x, out)
        elif coll == "reduce_scatter":
            mpi.Reduce_scatter_block(x, out, op=mop)
        elif coll == "broadcast":
            mpi.Bcast(x, root=root)
        elif coll == "all_to_all":
            mpi.Alltoall(x, out)
        elif coll == "gather":
            mpi.Gather(x, out if mpi.rank == root else None, root=root)
        elif coll == "scatter":
            mpi.Scatter(x if mpi.rank == root else None, out, root=root)
        elif coll == "sendrecv":
            n, r = mpi.size, mpi.rank
            mpi.Sendrecv(x, dest=(r + 1) % n, recvbuf=out, source=(r - 1) % n)
        else:
            inplace_root = in_place and mpi.rank == root
            mpi.Reduce(
                MPI.IN_PLACE if inplace_root else x, x if in_place else out, op=mop, root=root
            )

    return run


def mpi_library() -> str:
    """The first line of the MPI library's version string (e.g. "MPICH Version:  5.0.2")."""
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


class Forced:
    """Our own collectives with one algorithm forced (--compare ring,tree,direct)."""

    reason = None

    def __init__(self, sweep, algorithm):
        self.sweep, self.algorithm = sweep, algorithm
        self.what = f"pycollectives with algorithm={algorithm!r}"

    def runner(self, coll, op, root, dt):
        if self.algorithm not in ALGORITHMS_FOR.get(coll, ()):
            return f"{coll} has no {self.algorithm}"
        return self.sweep.ours(coll, self.algorithm)

    def close(self):
        pass


class Mpi:
    """MPI's own collectives through mpi4py; with --device cuda `staged` (gpu.staged_runner):
    through host memory, as an mpi4py user would write it."""

    reason = None

    def __init__(self, mpi, staged=None):
        self.mpi, self.staged = mpi, staged
        self.what = " ".join(mpi_library().split())
        if staged is not None:
            self.what = f"mpi4py through host memory: copy to host, MPI, copy back ({self.what})"

    def runner(self, coll, op, root, dt):
        return (self.staged or mpi_runner)(self.mpi, coll, op, root, dt)

    def close(self):
        pass


class Gloo:
    """torch.distributed over gloo on the same ranks (file rendezvous)."""

    def __init__(self, mpi):
        self.reason, self.what = None, ""
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            self.reason = "torch is not installed"
            return
        if not dist.is_gloo_available():
            self.reason = "this torch has no gloo"
            return
        self.dist, self.mpi = dist, mpi
        # Gloo's mesh set-up now and then fails with "Connection closed by peer" right after
        # the previous round's group closed; every rank then tries again, on a new file.
        for _ in range(3):
            self.path = mpi.bcast(
                tempfile.mktemp(prefix="pycoll-bench-") if mpi.rank == 0 else None
            )
            error = None
            try:
                dist.init_process_group(
                    "gloo", init_method=f"file://{self.path}", rank=mpi.rank, world_size=mpi.size
                )
            except RuntimeError as e:
                error = str(e).split("\n", 1)[0]
            failed = mpi.allgather(error)
            if not any(failed):
                break
            if error is None:
                dist.destroy_process_group()
            mpi.Barrier()
            if mpi.rank == 0 and os.path.exists(self.path):
                os.unlink(self.path)
        else:
            self.reason = f"gloo set-up failed 3 times: {next(e for e in failed if e)}"
            return
        self.what = f"torch {torch.__version__} gloo"

    def runner(self, coll, op, root, dt):
        if self.reason:
            return self.reason
        import torch

        dist = self.dist
        ops = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }
        if op not in ops and coll in REDUCING:
            return f"gloo has no {op}"
        if dt.name == "bfloat16":
            return "no bfloat16 through numpy"
        if coll == "reduce_scatter":
            return "gloo has no reduce_scatter"
        rop = ops.get(op, dist.ReduceOp.SUM)
        n, rank = self.mpi.size, self.mpi.rank

        def run(x, out, in_place):
            tx = torch.from_numpy(x)
            if coll == "all_reduce":
                t = tx if in_place else torch.from_numpy(out)
                if not in_place:
                    t.copy_(tx)
                dist.all_reduce(t, op=rop)
            elif coll == "all_gather":
                dist.all_gather_into_tensor(torch.from_numpy(out), tx)
            elif coll == "broadcast":
                dist.broadcast(tx, src=root)
            elif coll == "all_to_all":
                dist.all_to_all_single(torch.from_numpy(out), tx)
            elif coll == "gather":
                parts = list(torch.from_numpy(out).chunk(n)) if rank == root else None
                dist.gather(tx, parts, dst=root)
            elif coll == "scatter":
                parts = list(tx.chunk(n)) if rank == root else None
                dist.scatter(torch.from_numpy(out), parts, src=root)
            elif coll == "sendrecv":
                ty = torch.from_numpy(out)
                for w in dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, tx, (rank + 1) % n),
                        dist.P2POp(dist.irecv, ty, (rank - 1) % n),
                    ]
                ):
                    w.wait()
            else:
                t = tx if in_place else torch.from_numpy(out)
                if not in_place:
                    t.copy_(tx)
                dist.reduce(t, dst=root, op=rop)

        return run

    def close(self):
        if not self.reason:
            self.dist.destroy_process_group()
            self.mpi.Barrier()
            if self.mpi.rank == 0 and os.path.exists(self.path):
                os.unlink(self.path)


def copy_bandwidth(mpi, nbytes=256 << 20, repeats=3) -> float:
    """GB/s one rank copies while every rank copies at once (the memory bound's B)."""
    import time

    a = np.ones(nbytes // 8, np.float64)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(repeats):
        mpi.Barrier()
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, mpi.allreduce(time.perf_counter() - t0, op=_max()))
    return nbytes / best / 1e9


def _max():
    from mpi4py import MPI

    return MPI.MAX
