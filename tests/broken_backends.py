"""Deliberately broken backends, registered at import (``bcp conformance --import
broken_backends``): the conformance suite must fail them and say which guarantee broke."""

from __future__ import annotations

import threading

from bcp.backends import Buffer, ObjectWriter, check_key, register_backend
from bcp.backends.memory import MemoryBackend


class _VisibleEarlyWriter(ObjectWriter):
    """Publishes every write at once: readers see objects before (and without) commit."""

    def __init__(self, backend: MemoryBackend, key: str, size: int | None) -> None:
        super().__init__(backend.uri, check_key(key))  # refused at open, as the memory writer does
        self.backend = backend
        self._buf = bytearray(size or 0)
        self._lock = threading.Lock()  # parallel writes may grow the buffer

    def _publish(self) -> None:
        """Store the bytes written so far under the key, through a real memory writer."""
        with MemoryBackend.open_writer(self.backend, self.key, size=len(self._buf)) as writer:
            writer.write_at(0, bytes(self._buf))
            writer.commit()

    def _write_at(self, offset: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            end = offset + len(view)
            if end > len(self._buf):
                self._buf.extend(bytes(end - len(self._buf)))
            self._buf[offset:end] = view
            self._publish()

    def _commit(self) -> None:
        with self._lock:
            self._publish()

    def _abort(self) -> None:
        with self._lock:
            self._buf = bytearray()


class VisibleEarlyBackend(MemoryBackend):
    scheme = "broken-visible"

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _VisibleEarlyWriter(self, key, size)


class OffByOneReadsBackend(MemoryBackend):
    """Ranged reads start one byte late (except at offset 0)."""

    scheme = "broken-offbyone"

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        return super().read_into(key, offset + 1 if offset else 0, buffer)


for _cls in (VisibleEarlyBackend, OffByOneReadsBackend):
    register_backend(_cls.scheme, _cls, clobber=True)
