"""The transports a Communicator dispatches to, behind one protocol.

A backend runs calls on one kind of memory and topology:

- ``HostBackend``: numpy arrays on one machine, over shared memory (``_C.HostComm``);
- ``hierarchical.Hierarchical``: numpy arrays on several nodes (shared memory
  inside each, MPI between them);
- ``cuda.CudaComm``: CUDA arrays on one machine, over CUDA IPC.

Each offers ``run(call)``, ``p2p(ops, async_op)``, ``barrier(async_op)``, ``seq``,
``timeout`` (settable), ``algorithm_for(collective, nbytes)`` and ``close()``; the host ones
(``HostBackend``, ``Hierarchical``) also ``abort(reason)``. ``run`` and
``p2p`` return None when the work is done, or a native handle (``wait(timeout)``,
``is_completed()``, ``seq``) that the Communicator wraps in a ``Work``.

Here: ``base`` (``Call``, ``P2POp``, agree-or-raise), ``host``, ``hierarchical`` (with
``hierarchical_flat``: the collectives it runs flat over all ranks, and its point-to-point),
``gloo_net`` (between nodes over torch's gloo, under torchrun) and ``cuda`` (the transport,
its argument checks, its environment and device choice, and send/recv of GPU arrays).
"""

from pycollectives.backends.base import (
    Call,
    P2POp,
    gathered_or_raise,
    same_on_every_rank,
)
from pycollectives.backends.host import HostBackend, rendezvous

__all__ = ["Call", "HostBackend", "P2POp", "gathered_or_raise", "rendezvous", "same_on_every_rank"]
