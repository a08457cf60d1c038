"""What a chunk handed to a data file's writers holds (:class:`StagedChunk`), how host
bytes are copied into a slab (:func:`copy_bytes`), and the hook an incremental save's
digests take from the bytes written (:class:`DigestSink`), and the raw copies of a
staged chunks run on the caller's cores (:class:`RunCopies`): the write pipeline's parts
that need none of its state."""

from __future__ import annotations

import collections
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

    __slots__ = ("base", "done", "error", "lock", "parts", "settled", "tag", "ticket")

    def __init__(
        self, base: int, parts: Sequence[Runs], lock: threading.Lock, settled: threading.Condition, tag: object = None
    ) -> None:
        self.base, self.parts, self.tag = base, parts, tag
        self.ticket = itertools.count()  # next() is atomic: each part is taken exactly once
        self.lock, self.settled = lock, settled  # the crew's (or the caller's own)
        self.done = 0  # parts copied (under lock)
        self.error: BaseException | None = None

    def work(self) -> None:
        """Copy parts until none is left to take (another thread may still copy its last)."""
        move, fill, base, parts, n = _MEMMOVE, _MEMSET, self.base, self.parts, len(self.parts)
        while (i := next(self.ticket)) < n:
            try:
                for at, src, k in parts[i]:
                    if src:
                        move(base + at, src, k)
                    else:
                        fill(base + at, 0, k)
            except BaseException as e:  # noqa: BLE001 - raised by RunCopies in the caller
                self.error = e
            with self.lock:
                self.done += 1
                if self.done == n:
                    self.settled.notify_all()

    def complete(self) -> bool:
        return self.done == len(self.parts)


class _Crew:
    """Helper threads (torch's intra-op thread count less the caller) that take parts of
    the chunks the caller stages, oldest chunk first, as ``Tensor.copy_`` of a large tensor
    would. The caller posts each chunk and copies its parts too, without waiting for the
    helpers' last parts before it sets up the next chunk: no core idles at a chunk's end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posted = threading.Condition(self.lock)  # helpers wait here for a chunk
        self.settled = threading.Condition(self.lock)  # the caller waits here for parts copied, helpers out
        self.jobs: collections.deque[_Copy] = collections.deque()  # posted, maybe with parts left
        self.busy = 0  # helpers inside a job's work()
        self.helpers = 0
        #: the most helpers to start (lowered once a start fails)
        self.cap = 1 << 16

    def post(self, job: _Copy) -> None:
        with self.lock:
            self.jobs.append(job)
            self.posted.notify_all()

    def withdraw(self, jobs: Sequence[_Copy]) -> None:
        """(the caller, failing) Take every part of ``jobs`` not started, and wait until no
        helper copies: their slabs may go back to the pool only once nothing writes to them."""
        for job in jobs:
            while next(job.ticket) < len(job.parts):
                pass
        with self.lock:
            self.jobs.clear()  # one caller at a time: every job posted is the caller's
            self.settled.wait_for(lambda: not self.busy)

    def ensure_helpers(self) -> bool:
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
        while True:
            with self.lock:
                while not self.jobs:
                    self.posted.wait()
                job = self.jobs[0]
                self.busy += 1
            try:
                job.work()
            finally:
                with self.lock:
                    self.busy -= 1
                    if self.jobs and self.jobs[0] is job:
                        self.jobs.popleft()  # no part left to take
                    self.settled.notify_all()


_CREW = _Crew()
_CREW_LOCK = threading.Lock()


def _new_crew_in_child() -> None:
    """A forked child has none of the helpers, and a lock held at the fork stays held."""
    global _CREW, _CREW_LOCK
    _CREW, _CREW_LOCK = _Crew(), threading.Lock()


os.register_at_fork(after_in_child=_new_crew_in_child)


class RunCopies:
    """(one calling thread) The raw copies of chunks staged in turn: each chunk's parts
    (runs of (offset from its base, source address or 0 for zeros, bytes)) are copied on
    the caller's thread and, while the caller holds the crew, its helpers. :meth:`copy`
    returns once no part of the chunk is left to take, with the tags of the chunks now
    completely copied, oldest first; :meth:`finish` waits for the rest. After either
    raises, :meth:`drop` stops the copies in flight. One caller at a time holds the crew
    (from its first copy to finish or drop); others copy alone."""

    def __init__(self) -> None:
        self._crew: _Crew | None = None
        self._held = False  # tried for the crew (held it if _crew)
        self._open: collections.deque[_Copy] = collections.deque()  # posted, not yet returned
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)

    def copy(self, base: int, parts: Sequence[Runs], tag: object = None) -> list:
        job = _Copy(base, parts, self._lock, self._settled, tag)
        self._open.append(job)  # from here drop() returns its tag
        crew = self._crew if self._held else self._take_crew()
        if crew is not None:
            job.lock, job.settled = crew.lock, crew.settled
            crew.post(job)
        job.work()
        return self._completed()

    def finish(self) -> list:
        """Wait until every chunk is copied; their tags, oldest first (the crew let go)."""
        if self._open:
            first = self._open[0]
            with first.lock:
                first.settled.wait_for(lambda: all(job.complete() for job in self._open))
        if self._crew is not None:
            with self._crew.lock:
                self._crew.jobs.clear()  # every part copied: none left to take
        tags = self._completed()
        self._let_go()
        return tags

    def drop(self) -> list:
        """Stop the copies in flight (those not started are skipped, the helpers' finish);
        the tags of every chunk not returned, whose memory nothing writes to any more."""
        jobs, self._open = list(self._open), collections.deque()
        if self._crew is not None:
            self._crew.withdraw(jobs)
        self._let_go()
        return [job.tag for job in jobs]

    def _take_crew(self) -> _Crew | None:
        self._held = True
        if _CREW_LOCK.acquire(blocking=False):
            if _CREW.ensure_helpers():
                self._crew = _CREW
            else:
                _CREW_LOCK.release()
        return self._crew

    def _let_go(self) -> None:
        if self._crew is not None:
            self._crew = None
            _CREW_LOCK.release()
        self._held = False

    def _completed(self) -> list:
        done = 0
        for job in self._open:
            if not job.complete():
                break
            if job.error is not None:
                raise job.error  # nothing taken off: drop() returns every chunk still open
            done += 1
        return [self._open.popleft().tag for _ in range(done)]
