"""Handles of asynchronous operations: one ``Work`` for every backend and device.

A backend reports an operation's end through a *completion*, an object with three members::

    wait(timeout)     # blocks until it has ended (on the GPU: orders the issuing stream after
                      # it), raising its error, or CollectiveTimeout after `timeout` seconds
                      # (None: the communicator's own deadline) while it is still running
    is_completed()    # True once it has ended, successfully or not; never blocks
    seq               # its sequence number on its communicator

(``_C.Work``, ``_net.NetP2PWork``, the CUDA and emulated devices' completions, a future's,
and ``AllOf`` over several). ``Work`` alone does the rest: which error it ended with, once and
for every later call; the step that runs after it (copying a flat output back into a list);
its future; and keeping its arrays alive while it runs.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future

from pycollectives.errors import CollectiveTimeout

_RUNNING, _WAITED, _FAILED = 0, 1, 2


def _gave_up(error, completion) -> bool:
    """Whether `error`, raised by a wait on `completion`, is that wait giving up while the
    operation still runs (nothing to record), not the operation's own end."""
    return isinstance(error, CollectiveTimeout) and not completion.is_completed()


_settling = threading.Lock()  # runs a Work's `after` step once (rare: torch's list outputs)


class Work:
    """An asynchronous operation in flight (``async_op=True``).

    Collectives run on the communicator's progress thread one at a time, in the order they
    were issued; a blocking call issued meanwhile runs after them. The arrays stay referenced
    until the collective completes, so they cannot be freed under it.

    On GPU arrays the collective is queued on the GPU instead, and ``wait()`` orders the stream
    it was issued on after it (as torch's NCCL work does) without blocking the host;
    synchronise that stream to wait on the host.

    A Work that ended in an error raises that error from every ``wait()`` and ``result()``,
    and ``exception()`` returns it; a ``wait(timeout)`` that gives up while the operation
    runs raises ``CollectiveTimeout`` and records nothing (the operation goes on).

    Example::

        work = comm.all_reduce(grad, op=pc.AVG, async_op=True)
        ...                      # compute meanwhile
        work.wait()              # grad now holds the average
        comm.all_reduce(y, async_op=True).get_future().add_done_callback(on_done)
    """

    __slots__ = ("_native", "_arrays", "_result", "_after", "_state", "_error", "_future")

    def __init__(self, native, arrays, result, after=None):
        """`native`: the operation's completion (see the module docstring); `arrays`: what to
        keep alive until it completes; `result`: what ``result()`` returns; `after`: a
        function run once, after the first successful ``wait()`` (its error is the Work's)."""
        self._native = native
        self._arrays = arrays
        self._result = result
        self._after = after
        self._state = _RUNNING
        self._error = None
        self._future = None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the operation completes (raises ``CollectiveTimeout`` after `timeout`
        seconds, or the operation's own error). Returns True."""
        if self._state is not _RUNNING:
            if self._error is not None:
                raise self._error
            return True
        native = self._native
        try:
            native.wait(timeout)
        except BaseException as e:
            if _gave_up(e, native):
                raise  # the operation goes on
            self._fail(e)
            raise self._error from None
        if self._after is not None:
            self._run_after()
        else:
            self._state = _WAITED
        if native.is_completed():  # on the GPU, wait() only orders a stream after it
            self._arrays = None
        return True

    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or not)."""
        if self._state is _FAILED:
            return True
        done = self._native.is_completed()
        if done and self._state is _RUNNING and self._after is not None:
            self._settle()  # the step after it belongs to it: run before it is said done
        return done

    def is_success(self) -> bool:
        """True once the operation has finished without an error."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The error the operation ended with; None while it runs or if it succeeded."""
        if self._state is _RUNNING and self._native.is_completed():
            self._settle()
        return self._error

    def result(self):
        """The output array (waits first)."""
        self.wait()
        return self._result

    def get_future(self) -> Future:
        """A ``concurrent.futures.Future`` of ``result()``: it completes (or fails with the
        operation's error) from a helper thread once ``wait()`` would return, in the order
        the futures were asked for."""
        with _settling:
            fut, new = self._future, self._future is None
            if new:
                fut = self._future = Future()
                fut.set_running_or_notify_cancel()
        if new:
            if self._state is not _RUNNING or self._native.is_completed():
                self._complete_future()
            else:
                _completer().add(self)
        return fut

    @property
    def seq(self) -> int:
        """The operation's sequence number on its communicator."""
        return self._native.seq

    # -- its end ------------------------------------------------------------------------------

    def _fail(self, error):
        """Records `error` as the Work's, unless a wait on another thread recorded its own
        first (each wait on a native completion raises a new error object)."""
        with _settling:
            if self._state is not _FAILED:
                self._error, self._state, self._arrays = error, _FAILED, None

    def _run_after(self):
        with _settling:
            if self._state is not _RUNNING:
                return
            try:
                self._after()
            except BaseException as e:
                self._error, self._state, self._arrays = e, _FAILED, None
            else:
                self._state = _WAITED
            self._after = None
        if self._error is not None:
            raise self._error

    def _settle(self):
        """Records how an operation that has completed ended."""
        try:
            self.wait(None)  # returns at once (or raises its error): it has completed
        except BaseException:  # recorded by wait()
            pass

    def _complete_future(self):
        fut = self._future
        if fut is None or fut.done():
            return
        try:
            self.wait()
        except BaseException as e:
            fut.set_exception(e)
        else:
            fut.set_result(self._result)


class AllOf:
    """The completion of several operations (completions or Works) waited in order: it has
    ended when all have, with the first error met. Its `seq` is the last one's."""

    __slots__ = ("_parts",)

    def __init__(self, parts):
        self._parts = tuple(parts)

    def wait(self, timeout: float | None = None) -> bool:
        error = None
        for p in self._parts:
            try:
                p.wait(timeout)
            except BaseException as e:
                if _gave_up(e, p):
                    raise
                error = error or e  # the others still end, and are waited for
        if error is not None:
            raise error
        return True

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self._parts)

    @property
    def seq(self) -> int:
        return self._parts[-1].seq if self._parts else 0


class FutureCompletion:
    """The completion of an operation run as a ``concurrent.futures.Future``."""

    __slots__ = ("_future", "seq")

    def __init__(self, future, seq):
        self._future = future
        self.seq = seq

    def wait(self, timeout: float | None = None) -> bool:
        from concurrent.futures import TimeoutError as FutureTimeout

        try:
            self._future.result(timeout)
        except FutureTimeout:
            if self._future.done():  # it ended in a timeout of its own
                raise self._future.exception() from None
            raise CollectiveTimeout(
                f"Work.wait: collective #{self.seq} not complete after {timeout} s"
            ) from None
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class _Completer:
    """One helper thread that completes the futures of Works, in the order asked for."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pycoll-futures", daemon=True)
        self._thread.start()

    def add(self, work: Work):
        self._q.put(work)

    def _loop(self):
        while True:
            self._q.get()._complete_future()


_the_completer = None


def _completer() -> _Completer:
    global _the_completer
    with _settling:
        if _the_completer is None:
            _the_completer = _Completer()
        return _the_completer


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
