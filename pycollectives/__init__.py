"""pycollectives: collective communication for numpy arrays between MPI-launched processes.

Example (run with ``mpiexec -n 2 python example.py``)::

    import numpy as np
    import pycollectives as pc

    with pc.Communicator() as comm:
        x = np.full(4, comm.rank, dtype=np.float32)
        comm.all_reduce(x, op=pc.SUM)   # in place: every rank now holds 0 + 1 + ...
"""

from pycollectives.backends import P2POp
from pycollectives.communicator import Communicator
from pycollectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from pycollectives.ops import ALGORITHMS, AVG, MAX, MIN, PROD, SUM, ReduceOp
from pycollectives.options import Options
from pycollectives.parallel.data import (
    DataParallel,
    DistributedSampler,
    GlobalBatchSampler,
    GradientBucketer,
)
from pycollectives.work import Work

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "AVG",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Communicator",
    "DataParallel",
    "DistributedSampler",
    "GlobalBatchSampler",
    "GradientBucketer",
    "Options",
    "P2POp",
    "ReduceOp",
    "Work",
]
