"""The communicator: rendezvous over MPI, then collectives over shared memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from pycollectives import _C, arrays
from pycollectives.errors import CollectiveError, CollectiveMismatch
from pycollectives.hierarchy import Hierarchical, Topology, ranks_per_node_from_env
from pycollectives.ops import ALGORITHMS, SUM, algo_code, op_code
from pycollectives.work import InFlight, Work

DEFAULT_TIMEOUT = 300.0
DEFAULT_STAGING_BYTES = 256 * 1024
DEFAULT_STAGING_SLOTS = 4
# What every rank contributes when the first GPU collective starts the CUDA transport.
_GPU_HANDSHAKE = b"pycollectives:cuda-transport-v1"


TUNING_FILE = Path(__file__).with_name("tuning.json")


def load_tuning(path=TUNING_FILE) -> list:
    """Rules (collective, min_ranks, max_ranks, max_bytes, algorithm) from a tuning file
    written by benchmarks/tune.py; the first matching rule wins, ring when none does."""
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return []
    return [
        (
            r["collective"],
            int(r["min_ranks"]),
            int(r["max_ranks"]),
            int(r["max_bytes"]),
            r["algorithm"],
        )
        for r in table.get("rules", [])
    ]


def _env_number(name, default, kind, environ=None):
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


class Communicator:
    """A group of ranks that run collectives together.

    Built from an MPI communicator (``MPI.COMM_WORLD`` by default). Creating it is collective:
    the ranks of each machine exchange the names of their shared-memory segments with one MPI
    all-gather; after that, collectives on one machine never call MPI. A communicator that
    spans several machines (nodes) runs hierarchical collectives: shared memory inside each
    node, MPI point-to-point between nodes (see ``pycollectives.hierarchy``).

    Args:
        mpi_comm: an ``mpi4py.MPI.Comm``; defaults to ``MPI.COMM_WORLD``.
        timeout: seconds any collective may wait for a peer before raising
            ``CollectiveTimeout`` (env ``PYCOLL_TIMEOUT``, default 300).
        staging_bytes: size of one staging slot; messages are pipelined through slots of this
            size (env ``PYCOLL_STAGING_BYTES``, default 256 KiB).
        staging_slots: slots per peer channel (env ``PYCOLL_STAGING_SLOTS``, default 4).

    Every rank must call the same collectives in the same order, with matching sizes, dtype,
    op and root. Example::

        comm = pc.Communicator()
        x = np.arange(8, dtype=np.float32)
        comm.all_reduce(x, op="sum")              # in place
        out = np.empty(8 * comm.size, np.float32)
        comm.all_gather(x, out)                   # rank-major
        comm.close()
    """

    def __init__(self, mpi_comm=None, *, timeout=None, staging_bytes=None, staging_slots=None):
        from mpi4py import MPI

        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        opts = _C.HostCommOptions()
        opts.timeout = float(
            timeout
            if timeout is not None
            else _env_number("PYCOLL_TIMEOUT", DEFAULT_TIMEOUT, float)
        )
        opts.slot_bytes = int(
            staging_bytes
            if staging_bytes is not None
            else _env_number("PYCOLL_STAGING_BYTES", DEFAULT_STAGING_BYTES, int)
        )
        opts.nslots = int(
            staging_slots
            if staging_slots is not None
            else _env_number("PYCOLL_STAGING_SLOTS", DEFAULT_STAGING_SLOTS, int)
        )
        # Outputs this large bypass the cache; a tuning knob, not part of the API.
        opts.stream_bytes = _env_number("PYCOLL_STREAM_BYTES", opts.stream_bytes, int)
        opts.oneshot_max_bytes = _env_number("PYCOLL_ONESHOT_BYTES", opts.oneshot_max_bytes, int)
        opts.debug = os.environ.get("PYCOLL_DEBUG", "").upper() in ("INFO", "TRACE")
        # Mismatch detection is always on; PYCOLL_CHECK_MISMATCH=0 exists to measure its cost.
        opts.check_mismatch = os.environ.get("PYCOLL_CHECK_MISMATCH", "1") != "0"
        forced = (os.environ.get("PYCOLL_ALGO") or "").lower() or None
        if forced is not None and forced not in ALGORITHMS:
            raise ValueError(f"PYCOLL_ALGO={forced!r}: expected one of {', '.join(ALGORITHMS)}")
        if opts.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {opts.timeout}")
        if opts.slot_bytes < 64 or opts.slot_bytes % 64:
            raise ValueError(
                f"staging_bytes must be a positive multiple of 64, got {opts.slot_bytes}"
            )
        if not 2 <= opts.nslots <= 64:
            # A step may hold an incoming slot while it waits for an outgoing one.
            raise ValueError(f"staging_slots must be in [2, 64], got {opts.nslots}")
        self._c = None
        self._hier = None
        self._node_comm = None
        self._cuda = None  # the CUDA transport, made by the first collective on GPU arrays
        self._cuda_error = None
        self._mpi = base.Dup()
        # Errors are ours to report, never fatal to the job.
        self._mpi.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            self.topology = Topology.discover(self._mpi, *ranks_per_node_from_env())
            if self.topology.num_nodes == 1:
                self._rendezvous(self._mpi, opts)
            else:
                self._setup_nodes(MPI, opts, forced)
        except BaseException:
            self._c = None
            self._hier = None
            if self._node_comm is not None:
                self._node_comm.Free()
            self._mpi.Free()
            raise
        self.rank = self._mpi.Get_rank()
        self.size = self._mpi.Get_size()
        self._inflight = InFlight()
        self._c.set_tuning(load_tuning())
        if forced is not None:
            self._c.set_forced(forced)

    def _setup_nodes(self, MPI, opts, forced):
        """Shared memory inside this node, MPI between nodes."""
        topo = self.topology
        rank = self._mpi.Get_rank()
        if topo.ranks_per_node is None:
            raise ValueError(
                "hierarchical collectives need the same number of ranks on every node; nodes "
                f"have {', '.join(str(len(n)) for n in topo.nodes)} ranks ({topo.describe()})"
            )
        self._node_comm = self._mpi.Split(topo.node_of[rank], key=rank)
        error = None
        try:
            self._rendezvous(self._node_comm, opts)
        except (CollectiveError, ValueError) as e:
            error = f"rank {rank}: {e}"
        # One node's failure is every rank's error, not a hang on the other nodes.
        errors = [e for e in self._mpi.allgather(error) if e is not None]
        if errors:
            raise CollectiveError("cannot set up the nodes: " + "; ".join(errors))
        try:
            from pycollectives import _net
        except ImportError as e:
            raise CollectiveError(
                "this build has no inter-node transport (it was built without MPI headers; "
                f"reinstall with mpi4py's MPI present): {e}"
            ) from None
        net = _net.NetComm(
            self._mpi,
            piece_bytes=_env_number("PYCOLL_NET_PIECE_BYTES", 1 << 20, int),
            window=8,
            timeout=opts.timeout,
        )
        inter = (os.environ.get("PYCOLL_INTER_ALGO") or "").lower() or None
        if inter is not None and inter not in ALGORITHMS:
            raise ValueError(
                f"PYCOLL_INTER_ALGO={inter!r}: expected one of {', '.join(ALGORITHMS)}"
            )
        self._hier = Hierarchical(topo, rank, self._c, net, inter_algo=inter or forced)

    def _rendezvous(self, comm, opts):
        rank, size = comm.Get_rank(), comm.Get_size()
        # Every rank reports its configuration and segment (or why it has none) in one exchange,
        # so a failure on one rank is an error on all ranks, never a hang.
        config = (opts.slot_bytes, opts.nslots)
        host, error = None, None
        try:
            host = _C.HostComm(rank, size, opts)
        except (CollectiveError, ValueError) as e:
            error = str(e)
        reports = comm.allgather((config, None if host is None else host.segment_name, error))
        failed = [(r, rep[2]) for r, rep in enumerate(reports) if rep[2] is not None]
        if failed:
            raise CollectiveError(
                "cannot set up shared memory: " + "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            )
        configs = {rep[0] for rep in reports}
        if len(configs) != 1:
            raise ValueError(
                "ranks disagree on the staging configuration (staging_bytes, staging_slots): "
                + ", ".join(f"rank {r}: {rep[0]}" for r, rep in enumerate(reports))
            )
        error = None
        try:
            host.attach([rep[1] for rep in reports])
        except CollectiveError as e:
            error = str(e)
        errors = comm.allgather(error)
        # Every peer has mapped our segment (or given up): its name is no longer needed.
        host.unlink()
        failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
        if failed:
            raise CollectiveError(
                "cannot attach shared memory: " + "; ".join(f"rank {r}: {m}" for r, m in failed)
            )
        self._c = host

    # -- lifetime -----------------------------------------------------------------------------

    def close(self):
        """Waits for asynchronous work, then releases the shared memory. Later calls raise
        CollectiveError."""
        if self._c is not None:
            try:
                self._inflight.wait_all()
                if self._cuda is not None:
                    self._cuda.close()  # collective: no peer still reads this rank's GPU memory
            finally:
                self._cuda = None
                if self._hier is not None:
                    self._hier.close()
                    self._hier = None
                    self._node_comm.Free()
                self._c = None
                self._mpi.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Interpreter shutdown may have torn down MPI already; the mapping goes with the process.
        self._c = None

    def _host(self):
        c = self._c
        if c is None:
            raise CollectiveError("the communicator is closed")
        return c

    def _finish(self, native, arrays, result):
        if native is None:
            return result
        work = Work(native, arrays, result)
        self._inflight.add(work)
        return work

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        """The algorithm ``algorithm=None`` picks for `collective` on `nbytes` of input
        ("hierarchical" on a communicator over several nodes)."""
        if self._hier is not None:
            self._host()
            return "hierarchical"
        return self._host().choose(collective, nbytes)

    @property
    def timeout(self) -> float:
        """Seconds a collective may wait for a peer."""
        return self._host().timeout

    @timeout.setter
    def timeout(self, seconds: float):
        if seconds <= 0:
            raise ValueError(f"timeout must be positive, got {seconds}")
        self._host().timeout = float(seconds)
        if self._cuda is not None:
            self._cuda.timeout = float(seconds)
        if self._hier is not None:
            self._hier.net.timeout = float(seconds)

    @property
    def staging_bytes(self) -> int:
        return self._host().slot_bytes

    @property
    def seq(self) -> int:
        """Number of collectives this rank has started (host and GPU arrays alike)."""
        gpu = 0 if self._cuda is None else self._cuda.seq
        if self._hier is not None:
            self._host()
            return self._hier.seq + gpu
        return self._host().seq + gpu

    # -- collectives --------------------------------------------------------------------------
    # Each takes algorithm= ("ring", "tree", "direct"; None: automatic) and async_op=: with
    # async_op=True it returns a Work instead of the output array. numpy arrays run over shared
    # memory (and MPI between nodes); CUDA arrays (cupy, torch, ``__cuda_array_interface__``,
    # DLPack) run on the GPU (``pycollectives.cuda``), queued on `stream` (default: the array
    # library's current stream), and the call returns without waiting for the GPU.

    def all_reduce(self, x, out=None, op=SUM, algorithm=None, async_op=False, stream=None):
        """Reduces `x` over all ranks; every rank gets the result in `out` (default: in `x`).

        Every rank ends with a bitwise identical result. Returns the output array.
        """
        res = x if out is None else out
        if self._on_gpu(x, out, stream):
            return self._gpu("all_reduce", x, out, res, async_op, stream, op=op_code(op))
        if self._hier is not None:
            w = self._hier.all_reduce(x, out, op_code(op), algorithm, async_op)
        else:
            w = self._host().all_reduce(x, out, op_code(op), algo_code(algorithm), async_op)
        return self._finish(w, (x, out), res)

    def reduce_scatter(self, x, out, op=SUM, algorithm=None, async_op=False, stream=None):
        """Reduces `x` (``size * out.size`` elements) over all ranks; rank r gets block r."""
        if self._on_gpu(x, out, stream):
            return self._gpu("reduce_scatter", x, out, out, async_op, stream, op=op_code(op))
        if self._hier is not None:
            w = self._hier.reduce_scatter(x, out, op_code(op), algorithm, async_op)
        else:
            w = self._host().reduce_scatter(x, out, op_code(op), algo_code(algorithm), async_op)
        return self._finish(w, (x, out), out)

    def all_gather(self, x, out, algorithm=None, async_op=False, stream=None):
        """Gathers every rank's `x` into `out` (``size * x.size`` elements, rank-major)."""
        if self._on_gpu(x, out, stream):
            return self._gpu("all_gather", x, out, out, async_op, stream, algorithm=algorithm)
        if self._hier is not None:
            w = self._hier.all_gather(x, out, algorithm, async_op)
        else:
            w = self._host().all_gather(x, out, algo_code(algorithm), async_op)
        return self._finish(w, (x, out), out)

    def broadcast(self, x, root=0, algorithm=None, async_op=False, stream=None):
        """Copies the root's `x` into `x` on every rank."""
        if self._on_gpu(x, None, stream):
            return self._gpu("broadcast", x, None, x, async_op, stream, root=root)
        if self._hier is not None:
            w = self._hier.broadcast(x, root, algorithm, async_op)
        else:
            w = self._host().broadcast(x, root, algo_code(algorithm), async_op)
        return self._finish(w, (x,), x)

    def reduce(self, x, out=None, root=0, op=SUM, algorithm=None, async_op=False, stream=None):
        """Reduces `x` over all ranks into the root's `out` (default: the root's `x`).

        Elsewhere `out` is checked but not written. Returns the output array.
        """
        res = x if out is None else out
        if self._on_gpu(x, out, stream):
            return self._gpu("reduce", x, out, res, async_op, stream, op=op_code(op), root=root)
        if self._hier is not None:
            w = self._hier.reduce(x, out, root, op_code(op), algorithm, async_op)
        else:
            w = self._host().reduce(x, out, root, op_code(op), algo_code(algorithm), async_op)
        return self._finish(w, (x, out), res)

    def barrier(self, async_op=False):
        """Returns once every rank has entered the barrier (after this rank's earlier work).

        Once GPU collectives have run, a blocking barrier also waits until this rank's GPU
        collectives have finished on the device."""
        if self._cuda is not None and not async_op:
            self._cuda.barrier()
        if self._hier is not None:
            return self._finish(self._hier.barrier(async_op), (), None)
        return self._finish(self._host().barrier(async_op), (), None)

    # -- GPU arrays ---------------------------------------------------------------------------

    def _on_gpu(self, x, out, stream) -> bool:
        if arrays.is_cuda_array(x) or (out is not None and arrays.is_cuda_array(out)):
            return True
        if stream is not None:
            raise TypeError("stream= applies to CUDA arrays; these are host arrays")
        return False

    def _gpu(self, collective, x, out, result, async_op, stream, op=None, root=None, **kw):
        """Runs `collective` on CUDA arrays through the CUDA transport (made on first use)."""
        self._host()
        algorithm = kw.pop("algorithm", None)
        if algorithm is None or isinstance(algorithm, str):
            algorithm = algo_code(algorithm)
        if self._cuda is None:
            self._start_cuda(collective, x, out, op, root, algorithm)
        return self._cuda.run(collective, x, out, op, root, algorithm, stream, async_op, result)

    def _start_cuda(self, collective, x, out, op, root, algorithm):
        """Makes the CUDA communicator, collectively, when the first GPU collective arrives.

        The arguments are checked first (an error before anything moves). Then the ranks agree,
        over shared memory with the usual fingerprint and timeout, that all of them are in a
        GPU collective: a rank that passed host arrays gets CollectiveMismatch, not a hang.
        """
        from pycollectives.cuda import CudaComm
        from pycollectives.cuda_args import check_call

        if self._cuda_error is not None:
            raise CollectiveError(self._cuda_error)
        check_call(collective, x, out, op, root, algorithm, self.rank, self.size, None)
        if self._hier is not None:
            raise CollectiveError(
                f"{collective}: CUDA arrays on a communicator over {self.topology.num_nodes} "
                "nodes are not supported (the CUDA transport is for the GPUs of one machine); "
                "copy them to host memory, or use a communicator within one node"
            )
        token = np.frombuffer(_GPU_HANDSHAKE, np.uint8)
        seen = np.empty(self.size * token.size, np.uint8)
        self._host().all_gather(token, seen, 0, False)
        rows = seen.reshape(self.size, -1)
        strangers = [r for r, row in enumerate(rows) if row.tobytes() != _GPU_HANDSHAKE]
        if strangers:
            raise CollectiveMismatch(
                f"{collective}: this rank passed CUDA arrays, ranks {strangers} did not"
            )
        try:
            self._cuda = CudaComm(
                self._mpi, self.rank, self.size, timeout=self.timeout, arrays=(x, out)
            )
        except CollectiveError as e:
            # Every rank failed alike (the setup is one exchange): later GPU calls say why.
            self._cuda_error = str(e)
            raise
