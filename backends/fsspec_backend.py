"""Any fsspec filesystem: ``fsspec+<protocol>://...`` (and ``webhdfs://``).

For stores bcp has no dedicated backend for (Azure ``abfs``, ``sftp``, ``webhdfs``,
``oci``, ...). Objects are written front to back into a hidden temporary file and
renamed into place at commit (:mod:`bcp.backends.streaming`); whether that rename is
atomic is up to the filesystem (it is on local, HDFS and SFTP filesystems; object
stores implement it as copy-then-delete, and the copy is atomic). Reads are ranged
``cat_file`` calls. Options other than ``part_size``, ``concurrency`` and the retry
options go to the filesystem's constructor (fsspec "storage options") when it names
them (its ``__init__`` or a base class's, or fsspec's own listing-cache options);
any other is refused, as every backend refuses options it does not know, and a
value from the URI's query is converted to the type of the parameter's default
(``?use_listings_cache=false`` is False, ``=maybe`` is refused). bcp never logs
them, but prefer each filesystem's own credential sources to passing secrets here.

The dedicated S3/GCS backends are faster (parallel part uploads); use this one for
them only to compare.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Self

import fsspec
import fsspec.core

from bcp.backends.storage_errors import annotate
from bcp.backends.streaming import Stream, StreamedFileBackend, stream_options
from bcp.backends.uri_options import as_bool, as_float, as_int, check_part_size, reject_unknown

DEFAULT_PART = 8 << 20


#: Taken by every fsspec filesystem (``AbstractFileSystem`` passes them to its
#: listing cache or instance cache from ``**storage_options``), with their types.
_COMMON_OPTIONS: dict[str, type] = {
    "use_listings_cache": bool,
    "listings_expiry_time": float,
    "max_paths": int,
    "skip_instance_cache": bool,
}


def filesystem_options(fs_class: type, kind: str, uri: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked against what ``fs_class`` takes: the keyword parameters of
    its ``__init__`` and its bases' (a filesystem's ``**kwargs`` reach its bases), and
    fsspec's common ones. TypeError naming the others. Text values (from a URI's
    query) become the type of the parameter's default: bool, int or float; ValueError
    naming the option when they do not parse."""
    known: dict[str, type | None] = dict(_COMMON_OPTIONS)
    for klass in reversed(fs_class.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a C-level or otherwise opaque signature
            continue
        for p in parameters:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                default = p.default
                kind_of = type(default) if isinstance(default, bool | int | float) else None
                known[p.name] = kind_of if kind_of is not None else known.get(p.name)
    reject_unknown(kind, uri, {k: v for k, v in options.items() if k not in known}, known=known)
    checked = dict(options)
    for name, value in options.items():
        wanted = known[name]
        if not isinstance(value, str) or wanted is None:
            continue
        if wanted is bool:
            checked[name] = as_bool(name, value)
        elif wanted is int:
            checked[name] = as_int(name, value, minimum=-(2**63))
        else:
            checked[name] = as_float(name, value, minimum=-math.inf)
    return checked


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
            fs_class = fsspec.get_filesystem_class(protocol)
        except ValueError as e:
            raise ValueError(f"fsspec has no filesystem for protocol {protocol!r} in {uri!r}: {e}") from e
        if "::" not in rest:  # a chained URL's options are per protocol; fsspec checks those
            options = filesystem_options(fs_class, scheme, uri.partition("?")[0], options)
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

    def _info(self, path: str) -> dict[str, Any] | None:
        """``fs.info``, None for a path that is not there. Not fsspec's isfile, isdir or
        find: they answer False or nothing for any error, so an unreachable store looked
        empty (a resume started from scratch)."""
        try:
            return dict(self.fs.info(path))
        except FileNotFoundError:
            return None

    def _is_file(self, path: str) -> bool:
        info = self._info(path)
        return info is not None and info.get("type") == "file"

    def _is_dir(self, path: str) -> bool:
        info = self._info(path)
        return info is not None and info.get("type") == "directory"

    def _remove_tree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    def _find_files(self, directory: str) -> list[str]:
        if directory and self._info(directory) is None:  # find() hides a failing store's errors
            return []
        try:
            found = self.fs.find(directory, withdirs=False)
        except FileNotFoundError:
            return []
        # Some filesystems answer with a leading "/" that the root does not have.
        return list(found) if self.base.startswith("/") else [path.lstrip("/") for path in found]
