"""Handles of asynchronous collectives."""

from __future__ import annotations

from collections import deque


class Work:
    """An asynchronous collective in flight (``async_op=True``).

    Collectives run on the communicator's progress thread one at a time, in the order they
    were issued; a blocking call issued meanwhile runs after them. The arrays stay referenced
    until the collective completes, so they cannot be freed under it.

    On GPU arrays the collective is queued on the GPU instead, and ``wait()`` orders the stream
    it was issued on after it (as torch's NCCL work does) without blocking the host;
    synchronise that stream to wait on the host.

    Example::

        work = comm.all_reduce(grad, op=pc.AVG, async_op=True)
        ...                      # compute meanwhile
        work.wait()              # grad now holds the average
    """

    __slots__ = ("_native", "_arrays", "_result")

    def __init__(self, native, arrays, result):
        self._native = native
        self._arrays = arrays
        self._result = result

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the collective completes (raises ``CollectiveTimeout`` after `timeout`
        seconds, or the collective's own error). Returns True."""
        self._native.wait(timeout)
        if self._native.is_completed():  # on the GPU, wait() only orders a stream after it
            self._arrays = None
        return True

    def is_completed(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._native.is_completed()

    def result(self):
        """The output array (waits first)."""
        self.wait()
        return self._result

    @property
    def seq(self) -> int:
        """The collective's sequence number on this communicator."""
        return self._native.seq


class InFlight:
    """Keeps every unfinished Work (and so its arrays) alive until it completes."""

    def __init__(self):
        self._works: deque = deque()

    def add(self, work: Work):
        works = self._works
        while works and works[0].is_completed():
            works.popleft()
        works.append(work)

    def wait_all(self, timeout: float | None = None):
        while self._works:
            self._works.popleft()._native.wait(timeout)
