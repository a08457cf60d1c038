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
overwrite can briefly find it missing: over any filesystem but the local one the
backend declares ``Capability.NON_ATOMIC_REPLACE``, and bcp commits an overwrite by
deleting the old manifest and creating the new one (``bcp.commit``).
"""

from __future__ import annotations

from typing import Self
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

from bcp.backends.base import Capability
from bcp.backends.storage_errors import annotate
from bcp.backends.streaming import Stream, StreamedFileBackend, stream_options
from bcp.backends.uri_options import as_int, as_size, reject_unknown

DEFAULT_PART = 8 << 20


class ArrowFsBackend(StreamedFileBackend):
    """A bcp backend over any ``pyarrow.fs.FileSystem`` rooted at ``root``."""

    scheme = "arrow"

    def __init__(
        self, uri: str, fs: pafs.FileSystem, root: str, *, part_size: int = DEFAULT_PART, concurrency: int = 4
    ) -> None:
        super().__init__(uri, root, part_size=part_size, concurrency=concurrency)
        self.fs = fs
        if not isinstance(fs, pafs.LocalFileSystem):  # _rename deletes the target first
            self.capabilities = type(self).capabilities | Capability.NON_ATOMIC_REPLACE

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Self:
        raise TypeError("ArrowFsBackend wraps a pyarrow filesystem: build it with ArrowFsBackend(uri, fs, root)")

    @property
    def base(self) -> str:
        return self.root + "/"  # pyarrow paths are absolute: an empty root is "/"

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        path = self._path(key)
        with annotate(self.uri, key, "reading"):
            total = self._file_size(path)
        n = max(0, min(len(view), total - offset))
        if n == 0:
            return 0
        with annotate(self.uri, key, "reading"), self.fs.open_input_file(path) as f:
            f.seek(offset)
            got = 0
            while got < n:
                step = f.readinto(view[got:n])
                if not step:
                    break
                got += step
        return got

    # -- filesystem primitives -------------------------------------------------------------

    def _create(self, path: str) -> Stream:
        self.fs.create_dir(path.rpartition("/")[0], recursive=True)
        return self.fs.open_output_stream(path)

    def _rename(self, source: str, target: str) -> None:
        fs = self.fs
        if not isinstance(fs, pafs.LocalFileSystem) and fs.get_file_info(target).type == pafs.FileType.File:
            fs.delete_file(target)  # HDFS rename does not replace (see module notes)
        fs.move(source, target)

    def _remove_file(self, path: str) -> None:
        self.fs.delete_file(path)

    def _file_size(self, path: str) -> int:
        info = self.fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(path)
        return info.size

    def _is_file(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def _is_dir(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.Directory

    def _remove_tree(self, path: str) -> None:
        self.fs.delete_dir(path)

    def _find_files(self, directory: str) -> list[str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(directory, recursive=True, allow_not_found=True))
        except NotADirectoryError:  # the prefix's directory part names an object
            return []
        return [info.path for info in infos if info.type == pafs.FileType.File]


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
    def from_uri(cls, uri: str, **options: object) -> Self:
        part_size, concurrency = stream_options(options, default_part=DEFAULT_PART)
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
