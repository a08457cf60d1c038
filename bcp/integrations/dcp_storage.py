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
import re
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from bcp.backends import Backend, Buffer, Capability, backend_for, registered_backends, split_scheme
from bcp.errors import FormatError
from bcp.metadata.checksum import crc32c

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
        self.uri: str | None = None
        self.committed: dict[str, FileChecksums] = {}
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Without the lock and the open backend (``dcp.async_save`` in process mode
        pickles the writer for its checkpointing process): both are made again there."""
        return {**vars(self), "backend": None, "lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.lock = threading.Lock()
        if self.uri is not None:
            self.backend = backend_for(self.uri, **self.storage_options)

    def at(self) -> Backend:
        if self.backend is None:
            raise RuntimeError("BackendFileSystem used before init_path")
        return self.backend

    def init_path(self, path: str | os.PathLike[str]) -> str:
        uri = os.fspath(path)
        if self.backend is not None:
            self.backend.close()
        self.backend = backend_for(uri, **self.storage_options)
        self.uri = uri
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


#: The sidecar nests four deep (document, files, file, segments, segment); deeper is refused.
MAX_CHECKSUMS_DEPTH = 8
_U32 = 1 << 32


class _Invalid(ValueError):
    """A field of the sidecar that breaks its schema (becomes a FormatError)."""


def _refuse_float(text: str) -> Any:
    raise _Invalid(f"the number {text[:40]} is not an integer")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Invalid("an object repeats a key")
    return out


def _depth(raw: bytes) -> int:
    """How deep the JSON's arrays and objects nest, counted without parsing (so a
    million ``[`` cannot exhaust the parser's recursion); brackets inside strings
    are counted too, an upper bound."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(raw):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


_BRACKETS = re.compile(rb"[\[\]{}]")


def _obj(value: Any, keys: set[str], field: str) -> dict[str, Any]:
    if type(value) is not dict or set(value) != keys:
        got = sorted(value) if type(value) is dict else type(value).__name__
        raise _Invalid(f"{field} must be an object with the keys {sorted(keys)}, not {got}")
    return value


def _int(value: Any, field: str, *, below: int | None = None) -> int:
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        bound = f" below {below}" if below is not None else ""
        raise _Invalid(f"{field} must be a non-negative integer{bound}, not {value!r}"[:200])
    return value


def parse_checksums(raw: bytes, where: str) -> tuple[tuple[int, int], dict[str, FileEntry]]:
    """((size, crc32c) of ``.metadata``, name -> FileEntry) from the sidecar's JSON,
    held to the schema :class:`~bcp.integrations.dcp.BcpStorageWriter` writes: exactly
    its keys, integers that are ints (not floats, bools or strings), CRC32Cs below
    2**32, segments sorted, apart and inside their file, nesting at most
    :data:`MAX_CHECKSUMS_DEPTH`. FormatError naming ``where`` and the field otherwise."""
    try:
        if _depth(raw) > MAX_CHECKSUMS_DEPTH:
            raise _Invalid(f"nests deeper than {MAX_CHECKSUMS_DEPTH}")
        doc = json.loads(
            raw.decode("utf-8"),
            parse_float=_refuse_float,
            parse_constant=_refuse_float,
            object_pairs_hook=_no_duplicates,
        )
        doc = _obj(doc, {"format", "version", "metadata", "files"}, "the document")
        if doc["format"] != CHECKSUMS_FORMAT or type(doc["version"]) is not int or doc["version"] != CHECKSUMS_VERSION:
            raise _Invalid(f"format {doc['format']!r} version {doc['version']!r}"[:200])
        meta_doc = _obj(doc["metadata"], {"size", "crc32c"}, "metadata")
        meta = (_int(meta_doc["size"], "metadata.size"), _int(meta_doc["crc32c"], "metadata.crc32c", below=_U32))
        if type(doc["files"]) is not dict:
            raise _Invalid(f"files must be an object, not {type(doc['files']).__name__}")
        files = {}
        for name, entry in doc["files"].items():
            field = f"files[{name!r}]"
            entry = _obj(entry, {"size", "crc32c", "segments"}, field)
            size = _int(entry["size"], f"{field}.size")
            _int(entry["crc32c"], f"{field}.crc32c", below=_U32)
            if type(entry["segments"]) is not list:
                raise _Invalid(f"{field}.segments must be a list")
            segments: list[tuple[int, int, int]] = []
            for i, seg in enumerate(entry["segments"]):
                if type(seg) is not list or len(seg) != 3:
                    raise _Invalid(f"{field}.segments[{i}] must be [offset, length, crc32c]")
                offset, length = _int(seg[0], f"{field}.segments[{i}]"), _int(seg[1], f"{field}.segments[{i}]")
                crc = _int(seg[2], f"{field}.segments[{i}]", below=_U32)
                end = segments[-1][0] + segments[-1][1] if segments else 0
                if offset < end or offset + length > size:
                    raise _Invalid(
                        f"{field}.segments[{i}] covers bytes {offset}..{offset + length}: not after the one before "
                        f"it and inside the file's {size} bytes"
                    )
                segments.append((offset, length, crc))
            files[name] = FileEntry(size, [s[0] for s in segments], segments)
    except (ValueError, RecursionError) as e:  # _Invalid, JSONDecodeError, UnicodeDecodeError
        raise FormatError(f"{where}: not a bcp DCP checksum file: {e}") from e
    return meta, files
