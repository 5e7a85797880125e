"""pycollectives.Work over completions that end when the test says (see pycollectives/work.py):
its error, recorded once; a wait that gives up, recorded never; the step after it, run once;
its future; AllOf and FutureCompletion."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

import pycollectives as pc
from pycollectives.work import AllOf, FutureCompletion, Work


class Completion:
    """Ends when `end()` is called, with `error` if given; counts its waits."""

    def __init__(self, seq=1):
        self.seq = seq
        self._done = threading.Event()
        self.error = None
        self.waits = 0

    def end(self, error=None):
        self.error = error
        self._done.set()

    def wait(self, timeout=None):
        self.waits += 1
        if not self._done.wait(timeout):
            raise pc.CollectiveTimeout(f"not complete after {timeout} s")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self._done.is_set()


def test_a_work_that_succeeds():
    c = Completion(seq=7)
    w = Work(c, ("arrays",), "out")
    assert not w.is_completed() and not w.is_success() and w.exception() is None
    assert w.seq == 7
    c.end()
    assert w.wait() is True and w.result() == "out"
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert w._arrays is None  # released once complete
    waits = c.waits
    w.wait()
    assert c.waits == waits  # a settled Work does not ask its completion again


def test_an_error_is_the_works_for_every_later_call():
    c = Completion()
    w = Work(c, None, "out")
    error = pc.CollectiveMismatch("count differs")
    c.end(error)
    assert w.exception() is error  # without a wait: asked of the completed operation
    assert w.is_completed() and not w.is_success()
    for call in (w.wait, w.result):
        with pytest.raises(pc.CollectiveMismatch) as e:
            call()
        assert e.value is error
    assert w.get_future().exception() is error


def test_a_wait_that_gives_up_records_nothing():
    c = Completion()
    w = Work(c, None, "out")
    with pytest.raises(pc.CollectiveTimeout, match="not complete"):
        w.wait(timeout=0.01)
    assert w.exception() is None and not w.is_completed()
    c.end()
    assert w.wait() and w.is_success()


def test_a_timeout_of_its_own_is_its_error():
    c = Completion()
    w = Work(c, None, None)
    c.end(pc.CollectiveTimeout("peer 1 did not arrive within 5 s"))
    with pytest.raises(pc.CollectiveTimeout, match="peer 1"):
        w.wait(timeout=0.01)
    assert isinstance(w.exception(), pc.CollectiveTimeout)


def test_the_step_after_runs_once_before_it_is_said_done():
    c = Completion()
    ran = []
    w = Work(c, None, "out", after=lambda: ran.append(1))
    assert not w.is_completed() and ran == []
    c.end()
    assert w.is_completed() and ran == [1]  # is_completed runs it: it belongs to the Work
    threads = [threading.Thread(target=w.wait) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ran == [1]


def test_an_error_in_the_step_after_is_the_works():
    c = Completion()

    def after():
        raise ValueError("cannot copy out")

    w = Work(c, None, None, after=after)
    c.end()
    with pytest.raises(ValueError, match="copy out"):
        w.wait()
    assert w.is_completed() and not w.is_success()
    assert isinstance(w.exception(), ValueError)
    with pytest.raises(ValueError):
        w.wait()


def test_a_failed_operation_skips_the_step_after():
    c = Completion()
    ran = []
    w = Work(c, None, None, after=lambda: ran.append(1))
    c.end(pc.CollectiveError("peer died"))
    with pytest.raises(pc.CollectiveError):
        w.wait()
    assert ran == [] and isinstance(w.exception(), pc.CollectiveError)


def test_the_future_completes_from_the_helper_thread():
    c = Completion()
    w = Work(c, None, "out")
    fut = w.get_future()
    assert w.get_future() is fut and not fut.done()
    seen = []
    fut.add_done_callback(lambda f: seen.append(threading.current_thread().name))
    c.end()
    assert fut.result(timeout=10) == "out"
    assert seen == ["pycoll-futures"]
    done = Completion()
    done.end()
    assert Work(done, None, 3).get_future().result(timeout=0) == 3  # already complete: at once


def test_the_future_of_a_failed_work():
    c = Completion()
    w = Work(c, None, "out")
    fut = w.get_future()
    c.end(pc.CollectiveError("peer 2 died"))
    assert isinstance(fut.exception(timeout=10), pc.CollectiveError)


def test_all_of_waits_every_part_and_raises_the_first_error():
    a, b, c = Completion(1), Completion(2), Completion(3)
    w = Work(AllOf([a, b, c]), None, "out")
    assert w.seq == 3
    a.end()
    b.end(pc.CollectiveMismatch("op differs"))
    assert not w.is_completed()
    c.end(pc.CollectiveError("later"))
    with pytest.raises(pc.CollectiveMismatch):
        w.wait()
    assert c.waits == 1  # waited for although an earlier part failed
    assert Work(AllOf([]), None, "x").wait()  # nothing to wait for (torch: all done at once)


def test_all_of_gives_up_on_a_part_still_running():
    a, b = Completion(), Completion()
    a.end()
    w = Work(AllOf([a, b]), None, None)
    with pytest.raises(pc.CollectiveTimeout):
        w.wait(timeout=0.01)
    assert w.exception() is None
    b.end()
    assert w.wait()


def test_future_completion():
    f = Future()
    w = Work(FutureCompletion(f, seq=4), None, "out")
    with pytest.raises(pc.CollectiveTimeout, match="#4 not complete"):
        w.wait(timeout=0.01)
    assert w.exception() is None
    f.set_exception(pc.CollectiveTimeout("peer 3 did not arrive"))
    with pytest.raises(pc.CollectiveTimeout, match="peer 3"):
        w.wait(timeout=0.01)
    assert isinstance(w.exception(), pc.CollectiveTimeout)
    g = Future()
    g.set_result(None)
    assert Work(FutureCompletion(g, 5), None, 1).result() == 1
