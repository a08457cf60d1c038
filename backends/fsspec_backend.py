"""Any fsspec filesystem: ``fsspec+<protocol>://...`` (and ``webhdfs://``).

For stores bcp has no dedicated backend for (Azure ``abfs``, ``sftp``, ``webhdfs``,
``oci``, ...). Objects are written front to back into a hidden temporary file and
renamed into place at commit (:mod:`bcp.backends.streaming`); whether that rename is
atomic is up to the filesystem (it is on local, HDFS and SFTP filesystems; object
stores implement it as copy-then-delete, and the copy is atomic). Reads are ranged
``cat_file`` calls. Options other than ``part_size`` and ``concurrency`` go to the
filesystem's constructor (fsspec "storage options"); bcp never logs them, but
prefer each filesystem's own credential sources to passing secrets here.

The dedicated S3/GCS backends are faster (parallel part uploads); use this one for
them only to compare.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Self

import fsspec
import fsspec.core

from .base import Backend, Capability, IOHints, ObjectWriter, check_key
from .errors import annotate
from .options import as_int, as_size
from .streaming import PARTIAL_PREFIX, StreamingWriter, partial_name

DEFAULT_PART = 8 << 20


class FsspecBackend(Backend):
    scheme = "fsspec"
    network = True
    capabilities = Capability.RANGED_READ | Capability.PARALLEL_WRITES

    def __init__(self, uri: str, fs: fsspec.AbstractFileSystem, root: str, *, part_size: int, concurrency: int) -> None:
        super().__init__(uri)
        self.fs, self.root = fs, root.rstrip("/")
        self.part_size, self.concurrency = part_size, concurrency
        self.scheme = uri.split("://", 1)[0]

    @classmethod
    def from_uri(cls, uri: str, **options) -> Self:
        scheme, _, rest = uri.partition("://")
        protocol = scheme.removeprefix("fsspec+")
        if not protocol:
            raise ValueError(f"generic fsspec URI needs a protocol: fsspec+PROTOCOL://path, got {uri!r}")
        part_size = as_size("part_size", options.pop("part_size", DEFAULT_PART))
        concurrency = as_int("concurrency", options.pop("concurrency", 4), minimum=1)
        if part_size % (64 << 10) or not (64 << 10) <= part_size <= (32 << 20):
            raise ValueError(f"option part_size={part_size}: must be 64KiB..32MiB and a multiple of 64KiB")
        try:
            fs, root = fsspec.core.url_to_fs(f"{protocol}://{rest}", **options)
        except ValueError as e:
            raise ValueError(f"fsspec has no filesystem for protocol {protocol!r} in {uri!r}: {e}") from e
        return cls(uri, fs, root, part_size=part_size, concurrency=concurrency)

    @property
    def hints(self) -> IOHints:
        # Whole contiguous parts: the stream is sequential, parts stage and checksum in parallel.
        return IOHints(part_size=self.part_size, concurrency=self.concurrency)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if self.root else check_key(key)

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _FsspecWriter(self, key, size)

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        path = self._path(key)
        with annotate(self.uri, key, "reading"):
            try:
                if len(view) == 0:
                    self.size(key)
                    return 0
                data = self.fs.cat_file(path, start=offset, end=offset + len(view))
            except IsADirectoryError as e:
                raise FileNotFoundError(path) from e
        view[: len(data)] = data
        return len(data)

    def size(self, key: str) -> int:
        with annotate(self.uri, key, "sizing"):
            info = self.fs.info(self._path(key))
            if info.get("type") == "directory":
                raise FileNotFoundError(self._path(key))
        return int(info["size"])

    def list(self, prefix: str = "") -> Iterator[str]:
        base = f"{self.root}/" if self.root else ""
        directory = (base + prefix).rpartition("/")[0] or self.root
        with annotate(self.uri, prefix, "listing"):
            try:
                found = self.fs.find(directory, withdirs=False) if directory else self.fs.find("", withdirs=False)
            except FileNotFoundError:
                return
        want = base + prefix
        for path in found:
            path = path.lstrip("/") if not base.startswith("/") else path
            if path.startswith(want) and not path.rpartition("/")[2].startswith(PARTIAL_PREFIX):
                yield path[len(base):]

    def delete(self, key: str) -> None:
        with annotate(self.uri, key, "deleting"):
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass

    def exists(self, key: str) -> bool:
        with annotate(self.uri, key, "checking"):
            return bool(self.fs.isfile(self._path(key)))

    def delete_prefix(self, prefix: str) -> None:
        """A directory prefix is removed whole, with killed writers' partial files."""
        if prefix.endswith("/"):
            path = self._path(prefix.rstrip("/"))
            with annotate(self.uri, prefix, "deleting"):
                if self.fs.isdir(path):
                    self.fs.rm(path, recursive=True)
                    return
        super().delete_prefix(prefix)


class _FsspecWriter(StreamingWriter):
    def __init__(self, backend: FsspecBackend, key: str, size: int | None) -> None:
        super().__init__(backend.uri, key, size)
        self.backend = backend
        self.final = backend._path(key)
        self.temp = partial_name(self.final)

    def open_stream(self):
        fs = self.backend.fs
        with annotate(self.backend.uri, self.key, "writing"):
            parent = self.final.rpartition("/")[0]
            if parent:
                fs.makedirs(parent, exist_ok=True)
            return fs.open(self.temp, "wb")

    def publish(self) -> None:
        with annotate(self.backend.uri, self.key, "committing"):
            self.backend.fs.mv(self.temp, self.final)

    def discard(self) -> None:
        try:
            self.backend.fs.rm_file(self.temp)
        except (FileNotFoundError, OSError):
            pass
