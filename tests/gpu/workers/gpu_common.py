"""What the GPU workers share: each rank on its own device, as a user's job would be."""

from __future__ import annotations

from mpi4py import MPI


def local_rank(comm=None) -> int:
    """This rank's index among the ranks of its machine (collective over `comm`, by default
    the world as it is at the call: the rank pool gives each case a world of its own, so a
    default bound at import would be the first case's, freed since)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank()
    finally:
        node.Free()


def use_local_device() -> int:
    """Makes device ``local_rank % device_count`` cupy's current device and returns it, so that
    arrays are made where the communicator puts this rank (every rank calls it: collective).
    On a machine with several GPUs the ranks then run on distinct GPUs, the normal setup."""
    import cupy as cp

    device = local_rank() % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(device).use()
    return device
