"""Exceptions raised by collectives.

``CollectiveError`` (a ``RuntimeError``) is the base: a collective could not complete, for
example because a peer died. ``CollectiveTimeout`` means a bounded wait ran out;
``CollectiveMismatch`` means ranks disagree on the collective they are running. After any of
them the communicator is poisoned and later calls raise at once. Bad arguments raise
``ValueError`` or ``TypeError`` before any byte moves, and leave the communicator usable.
"""

from pycollectives._C import CollectiveError, CollectiveMismatch, CollectiveTimeout

__all__ = ["CollectiveError", "CollectiveMismatch", "CollectiveTimeout"]
