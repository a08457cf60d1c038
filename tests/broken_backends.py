"""Deliberately broken backends, registered at import (``bcp conformance --import
broken_backends``): the conformance suite must fail them and say which guarantee broke.
Also a store that replaces objects non-atomically and says so, which must pass."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from bcp.backends import Buffer, Capability, ObjectWriter, check_key, register_backend
from bcp.backends.memory import MemoryBackend, _MemoryWriter


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


class FlatListBackend(MemoryBackend):
    """``list`` does not recurse: only keys one level below the prefix's directory."""

    scheme = "broken-flatlist"

    def list(self, prefix: str = "") -> Iterator[str]:
        depth = prefix.count("/")
        return iter([k for k in super().list(prefix) if k.count("/") == depth])


class OnePageListBackend(MemoryBackend):
    """``list`` reads one page of 1,000 keys, as an S3 client that ignores the
    continuation token does."""

    scheme = "broken-onepage"

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(sorted(super().list(prefix))[:1000])


#: Seconds a delete-first replace leaves the key missing (long enough for racing readers to see).
REPLACE_WINDOW = 0.005


class _DeleteFirstWriter(_MemoryWriter):
    """Replaces as WebDAV's MOVE does (RFC 4918): the old object is deleted first, then
    the new one appears; readers in between find nothing, never a mix."""

    backend: DeleteFirstBackend

    def _commit(self) -> None:
        if self.backend.exists(self.key):
            self.backend.delete(self.key)
            self.backend.in_window(self.key)
            time.sleep(REPLACE_WINDOW)
        super()._commit()


class DeleteFirstBackend(MemoryBackend):
    """A store without atomic replace that does not declare it: fails the atomic
    overwrite check, with a message naming the capability to declare."""

    scheme = "broken-nonatomic"

    def __init__(self, uri: str, root: str) -> None:
        super().__init__(uri, root)
        self.window_hooks: list = []  # called with the key while it is missing (tests)
        self._hook_lock = threading.Lock()

    def in_window(self, key: str) -> None:
        with self._hook_lock:
            hooks = list(self.window_hooks)
        for hook in hooks:
            hook(key)

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _DeleteFirstWriter(self, key, size)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        super().write_if_absent(key, data)  # a new key: atomic, as on WebDAV (If-None-Match: *)


class DeclaredNonAtomicBackend(DeleteFirstBackend):
    """The same store, declaring what it is: must pass the suite."""

    scheme = "nonatomic-declared"
    capabilities = DeleteFirstBackend.capabilities | Capability.NON_ATOMIC_REPLACE


for _cls in (
    VisibleEarlyBackend,
    OffByOneReadsBackend,
    FlatListBackend,
    OnePageListBackend,
    DeleteFirstBackend,
    DeclaredNonAtomicBackend,
):
    register_backend(_cls.scheme, _cls, clobber=True)
