"""send/recv of GPU arrays, staged through page-locked host memory over the host path's p2p.

A send copies its array into a page-locked host buffer on its stream (behind the work that
produces the array), waits for that copy (bounded by the communicator's timeout) and sends the
host buffer; a receive lands in a host buffer, which is then copied into its array on its
stream. GPU send/recv so keep every guarantee of the host path: tags received in any order, a
size or dtype mismatch raised on both ends, bounded waits, dead peers found, and the
hierarchical backend's p2p between nodes.

As for GPU collectives, the host does not wait for a receive's copy into the array: later work
on the stream is ordered after it (after ``wait()``, asynchronously). Host buffers come from a
pool and return to it only once the GPU has finished copying out of them.
"""

from __future__ import annotations

import threading

import numpy as np

from pycollectives import _C
from pycollectives.backends import P2POp
from pycollectives.runtime import arrays


class StagingPool:
    """Page-locked host buffers by size class (powers of two, from 64 KiB); a buffer is reused
    once the copies queued on it have finished, and never freed before."""

    MIN_BYTES = 1 << 16
    KEEP = 2  # idle buffers kept per size class

    def __init__(self, native):
        self._native = native
        self._idle: dict[int, list] = {}  # class bytes -> [(buffer, StreamMark or None)]
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        size = max(self.MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            idle = self._idle.get(size, [])
            for i, (buf, mark) in enumerate(idle):
                if mark is None or mark.done():
                    del idle[i]
                    return buf
        return self._native.PinnedBuffer(size)

    def give(self, buf, mark=None):
        with self._lock:
            idle = self._idle.setdefault(buf.nbytes, [])
            idle.append((buf, mark))
            # Free the surplus, but only buffers no copy still reads or writes.
            i = 0
            while len(idle) > self.KEEP and i < len(idle):
                if idle[i][1] is None or idle[i][1].done():
                    del idle[i]
                else:
                    i += 1

    def idle_buffers(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())


class _Staged:
    """One GPU array of a batch and its host buffer."""

    __slots__ = ("kind", "info", "stream", "buf", "view")

    def __init__(self, kind, info, stream, buf):
        self.kind, self.info, self.stream, self.buf = kind, info, stream, buf
        self.view = np.frombuffer(buf, np.uint8, count=info.nbytes).view(
            arrays.storage_dtype(info.dtype_name)
        )


def _check(o: P2POp, info, i: int):
    where = f"p2p: ops[{i}] array"
    if info.dtype < 0:
        raise TypeError(
            f"{where} has unsupported dtype {info.dtype_name} (supported: int8, uint8, int32, "
            "int64, float16, bfloat16, float32, float64)"
        )
    if not info.contiguous:
        raise ValueError(f"{where} must be C-contiguous")
    if o.kind == "recv" and info.readonly:
        raise ValueError(f"{where} is read-only")
    if info.device is None or info.device < 0:
        raise ValueError(f"{where}: cannot tell which GPU it is on")


def _check_overlap(ops, infos, o, info, i):
    """A receive must not land on GPU memory another op of the batch reads or writes."""
    for j, other in enumerate(infos):
        if other is None or other.device != info.device:
            continue
        if "recv" in (o.kind, ops[j].kind) and info.nbytes and other.nbytes:
            if info.ptr < other.ptr + other.nbytes and other.ptr < info.ptr + info.nbytes:
                raise ValueError(
                    f"p2p: ops[{i}] array overlaps the array of ops[{j}] and one of them is "
                    "received into"
                )


class StagedP2P:
    """Runs batches of ``P2POp`` whose arrays may be in GPU memory over `host_p2p` (a host
    backend's ``p2p(ops, async_op)``) for rank `rank` of `size`. `timeout()` is the
    communicator's current timeout; `native` the module with the CUDA calls (``_cuda``)."""

    def __init__(self, host_p2p, rank, size, timeout, native):
        self._host_p2p, self._timeout, self._native = host_p2p, timeout, native
        self._rank, self._size = rank, size
        self.pool = StagingPool(native)

    def run(self, ops, async_op: bool, stream=None):
        """Returns None once a blocking batch is done, else a handle with wait/is_completed."""
        staged, host_ops = self._stage(ops, stream)
        try:
            sends = {(s.info.device, s.stream) for s in staged if s.kind == "send"}
            for device, s in sends:  # the host sends only what the GPU has finished copying
                self._native.StreamMark(device, s).wait(self._timeout(), "send")
            handle = self._host_p2p(host_ops, async_op)
        except BaseException:
            for s in staged:  # the host is done with them; a send's copy may still run
                mark = None
                if s.kind == "send":
                    mark = self._native.StreamMark(s.info.device, s.stream)
                self.pool.give(s.buf, mark)
            raise
        if not async_op:
            self.land(staged)
            return None
        return _StagedCompletion(handle, self, staged)

    def _stage(self, ops, stream):
        """Checks every op (the host path's checks too), then takes host buffers and queues
        the sends' copies to them."""
        infos = []
        for i, o in enumerate(ops):
            info = arrays.describe(o.array) if arrays.is_cuda_array(o.array) else None
            if info is not None:
                _check(o, info, i)
                _check_overlap(ops, infos, o, info, i)
            infos.append(info)
        given = None if stream is None else arrays.stream_handle(stream)
        staged, host_ops = [], []
        try:
            for o, info in zip(ops, infos):
                if info is None:  # host memory (torch CPU tensors seen as numpy arrays)
                    host_ops.append(P2POp(o.kind, arrays.host_view(o.array), o.peer, o.tag))
                    continue
                s = arrays.current_stream(info) if given is None else given
                st = _Staged(o.kind, info, s, self.pool.take(info.nbytes))
                staged.append(st)
                host_ops.append(P2POp(o.kind, st.view, o.peer, o.tag))
            _C.check_p2p(host_ops, self._rank, self._size)  # peers, tags, host arrays
        except BaseException:
            for st in staged:
                self.pool.give(st.buf)
            raise
        for st in staged:
            if st.kind == "send":
                self._native.copy_async(st.buf.ptr, st.info.ptr, st.info.nbytes, st.info.device,
                                        st.stream)  # fmt: skip
        return staged, host_ops

    def land(self, staged):
        """Queues the receives' copies into their arrays; returns every buffer to the pool
        (a receive's once its copy has finished)."""
        marks = {}
        for s in staged:
            if s.kind == "recv":
                self._native.copy_async(s.info.ptr, s.buf.ptr, s.info.nbytes, s.info.device,
                                        s.stream)  # fmt: skip
        for s in staged:
            mark = None
            if s.kind == "recv":
                key = (s.info.device, s.stream)
                if key not in marks:
                    marks[key] = self._native.StreamMark(*key)
                mark = marks[key]
            self.pool.give(s.buf, mark)
        return list(marks.values())


class _StagedCompletion:
    """The completion (``pycollectives.work``) of an asynchronous staged batch: ``wait()``
    waits for the host transfer, then orders the receives' streams after their copies (the
    host does not wait for those); ``is_completed()`` is true once the copies have finished
    on the GPU."""

    __slots__ = ("_host", "_p2p", "_staged", "_marks", "_lock")

    def __init__(self, host, p2p, staged):
        self._host, self._p2p, self._staged = host, p2p, staged
        self._marks = None
        self._lock = threading.Lock()

    def _land(self):
        with self._lock:
            if self._marks is None:
                self._marks = self._p2p.land(self._staged)
                self._staged = ()

    def _drop(self):
        """After a failed batch: nothing lands, and the buffers are free again."""
        with self._lock:
            if self._marks is None:
                for s in self._staged:
                    self._p2p.pool.give(s.buf)
                self._staged, self._marks = (), []

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._host.wait(timeout)
        except BaseException:
            if self._host.is_completed():
                self._drop()
            raise
        self._land()
        return True

    def is_completed(self) -> bool:
        if not self._host.is_completed():
            return False
        try:
            self._host.wait(None)  # finished: returns at once, or raises the batch's error
        except BaseException:
            self._drop()
            return True
        self._land()
        return all(m.done() for m in self._marks)

    @property
    def seq(self) -> int:
        return self._host.seq
