"""In-process object store: tests, and a fast tier for checkpoints that need not
outlive the process. ``memory://name/prefix``: stores with the same name share objects
across backend instances within one process; nothing crosses process boundaries."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Self
from urllib.parse import unquote, urlsplit

from bcp.backends.base import Backend, Buffer, Capability, IOHints, ObjectWriter, check_key
from bcp.backends.storage_errors import ObjectExistsError, ObjectNotFoundError
from bcp.backends.uri_options import plain_root, reject_unknown

_OBJECTS: dict[str, bytes] = {}
_LOCK = threading.Lock()


def clear_memory_store(name: str | None = None) -> None:
    """Drop every object (or those of one store name). For tests."""
    with _LOCK:
        if name is None:
            _OBJECTS.clear()
        else:
            for k in [k for k in _OBJECTS if k.startswith(name + "/")]:
                del _OBJECTS[k]


class MemoryBackend(Backend):
    scheme = "memory"
    capabilities = Capability.CREATE_ONLY | Capability.RANGED_READ | Capability.PARALLEL_WRITES

    def __init__(self, uri: str, root: str) -> None:
        super().__init__(uri)
        self.root = root.strip("/")

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Self:
        reject_unknown("memory", uri.partition("?")[0], options, known=())
        parts = urlsplit(uri)
        root = plain_root("/".join(p for p in (parts.netloc, unquote(parts.path).strip("/")) if p), uri)
        if not root:
            raise ValueError(f"memory URI needs a store name: memory://NAME[/prefix], got {uri!r}")
        return cls(f"memory://{root}", root)

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=None, concurrency=4)

    def _full(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _MemoryWriter(self, key, size)

    def _put(self, key: str, data: bytes, *, if_absent: bool) -> None:
        full = self._full(key)
        with _LOCK:
            if if_absent and full in _OBJECTS:
                raise ObjectExistsError("object already exists", uri=self.uri, key=key, action="creating")
            _OBJECTS[full] = data

    def write_if_absent(self, key: str, data: Buffer) -> None:
        self._put(key, bytes(data), if_absent=True)

    def _get(self, key: str, action: str) -> bytes:
        try:
            return _OBJECTS[self._full(key)]
        except KeyError:
            raise ObjectNotFoundError("no such object", uri=self.uri, key=key, action=action) from None

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        data = self._get(key, "reading")
        view = memoryview(buffer).cast("B")
        chunk = data[offset : offset + len(view)]
        view[: len(chunk)] = chunk
        return len(chunk)

    def size(self, key: str) -> int:
        return len(self._get(key, "sizing"))

    def exists(self, key: str) -> bool:
        return self._full(key) in _OBJECTS

    def list(self, prefix: str = "") -> Iterator[str]:
        start = self.root + "/"
        with _LOCK:
            keys = [k[len(start) :] for k in _OBJECTS if k.startswith(start)]
        return iter([k for k in keys if k.startswith(prefix)])

    def delete(self, key: str) -> None:
        with _LOCK:
            _OBJECTS.pop(self._full(key), None)


class _MemoryWriter(ObjectWriter):
    """Collects the object in a bytearray; commit stores a copy."""

    def __init__(self, backend: MemoryBackend, key: str, size: int | None) -> None:
        backend._full(key)  # validate now, not at commit
        super().__init__(backend.uri, key)
        self.backend = backend
        self._buf = bytearray(size or 0)
        self._lock = threading.Lock()  # parallel writes may grow the buffer

    def _write_at(self, offset: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            end = offset + len(view)
            if end > len(self._buf):
                self._buf.extend(bytes(end - len(self._buf)))
            self._buf[offset:end] = view

    def _commit(self) -> None:
        with self._lock:
            data, self._buf = bytes(self._buf), bytearray()
        self.backend._put(self.key, data, if_absent=False)

    def _abort(self) -> None:
        with self._lock:
            self._buf = bytearray()
