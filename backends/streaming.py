"""A writer for stores that can only write a file front to back, then rename it.

HDFS and most fsspec filesystems offer a sequential output stream and a rename, not
writes at offsets. :class:`StreamingWriter` takes ``write_at`` calls in any order,
writes those that continue the stream at once, and holds copies of those that arrive
early until the gap before them is filled (backends using it declare a
``part_size`` hint, so the engine writes whole contiguous parts and only the few
parts in flight can arrive early); gaps nobody fills read back as zeros. The stream goes to a hidden temporary name beside the
final one; ``commit`` closes it and renames it into place, ``abort`` deletes it.
"""

from __future__ import annotations

import abc
import threading
import uuid
from typing import Protocol

from .base import Buffer, ObjectWriter

#: Temporary files start with this; backends hide them from ``list``.
PARTIAL_PREFIX = ".bcp-partial-"


class Stream(Protocol):
    """A sequential output stream (fsspec file, pyarrow output stream)."""

    def write(self, data: Buffer, /) -> object: ...

    def close(self) -> None: ...


def partial_name(final_path: str) -> str:
    """A unique hidden sibling of ``final_path`` for the stream being written."""
    head, _, tail = final_path.rpartition("/")
    name = f"{PARTIAL_PREFIX}{uuid.uuid4().hex[:16]}-{tail}"
    return f"{head}/{name}" if head else name


class StreamingWriter(ObjectWriter):
    """Subclasses open, write to, close, rename and delete the temporary file.

    A commit after a successful one is a no-op (a retry whose first answer was lost);
    a failed commit is not retryable: the stream is gone, so the writer is aborted."""

    idempotent_commit = True

    def __init__(self, uri: str, key: str, size: int | None) -> None:
        super().__init__(uri, key)
        self.size = size
        self._lock = threading.Lock()
        self._position = 0
        self._early: dict[int, bytes] = {}  # offset -> bytes waiting for the gap before them
        self._stream: Stream | None = None

    # -- for subclasses ----------------------------------------------------------------------

    @abc.abstractmethod
    def open_stream(self) -> Stream:
        """Open the temporary file for writing; return a stream with write() and close()."""

    @abc.abstractmethod
    def publish(self) -> None:
        """Rename the (closed) temporary file to the final name, replacing any object there."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Delete the temporary file if it exists."""

    # -- ObjectWriter hooks -------------------------------------------------------------------

    def _write_at(self, offset: int, data: Buffer) -> None:
        with self._lock:
            if self._stream is None:
                self._stream = self.open_stream()
            if offset < self._position or offset in self._early:
                raise ValueError(f"overlapping write of {self.key!r} at offset {offset}")
            if offset > self._position:
                self._early[offset] = bytes(data)  # bounded: the caller has few writes in flight
                return
            self._emit(data)
            self._drain()

    def _emit(self, data: Buffer) -> None:
        if len(data):
            self._stream.write(data)
            self._position += len(data)

    def _drain(self) -> None:
        while self._early:
            nxt = min(self._early)
            if nxt > self._position:
                return
            self._emit(self._early.pop(nxt))

    def _commit(self) -> None:
        with self._lock:
            if self._stream is None:
                self._stream = self.open_stream()
            # Gaps the caller never wrote (alignment padding) read back as zeros.
            while self._early:
                nxt = min(self._early)
                if nxt > self._position:
                    self._emit(bytes(nxt - self._position))
                self._drain()
            if self.size is not None and self._position < self.size:
                self._emit(bytes(self.size - self._position))
            stream, self._stream = self._stream, None
        try:
            stream.close()
            self.publish()
        except BaseException:
            self.discard()  # _abort discards only while a stream is open, and this one is gone
            raise

    def _abort(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
            self._early.clear()
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
            self.discard()
