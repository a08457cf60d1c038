"""The storage side of :mod:`bcp.integrations.dcp`: a write-only stream into one
backend object that checksums as it goes, DCP's filesystem interface over a bcp
backend, and the bcp-owned sidecar of checksums (``.bcp-checksums.json``) that the
writer commits before ``.metadata`` and the reader verifies against. Knows DCP only
through its public ``FileSystemBase``."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from ..backends import Backend, Buffer, Capability, backend_for, registered_backends, split_scheme
from ..errors import FormatError
from ..metadata.checksum import crc32c

#: DCP's metadata object: written last, its presence is what makes a checkpoint complete.
METADATA_KEY = ".metadata"
#: bcp's sidecar: the CRC32C of ``.metadata`` and of every data file, by segment.
CHECKSUMS_KEY = ".bcp-checksums.json"
CHECKSUMS_FORMAT = "bcp-dcp-checksums"
CHECKSUMS_VERSION = 1
#: Part size for stores without one of their own (the file and memory backends).
DEFAULT_PART_BYTES = 8 << 20

#: One data file as written: (name, size, crc32c, ((offset, length, crc32c), ...)).
FileChecksums = tuple[str, int, int, tuple[tuple[int, int, int], ...]]


def is_bcp_uri(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a bcp backend serves ``checkpoint_id`` (a plain path is the file backend's)."""
    scheme, _ = split_scheme(os.fspath(checkpoint_id))
    return scheme in registered_backends()


class ObjectStream:
    """A write-only stream into one backend object, for DCP's writer (which only calls
    ``write``, ``tell``, ``flush`` and ``close``). Bytes are handed to the backend's
    writer a part at a time, several parts at once on stores that take parallel
    writes; the object becomes visible on ``close`` (the writer's commit), never if the
    stream is aborted or abandoned. The CRC32C is taken as bytes arrive: whole, and by
    segments that end wherever ``tell`` is called."""

    def __init__(self, backend: Backend, key: str, on_commit: Callable[[FileChecksums], None]) -> None:
        self.key = key
        self._backend = backend
        self._writer = backend.open_writer(key)
        self._on_commit = on_commit
        hints = backend.hints
        self._part = hints.part_size or DEFAULT_PART_BYTES
        parallel = Capability.PARALLEL_WRITES in backend.capabilities and hints.concurrency > 1
        self._pool = ThreadPoolExecutor(hints.concurrency, thread_name_prefix="bcp-dcp") if parallel else None
        self._in_flight: list[Future[None]] = []
        self._limit = 2 * max(hints.concurrency, 1)
        self._buffer = bytearray()
        self._sent = 0  # bytes handed to the backend's writer
        self._position = 0  # bytes written to this stream
        self._crc = 0
        self._segment_start = 0
        self._segment_crc = 0
        self._segments: list[tuple[int, int, int]] = []
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._crc = crc32c(view, self._crc)
        self._segment_crc = crc32c(view, self._segment_crc)
        self._position += n
        if self._buffer:  # complete the part begun by earlier writes
            take = min(self._part - len(self._buffer), len(view))
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) == self._part:
                self._send(bytes(self._buffer))
                self._buffer.clear()
        while len(view) >= self._part:  # whole parts straight from the caller's buffer
            self._send(bytes(view[: self._part]))
            view = view[self._part :]
        self._buffer += view
        return n

    def tell(self) -> int:
        self._cut()
        return self._position

    def flush(self) -> None:
        """Nothing to do: parts go out when full, the rest on ``close``."""

    def _cut(self) -> None:
        if self._position > self._segment_start:
            self._segments.append((self._segment_start, self._position - self._segment_start, self._segment_crc))
        self._segment_start, self._segment_crc = self._position, 0

    def _send(self, data: bytes) -> None:
        offset, self._sent = self._sent, self._sent + len(data)
        if self._pool is None:
            self._writer.write_at(offset, data)
            return
        while len(self._in_flight) >= self._limit:
            self._in_flight.pop(0).result()
        self._in_flight.append(self._pool.submit(self._writer.write_at, offset, data))

    def close(self) -> None:
        """Send the last part, wait for every part, commit; on any failure abort."""
        if self._done:
            return
        self._done = True
        try:
            if self._buffer:
                self._send(bytes(self._buffer))
                self._buffer.clear()
            for future in self._in_flight:
                future.result()
            self._writer.commit()
        except BaseException:
            self._writer.abort_after_failure()
            raise
        finally:
            self._shutdown()
        self._cut()
        self._on_commit((self.key, self._position, self._crc, tuple(self._segments)))

    def abort(self) -> None:
        """Discard the object: nothing becomes visible."""
        if self._done:
            return
        self._done = True
        for future in self._in_flight:
            future.cancel()
        self._shutdown()
        self._writer.abort_after_failure()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class BackendFileSystem(FileSystemBase):
    """DCP's filesystem interface over a bcp backend rooted at the checkpoint: a
    checkpoint's paths are its keys. Records the checksums of the objects it commits."""

    def __init__(self, storage_options: dict[str, Any]) -> None:
        self.storage_options = storage_options
        self.backend: Backend | None = None
        self.committed: dict[str, FileChecksums] = {}
        self.lock = threading.Lock()

    def at(self) -> Backend:
        if self.backend is None:
            raise RuntimeError("BackendFileSystem used before init_path")
        return self.backend

    def init_path(self, path: str | os.PathLike[str]) -> str:
        uri = os.fspath(path)
        if self.backend is not None:
            self.backend.close()
        self.backend = backend_for(uri, **self.storage_options)
        return uri

    def record(self, checksums: FileChecksums) -> None:
        with self.lock:
            self.committed[checksums[0]] = checksums

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        key = os.fspath(path)
        if mode == "rb":
            yield io.BytesIO(self.at().read(key))
            return
        if mode != "wb":
            raise ValueError(f"{key}: mode {mode!r}; only 'wb' and 'rb' are supported")
        stream = ObjectStream(self.at(), key, self.record)
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return suffix  # the backend is rooted at the checkpoint: names are keys

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        backend = self.at()
        backend.write(os.fspath(new_path), backend.read(os.fspath(path)))
        backend.delete(os.fspath(path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing to do: backends create what a key needs."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_bcp_uri(checkpoint_id)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.at().exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.at().delete(os.fspath(path))


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One data file of the sidecar: its size and its checksummed segments, by offset."""

    size: int
    starts: list[int]
    segments: list[tuple[int, int, int]]


def parse_checksums(raw: bytes, where: str) -> tuple[tuple[int, int], dict[str, FileEntry]]:
    """((size, crc32c) of ``.metadata``, name -> FileEntry) from the sidecar's JSON;
    FormatError naming ``where`` and the field for anything else."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != CHECKSUMS_FORMAT or doc.get("version") != CHECKSUMS_VERSION:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        meta = (int(doc["metadata"]["size"]), int(doc["metadata"]["crc32c"]))
        files = {}
        for name, entry in doc["files"].items():
            segments = sorted((int(o), int(n), int(c)) for o, n, c in entry["segments"])
            files[str(name)] = FileEntry(int(entry["size"]), [s[0] for s in segments], segments)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{where}: not a bcp DCP checksum file: {type(e).__name__}: {e}") from e
    return meta, files
