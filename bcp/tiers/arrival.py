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

import dataclasses
import threading

from bcp.backends import Backend, IOHints
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
    host's load reads, with holes between them, so no read crosses a gap."""

    @property
    def hints(self) -> IOHints:
        return dataclasses.replace(self.inner.hints, read_gap_bytes=0)


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

    def in_memory(self, key: str, offset: int, nbytes: int) -> bool:
        return key not in self.fetched and self.inner.in_memory(key, offset, nbytes)
