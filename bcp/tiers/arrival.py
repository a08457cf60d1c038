"""Loading while the exchange still runs (``bcp.tiers.recover``, steps 5-6 overlapped).

When the exchange has a gloo group of its own, it runs in a thread while every rank
already loads from its host's recovery directory: ranks whose host holds what they
read finish their load while they serve their peers, and a rank that receives
bytes reads each of them as soon as it has landed. The recovery directory's backend
is wrapped (:class:`GatedBackend`): a read of a file the host does not hold waits
until every byte of it has landed, as this rank's own pieces land, or, for pieces
another rank of the host receives, once the whole exchange has ended and every rank
agreed it did (after that, a byte never fetched reads as zero and fails its block's
CRC32C, as before). An exchange that fails releases every waiting read with its
error, so a load never waits for bytes that will not come.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

from bcp.backends import Backend, IOHints, read_into_many
from bcp.backends.wrappers import ForwardingBackend
from bcp.errors import CorruptCheckpointError


class Arrivals:
    """Byte ranges of the fetched data files (manifest index -> (start, end)) that
    this rank wrote into the recovery directory, and whether the exchange ended."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._landed: dict[int, list[tuple[int, int]]] = {}
        self._ended = False
        self._error: BaseException | None = None

    def landed(self, file: int, start: int, end: int) -> None:
        with self._cond:
            self._landed.setdefault(file, []).append((start, end))
            self._cond.notify_all()

    def end(self, error: BaseException | None) -> None:
        """The exchange ended everywhere (or failed: ``error``): release every read."""
        with self._cond:
            self._ended = True
            self._error = error
            self._cond.notify_all()

    def _covered(self, file: int, start: int, end: int) -> bool:
        # this rank's pieces of one file are disjoint: covered when their overlaps add up
        got = sum(max(0, min(end, b) - max(start, a)) for a, b in self._landed.get(file, ()))
        return got >= end - start

    def wait(self, file: int, start: int, end: int, what: str) -> None:
        with self._cond:
            while not self._ended and not self._covered(file, start, end):
                self._cond.wait()
            if self._error is not None:
                raise CorruptCheckpointError(
                    f"local tier: {what} was not fetched: the exchange failed ({self._error})", file=what, offset=start
                ) from self._error


class HoleyFiles(ForwardingBackend):
    """A recovery directory's backend: its fetched files hold only the byte ranges this
    host's load reads, with holes between them, so no read crosses a gap. Reads go
    through the inner backend's own reader (:meth:`reading`), as a load from the file
    root's does: one descriptor per file and one ``preadv`` for many small tensors, not
    an open, its checks and a close per read (the default of a wrapper)."""

    @property
    def hints(self) -> IOHints:
        return dataclasses.replace(self.inner.hints, read_gap_bytes=0)

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Callable[[int, memoryview], None]]:
        with self.inner.reading(key) as read:
            yield read


class GatedBackend(HoleyFiles):
    """The recovery directory's backend: reads of fetched files wait for their bytes."""

    def __init__(self, inner: Backend, fetched: dict[str, int], arrivals: Arrivals) -> None:
        super().__init__(inner)
        #: data file key -> its index in the manifest, for the files this host does not hold
        self.fetched = fetched
        self.arrivals = arrivals

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        file = self.fetched.get(key)
        if file is not None and len(buffer):
            self.arrivals.wait(file, offset, offset + len(buffer), key)
        return self.inner.read_into(key, offset, buffer)

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Callable[[int, memoryview], None]]:
        """The inner reader; of a fetched file, each read waiting for its bytes first (the
        descriptor opened now reads what lands later: the exchange writes in place)."""
        file = self.fetched.get(key)
        with self.inner.reading(key) as read:
            yield read if file is None else _GatedReader(read, self.arrivals, file, key)

    def in_memory(self, key: str, offset: int, nbytes: int) -> bool:
        return key not in self.fetched and self.inner.in_memory(key, offset, nbytes)


class _GatedReader:
    """A reader of :meth:`GatedBackend.reading`: ``read(offset, buffer)`` and
    ``read_into_many(offset, buffers)`` (the inner reader's, or one read per buffer), each
    once the range it fills has landed."""

    def __init__(self, read: Callable[[int, memoryview], None], arrivals: Arrivals, file: int, key: str) -> None:
        self._read = read
        self._arrivals = arrivals
        self._file = file
        self._key = key

    def __call__(self, offset: int, buffer: memoryview) -> None:
        if buffer.nbytes:
            self._arrivals.wait(self._file, offset, offset + buffer.nbytes, self._key)
        self._read(offset, buffer)

    def read_into_many(self, offset: int, buffers: Sequence[memoryview]) -> None:
        total = sum(b.nbytes for b in buffers)
        if total:
            self._arrivals.wait(self._file, offset, offset + total, self._key)
        read_into_many(self._read, offset, buffers)
