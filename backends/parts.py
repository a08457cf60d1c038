"""What S3 multipart and GCS composite uploads share: a writer that receives whole
parts (``IOHints.part_size``), uploads each as it arrives, and completes at commit.

An object smaller than one part is kept (copied) and sent in one request at commit.
Anything larger goes part by part; ``commit`` checks that the parts cover the object
before asking the store to assemble it. A second ``commit`` after a successful one is
a no-op (a retry whose first answer was lost), and a commit that failed transiently
may be repeated (``ObjectWriter.idempotent_commit`` and ``retryable_commit``).
"""

from __future__ import annotations

import abc
import base64
import threading
from typing import Any, Generic, TypeVar

import crc32c

from bcp.backends.base import Backend, Buffer, ObjectWriter
from bcp.backends.storage_errors import StorageError, annotate


def crc32c_b64(data: Buffer) -> str:
    """CRC32C as S3 and GCS spell it in headers and metadata: base64 of 4 big-endian bytes."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


#: The store a part writer uploads to (its subclass: the requests are the store's own).
B = TypeVar("B", bound=Backend)


class PartWriter(ObjectWriter, Generic[B]):
    """Subclasses implement ``upload_part``, ``complete``, ``put_whole`` and ``discard``.

    A commit may be repeated: after a success it is a no-op (its answer may have been
    lost), after a transient failure it runs again (the parts are still there)."""

    store = "object store"  # for messages
    idempotent_commit = True
    retryable_commit = True

    def __init__(self, backend: B, key: str, size: int | None, part_size: int) -> None:
        super().__init__(backend.uri, key)
        self.backend: B = backend
        self.size, self.part = size, part_size
        self._lock = threading.Lock()
        self._parts: dict[int, tuple[int, Any]] = {}  # part index -> (end offset, what upload_part returned)
        self._single: bytes | None = None

    # -- for subclasses ---------------------------------------------------------------------

    @abc.abstractmethod
    def upload_part(self, index: int, data: Buffer) -> Any:
        """Upload part ``index`` (0-based); return what ``complete`` needs for it."""

    @abc.abstractmethod
    def complete(self, entries: list[Any], size: int) -> None:
        """Assemble the uploaded parts (in order) into the visible object."""

    @abc.abstractmethod
    def put_whole(self, data: bytes) -> None:
        """Write a small object in one request."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Delete whatever the uploaded parts left on the store. Must not raise."""

    # -- ObjectWriter hooks ----------------------------------------------------------------------

    def _write_at(self, offset: int, data: Buffer) -> None:
        n = len(data)
        if offset % self.part or (n % self.part and self.size is not None and offset + n != self.size):
            raise ValueError(
                f"{self.store} writes of {self.key!r} must start at multiples of part_size={self.part} and be "
                f"whole parts except the last; got {n} bytes at offset {offset}"
            )
        if offset == 0 and n < self.part:
            self._single = bytes(data)  # the whole object: one request at commit
            return
        index = offset // self.part
        with annotate(self.backend.uri, self.key, f"uploading part {index + 1} of"):
            entry = self.upload_part(index, data)
        with self._lock:
            self._parts[index] = (offset + n, entry)

    def _commit(self) -> None:
        if not self._parts:
            with annotate(self.backend.uri, self.key, "writing"):
                self.put_whole(self._single or b"")
            self._single = None
            return
        indices = sorted(self._parts)
        end = self._parts[indices[-1]][0]
        if indices != list(range(len(indices))) or (self.size is not None and end != self.size):
            # Not transient, so the lifecycle aborts the writer (and discards the parts).
            raise StorageError(
                f"parts do not cover the object (parts {indices[:5]}..., end {end}, expected size {self.size})",
                uri=self.backend.uri,
                key=self.key,
                action="committing",
            )
        with annotate(self.backend.uri, self.key, "committing"):
            self.complete([self._parts[i][1] for i in indices], end)
        self._parts = {}
        self.discard()

    def _abort(self) -> None:
        self._single = None
        self._parts = {}
        self.discard()
