"""Deliberately broken backends, registered at import (``bcp conformance --import
broken_backends``): the conformance suite must fail them and say which guarantee broke."""

from __future__ import annotations

from bcp.backends import Buffer, ObjectWriter, register_backend
from bcp.backends.memory import _LOCK, _OBJECTS, MemoryBackend, _MemoryWriter


class _VisibleEarlyWriter(_MemoryWriter):
    """Publishes every write at once: readers see objects before (and without) commit."""

    def _write_at(self, offset: int, data: Buffer) -> None:
        super()._write_at(offset, data)
        with self._lock:
            current = bytes(self._buf)
        with _LOCK:
            _OBJECTS[self.backend._full(self.key)] = current


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
