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

from typing import Self

import fsspec
import fsspec.core

from .errors import annotate
from .options import check_part_size
from .streaming import Stream, StreamedFileBackend, stream_options

DEFAULT_PART = 8 << 20


class FsspecBackend(StreamedFileBackend):
    scheme = "fsspec"

    def __init__(self, uri: str, fs: fsspec.AbstractFileSystem, root: str, *, part_size: int, concurrency: int) -> None:
        super().__init__(uri, root, part_size=part_size, concurrency=concurrency)
        self.fs = fs
        self.scheme = uri.split("://", 1)[0]

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Self:
        scheme, _, rest = uri.partition("://")
        protocol = scheme.removeprefix("fsspec+")
        if not protocol:
            raise ValueError(f"generic fsspec URI needs a protocol: fsspec+PROTOCOL://path, got {uri!r}")
        part_size, concurrency = stream_options(options, default_part=DEFAULT_PART)
        check_part_size(part_size, minimum=64 << 10)
        try:
            fs, root = fsspec.core.url_to_fs(f"{protocol}://{rest}", **options)
        except ValueError as e:
            raise ValueError(f"fsspec has no filesystem for protocol {protocol!r} in {uri!r}: {e}") from e
        return cls(uri, fs, root, part_size=part_size, concurrency=concurrency)

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

    # -- filesystem primitives -------------------------------------------------------------

    def _create(self, path: str) -> Stream:
        parent = path.rpartition("/")[0]
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        return self.fs.open(path, "wb")

    def _rename(self, source: str, target: str) -> None:
        self.fs.mv(source, target)

    def _remove_file(self, path: str) -> None:
        self.fs.rm_file(path)

    def _file_size(self, path: str) -> int:
        info = self.fs.info(path)
        if info.get("type") == "directory":
            raise FileNotFoundError(path)
        return int(info["size"])

    def _is_file(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def _is_dir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def _remove_tree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    def _find_files(self, directory: str) -> list[str]:
        try:
            found = self.fs.find(directory, withdirs=False)
        except FileNotFoundError:
            return []
        # Some filesystems answer with a leading "/" that the root does not have.
        return list(found) if self.base.startswith("/") else [path.lstrip("/") for path in found]
