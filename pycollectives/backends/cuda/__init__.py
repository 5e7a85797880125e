"""The CUDA transport: ``CudaComm`` (``comm``), its argument checks (``args``), its
environment, device and synchronisation choices (``env``) and send/recv of GPU arrays staged
through host memory (``p2p``)."""

from pycollectives.backends.cuda.comm import CudaComm
from pycollectives.backends.cuda.env import (
    arrays_device,
    choose_device,
    choose_sync_mode,
    cuda_available,
    cuda_diagnostics,
    cuda_status,
    mps_active,
)

__all__ = [
    "CudaComm",
    "arrays_device",
    "choose_device",
    "choose_sync_mode",
    "cuda_available",
    "cuda_diagnostics",
    "cuda_status",
    "mps_active",
]
