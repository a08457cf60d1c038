"""What a chunk handed to a data file's writers holds (:class:`StagedChunk`), how host
bytes are copied into a slab (:func:`copy_bytes`), and the hook an incremental save's
digests take from the bytes written (:class:`DigestSink`), and the raw copies of a
staged chunk run on the caller's cores (:func:`copy_runs`): the write pipeline's parts
that need none of its state."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from bcp.io_scheduler.chunk_plan import Chunk
from bcp.io_scheduler.staging import Slab


@dataclasses.dataclass(slots=True)
class StagedChunk:
    """A chunk handed to the writers: its bytes, where they live, and what completes them."""

    chunk: Chunk
    #: the pool slab holding the bytes (None: the bytes are the source tensor's own memory)
    slab: Slab | None
    data: torch.Tensor
    #: device-to-host copy events the bytes wait for (empty for host sources)
    events: list
    #: a batch's segments in the source's memory, and the parts written from its offset
    views: list | None = None
    parts: list | None = None


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` as one single-threaded numpy memmove (GIL released), not
    ``Tensor.copy_``: torch makes each copy of 32,768+ elements an OpenMP region whose
    threads wait for each other, which on a busy 2-core machine cost 10-100x."""
    dst[:] = src


class DigestSink(Protocol):
    """An incremental save's digests of the bytes written (``bcp.pieces.StreamDigests``)."""

    #: items left to a digest of their stored bytes (``bcp.pieces.digest_stored``)
    spilled: set[int]

    def feed(self, item: int, start: int, view: memoryview) -> None: ...
    def result(self, item: int) -> bytes: ...


#: memmove / memset through ctypes: a foreign call releases the GIL for its duration, and
#: costs about a third of a numpy slice assignment's Python work (a run per tensor).
_MEMMOVE = ctypes.memmove
_MEMSET = ctypes.memset

Runs = Sequence[tuple[int, int, int]]


class _Copy:
    """One chunk's parts, taken one at a time by whichever thread is free (a helper
    descheduled on a busy machine leaves its share to the caller instead of holding it up)."""

    __slots__ = ("base", "busy", "cond", "done", "error", "parts", "ticket")

    def __init__(self, base: int, parts: Sequence[Runs]) -> None:
        self.base, self.parts = base, parts
        self.ticket = itertools.count()  # next() is atomic: each part is taken exactly once
        self.cond = threading.Condition()
        self.done = 0  # parts copied
        self.busy = 0  # helpers inside work()
        self.error: BaseException | None = None

    def work(self) -> None:
        move, fill, base, parts, n = _MEMMOVE, _MEMSET, self.base, self.parts, len(self.parts)
        while (i := next(self.ticket)) < n:
            try:
                for at, src, k in parts[i]:
                    if src:
                        move(base + at, src, k)
                    else:
                        fill(base + at, 0, k)
            except BaseException as e:  # noqa: BLE001 - raised by copy_runs in the caller
                self.error = e
            with self.cond:
                self.done += 1
                if self.done == n:
                    self.cond.notify_all()

    def help(self) -> None:
        with self.cond:
            self.busy += 1
        try:
            self.work()
        finally:
            with self.cond:
                self.busy -= 1
                self.cond.notify_all()

    def wait(self) -> None:
        """(the caller, its own parts done) Until the helpers' parts are copied too."""
        with self.cond:
            self.cond.wait_for(lambda: self.done == len(self.parts))

    def abandon(self) -> None:
        """(the caller, failing) Take every part not started, and wait until no helper
        copies: the slab may go back to the pool only once nothing writes to it."""
        while next(self.ticket) < len(self.parts):
            pass
        with self.cond:
            self.cond.wait_for(lambda: not self.busy)


class _Crew:
    """Helper threads (torch's intra-op thread count less the caller) that copy parts
    of the chunk the caller stages, as ``Tensor.copy_`` of a large tensor would."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.job: _Copy | None = None
        self.helpers = 0
        #: the most helpers to start (lowered once a start fails)
        self.cap = 1 << 16

    def run(self, base: int, parts: Sequence[Runs]) -> None:
        job = _Copy(base, parts)
        if len(parts) > 1 and self._ensure_helpers():
            with self.cond:
                self.job = job
                self.cond.notify_all()
        try:
            job.work()
            job.wait()  # parts a helper took: the caller returns only once every byte is copied
        except BaseException:  # e.g. KeyboardInterrupt while waiting
            job.abandon()
            raise
        finally:
            with self.cond:
                if self.job is job:
                    self.job = None
        if job.error is not None:
            raise job.error

    def _ensure_helpers(self) -> bool:
        """Whether any helper runs (started now where fewer run than wanted)."""
        want = min(torch.get_num_threads(), os.cpu_count() or 1) - 1
        while self.helpers < min(want, self.cap):
            try:
                threading.Thread(target=self._loop, name="bcp-stage-copy", daemon=True).start()
            except RuntimeError:  # at the process's thread limit: those running (or the caller alone)
                self.cap = self.helpers
                break
            self.helpers += 1
        return min(want, self.helpers) > 0

    def _loop(self) -> None:
        seen: _Copy | None = None
        while True:
            with self.cond:
                while self.job is None or self.job is seen:
                    self.cond.wait()
                seen = self.job
            seen.help()


_CREW = _Crew()
_CREW_LOCK = threading.Lock()


def _new_crew_in_child() -> None:
    """A forked child has none of the helpers, and a lock held at the fork stays held."""
    global _CREW, _CREW_LOCK
    _CREW, _CREW_LOCK = _Crew(), threading.Lock()


os.register_at_fork(after_in_child=_new_crew_in_child)


def copy_runs(base: int, parts: Sequence[Runs]) -> None:
    """Copy ``parts`` (runs of (offset from ``base``, source address or 0 for zeros,
    bytes)) on the caller's thread and, for several parts, the crew's helpers; return
    once every run is done. One caller at a time uses the crew (others copy alone)."""
    if len(parts) > 1 and _CREW_LOCK.acquire(blocking=False):
        try:
            _CREW.run(base, parts)
        finally:
            _CREW_LOCK.release()
        return
    job = _Copy(base, parts)  # no helper: nothing but this thread writes to the slab
    job.work()
    if job.error is not None:
        raise job.error
