"""A writer for stores that can only write a file front to back, then rename it.

HDFS and most fsspec filesystems offer a sequential output stream and a rename, not
writes at offsets. :class:`StreamingWriter` takes ``write_at`` calls in any order,
writes those that continue the stream at once, and holds copies of those that arrive
early until the gap before them is filled (backends using it declare a
``part_size`` hint, so the engine writes whole contiguous parts and only the few
parts in flight can arrive early); gaps nobody fills read back as zeros. The stream
goes to a hidden temporary name beside the final one; ``commit`` closes it and
renames it into place, ``abort`` deletes it.

:class:`StreamedFileBackend` is the rest of what such stores share (paths below a
root, listing that hides partial files, deleting a directory prefix whole); the
fsspec and pyarrow/HDFS backends implement its few filesystem primitives.
"""

from __future__ import annotations

import abc
import threading
import uuid
from collections.abc import Iterator
from typing import Protocol

from bcp.backends.base import REQUEST_GAP_BYTES, Backend, Buffer, Capability, IOHints, ObjectWriter, check_key
from bcp.backends.storage_errors import StorageError, annotate
from bcp.backends.uri_options import as_int, as_size

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
    a failed commit is not retryable: the stream is gone, so the writer is aborted.
    Nor is a failed write: the stream may hold part of its bytes (s3fs buffers them
    before the upload that failed), so writing them again would duplicate them. Every
    later write or commit raises a StorageError naming the first failure, one that
    no retry loop repeats."""

    idempotent_commit = True

    def __init__(self, uri: str, key: str, size: int | None) -> None:
        super().__init__(uri, key)
        self.size = size
        self._lock = threading.Lock()
        self._position = 0
        self._early: dict[int, bytes] = {}  # offset -> bytes waiting for the gap before them
        self._stream: Stream | None = None
        self._broken: BaseException | None = None  # the write that left the stream unknown

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

    def _open(self) -> Stream:
        """The stream, opened by the first write or the commit. Call with the lock held."""
        if self._stream is None:
            self._stream = self.open_stream()
        return self._stream

    def _write_at(self, offset: int, data: Buffer) -> None:
        with self._lock:
            self._check_stream("writing")
            stream = self._open()
            if offset < self._position or offset in self._early:
                raise ValueError(f"overlapping write of {self.key!r} at offset {offset}")
            if offset > self._position:
                self._early[offset] = bytes(data)  # bounded: the caller has few writes in flight
                return
            self._emit(stream, data)
            self._drain(stream)

    def _emit(self, stream: Stream, data: Buffer) -> None:
        if len(data):
            try:
                stream.write(data)
            except BaseException as e:
                self._broken = e
                raise
            self._position += len(data)

    def _check_stream(self, action: str) -> None:
        """A StorageError, not transient and chained to nothing (a retry loop stops at it),
        once a write to the stream failed. Call with the lock held."""
        if (e := self._broken) is not None:
            raise StorageError(
                f"an earlier write to its stream failed ({type(e).__name__}: {e}); a stream cannot be written "
                "again where it failed, so this object is abandoned",
                uri=self.uri,
                key=self.key,
                action=action,
            )

    def _drain(self, stream: Stream) -> None:
        while self._early:
            nxt = min(self._early)
            if nxt > self._position:
                return
            self._emit(stream, self._early.pop(nxt))

    def _commit(self) -> None:
        with self._lock:
            self._check_stream("committing")
            stream = self._open()
            # Gaps the caller never wrote (alignment padding) read back as zeros.
            while self._early:
                nxt = min(self._early)
                if nxt > self._position:
                    self._emit(stream, bytes(nxt - self._position))
                self._drain(stream)
            if self.size is not None and self._position < self.size:
                self._emit(stream, bytes(self.size - self._position))
            self._stream = None
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


class StreamedFileBackend(Backend):
    """What the streamed-file family (generic fsspec, pyarrow/HDFS) shares: keys are
    paths below ``root``, objects are written by :class:`StreamedFileWriter`, partial
    files are hidden from ``list``, a directory prefix is deleted whole. Subclasses
    implement the filesystem primitives below, ``read_into`` and ``from_uri``."""

    network = True
    capabilities = Capability.RANGED_READ | Capability.PARALLEL_WRITES

    def __init__(self, uri: str, root: str, *, part_size: int, concurrency: int) -> None:
        super().__init__(uri)
        self.root = root.rstrip("/")
        self.part_size, self.concurrency = part_size, concurrency

    @property
    def hints(self) -> IOHints:
        # Whole contiguous parts: the stream is sequential, parts stage and checksum in parallel.
        return IOHints(part_size=self.part_size, concurrency=self.concurrency, read_gap_bytes=REQUEST_GAP_BYTES)

    @property
    def base(self) -> str:
        """What precedes a key in its path: ``root/``, or nothing at a filesystem's top."""
        return f"{self.root}/" if self.root else ""

    def _path(self, key: str) -> str:
        return self.base + check_key(key)

    # -- filesystem primitives, for subclasses -------------------------------------------------

    @abc.abstractmethod
    def _create(self, path: str) -> Stream:
        """Create ``path``'s directory if needed and open ``path`` for writing."""

    @abc.abstractmethod
    def _rename(self, source: str, target: str) -> None:
        """Move the closed file ``source`` to ``target``, replacing a file there."""

    @abc.abstractmethod
    def _remove_file(self, path: str) -> None:
        """Delete the file ``path``; FileNotFoundError if it is missing."""

    @abc.abstractmethod
    def _file_size(self, path: str) -> int:
        """Size of the file ``path``; FileNotFoundError if it is missing or a directory."""

    @abc.abstractmethod
    def _is_file(self, path: str) -> bool: ...

    @abc.abstractmethod
    def _is_dir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def _remove_tree(self, path: str) -> None:
        """Delete the directory ``path`` and everything under it."""

    @abc.abstractmethod
    def _find_files(self, directory: str) -> list[str]:
        """Paths of every file under ``directory``, recursively, spelled as ``_path``
        spells them; empty when the directory does not exist."""

    # -- the contract ------------------------------------------------------------------------

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return StreamedFileWriter(self, key, size)

    def size(self, key: str) -> int:
        with annotate(self.uri, key, "sizing"):
            return self._file_size(self._path(key))

    def exists(self, key: str) -> bool:
        with annotate(self.uri, key, "checking"):
            return self._is_file(self._path(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.base
        want = base + prefix
        with annotate(self.uri, prefix, "listing"):
            found = self._find_files(want.rpartition("/")[0])
        for path in found:
            if path.startswith(want) and not path.rpartition("/")[2].startswith(PARTIAL_PREFIX):
                yield path[len(base) :]

    def delete(self, key: str) -> None:
        with annotate(self.uri, key, "deleting"):
            try:
                self._remove_file(self._path(key))
            except FileNotFoundError:
                pass

    def delete_prefix(self, prefix: str) -> None:
        """A directory prefix is removed whole, with killed writers' partial files."""
        if prefix.endswith("/"):
            path = self._path(prefix.rstrip("/"))
            with annotate(self.uri, prefix, "deleting"):
                if self._is_dir(path):
                    self._remove_tree(path)
                    return
        super().delete_prefix(prefix)


class StreamedFileWriter(StreamingWriter):
    """Streams into a hidden sibling of the final path, renamed into place at commit."""

    def __init__(self, backend: StreamedFileBackend, key: str, size: int | None) -> None:
        super().__init__(backend.uri, key, size)
        self.backend = backend
        self.final = backend._path(key)
        self.temp = partial_name(self.final)

    def open_stream(self) -> Stream:
        with annotate(self.backend.uri, self.key, "writing"):
            return self.backend._create(self.temp)

    def publish(self) -> None:
        with annotate(self.backend.uri, self.key, "committing"):
            self.backend._rename(self.temp, self.final)

    def discard(self) -> None:
        try:
            self.backend._remove_file(self.temp)
        except OSError:  # FileNotFoundError included: nothing to delete
            pass


def stream_options(options: dict, *, default_part: int) -> tuple[int, int]:
    """Pop ``part_size`` and ``concurrency`` (default 4), the options every streamed-file
    backend takes."""
    part_size = as_size("part_size", options.pop("part_size", default_part))
    concurrency = as_int("concurrency", options.pop("concurrency", 4), minimum=1)
    return part_size, concurrency
