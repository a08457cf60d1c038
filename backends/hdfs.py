"""HDFS through pyarrow (``hdfs://namenode:port/path``), and any pyarrow filesystem.

:class:`ArrowFsBackend` drives a ``pyarrow.fs.FileSystem``: objects stream into a
hidden temporary file and are renamed into place at commit
(:mod:`bcp.backends.streaming`); reads are positional reads of an input file.
:class:`HDFSBackend` builds a ``pyarrow.fs.HadoopFileSystem``, which needs a Hadoop
client on the machine (libhdfs via JNI: JAVA_HOME, HADOOP_HOME, CLASSPATH from
``hadoop classpath --glob``); Kerberos through the ticket cache (``kerb_ticket=``) or
the Hadoop configuration, never credentials in the URI.

Not tested against a live HDFS cluster (none can run where bcp is developed): the
backend logic is tested through the same class over pyarrow's local filesystem, and
an HDFS user checks their cluster with ``bcp conformance hdfs://...``. On HDFS,
replacing an existing object removes it before the rename, so a reader racing an
overwrite can briefly find it missing (bcp overwrites only a manifest, and only
with ``overwrite=True``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Self
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

from .base import Backend, Capability, IOHints, ObjectWriter, check_key
from .errors import annotate
from .options import as_int, as_size, reject_unknown
from .streaming import PARTIAL_PREFIX, StreamingWriter, partial_name

DEFAULT_PART = 8 << 20


class ArrowFsBackend(Backend):
    """A bcp backend over any ``pyarrow.fs.FileSystem`` rooted at ``root``."""

    scheme = "arrow"
    network = True
    capabilities = Capability.RANGED_READ | Capability.PARALLEL_WRITES

    def __init__(self, uri: str, fs: pafs.FileSystem, root: str, *, part_size: int = DEFAULT_PART,
                 concurrency: int = 4) -> None:
        super().__init__(uri)
        self.fs, self.root = fs, root.rstrip("/")
        self.part_size, self.concurrency = part_size, concurrency

    @classmethod
    def from_uri(cls, uri: str, **options) -> Self:
        raise TypeError("ArrowFsBackend wraps a pyarrow filesystem: build it with ArrowFsBackend(uri, fs, root)")

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=self.part_size, concurrency=self.concurrency)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _file_info(self, key: str, action: str) -> pafs.FileInfo:
        with annotate(self.uri, key, action):
            info = self.fs.get_file_info(self._path(key))
            if info.type != pafs.FileType.File:
                raise FileNotFoundError(self._path(key))
        return info

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _ArrowWriter(self, key, size)

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        total = self._file_info(key, "reading").size
        n = max(0, min(len(view), total - offset))
        if n == 0:
            return 0
        with annotate(self.uri, key, "reading"), self.fs.open_input_file(self._path(key)) as f:
            f.seek(offset)
            got = 0
            while got < n:
                step = f.readinto(view[got:n])
                if not step:
                    break
                got += step
        return got

    def size(self, key: str) -> int:
        return self._file_info(key, "sizing").size

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.root + "/"
        directory = (base + prefix).rpartition("/")[0]
        with annotate(self.uri, prefix, "listing"):
            try:
                infos = self.fs.get_file_info(pafs.FileSelector(directory, recursive=True, allow_not_found=True))
            except NotADirectoryError:  # the prefix's directory part names an object
                return
        want = base + prefix
        for info in infos:
            if info.type == pafs.FileType.File and info.path.startswith(want) \
                    and not info.base_name.startswith(PARTIAL_PREFIX):
                yield info.path[len(base):]

    def delete(self, key: str) -> None:
        with annotate(self.uri, key, "deleting"):
            try:
                self.fs.delete_file(self._path(key))
            except FileNotFoundError:
                pass

    def exists(self, key: str) -> bool:
        with annotate(self.uri, key, "checking"):
            return self.fs.get_file_info(self._path(key)).type == pafs.FileType.File

    def delete_prefix(self, prefix: str) -> None:
        """A directory prefix is removed whole, with killed writers' partial files."""
        if prefix.endswith("/"):
            path = self._path(prefix.rstrip("/"))
            with annotate(self.uri, prefix, "deleting"):
                if self.fs.get_file_info(path).type == pafs.FileType.Directory:
                    self.fs.delete_dir(path)
                    return
        super().delete_prefix(prefix)


class _ArrowWriter(StreamingWriter):
    def __init__(self, backend: ArrowFsBackend, key: str, size: int | None) -> None:
        super().__init__(backend.uri, key, size)
        self.backend = backend
        self.final = backend._path(key)
        self.temp = partial_name(self.final)

    def open_stream(self):
        with annotate(self.backend.uri, self.key, "writing"):
            self.backend.fs.create_dir(self.final.rpartition("/")[0], recursive=True)
            return self.backend.fs.open_output_stream(self.temp)

    def publish(self) -> None:
        fs = self.backend.fs
        with annotate(self.backend.uri, self.key, "committing"):
            if not isinstance(fs, pafs.LocalFileSystem) and fs.get_file_info(self.final).type == pafs.FileType.File:
                fs.delete_file(self.final)  # HDFS rename does not replace (see module notes)
            fs.move(self.temp, self.final)

    def discard(self) -> None:
        try:
            self.backend.fs.delete_file(self.temp)
        except (FileNotFoundError, OSError):
            pass


def hdfs_connection(uri: str, options: dict) -> tuple[dict, str]:
    """HadoopFileSystem keyword arguments and the root path for ``uri`` (pops the
    options it uses). ``hdfs://default/path`` uses the configured default namenode."""
    parts = urlsplit(uri)
    kwargs: dict = {"host": parts.hostname or "default", "port": parts.port or 0}
    for name in ("user", "kerb_ticket"):
        if name in options:
            kwargs[name] = str(options.pop(name))
    if "replication" in options:
        kwargs["replication"] = as_int("replication", options.pop("replication"), minimum=1)
    if "buffer_size" in options:
        kwargs["buffer_size"] = as_size("buffer_size", options.pop("buffer_size"))
    root = unquote(parts.path).rstrip("/") or "/"
    return kwargs, root


class HDFSBackend(ArrowFsBackend):
    """Options: ``user``, ``kerb_ticket`` (ticket cache path), ``replication``,
    ``buffer_size``, ``part_size`` (default 8MiB), ``concurrency`` (default 4) and
    the retry options."""

    scheme = "hdfs"

    @classmethod
    def from_uri(cls, uri: str, **options) -> Self:
        part_size = as_size("part_size", options.pop("part_size", DEFAULT_PART))
        concurrency = as_int("concurrency", options.pop("concurrency", 4), minimum=1)
        kwargs, root = hdfs_connection(uri, options)
        reject_unknown("hdfs", uri, options)
        try:
            fs = pafs.HadoopFileSystem(**kwargs)
        except OSError as e:
            raise OSError(
                f"cannot connect to HDFS for {uri}: {e}. pyarrow needs a Hadoop client: set JAVA_HOME, "
                "HADOOP_HOME and CLASSPATH=$(hadoop classpath --glob) (ARROW_LIBHDFS_DIR if libhdfs.so is elsewhere)"
            ) from e
        return cls(uri, fs, root, part_size=part_size, concurrency=concurrency)
