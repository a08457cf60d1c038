"""Local and mounted POSIX filesystems (NVMe, NFS, Lustre, ...).

Writes go to a hidden partial file beside the target, with positional writes
(``os.pwrite``) straight from the caller's buffer, then ``fsync``, an atomic
``rename`` and an ``fsync`` of the directory (of directories it made: while writing,
on a thread), so an object is either complete and durable or not there. Page-aligned
writes of whole pages use ``O_DIRECT`` (option ``direct``, on by default where the
filesystem accepts it): it skips the page cache, whose first-touch cost made
buffered writes 3-4x slower here (docs/benchmarks.md).
Create-only writes use ``link(2)``, which fails atomically when the name exists.
Reads use ``os.preadv`` into the caller's buffer: no Python copies.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Self
from urllib.parse import unquote, urlsplit

from bcp.backends import file_writes
from bcp.backends.base import FILE_GAP_BYTES, Backend, Buffer, Capability, IOHints, ObjectWriter, Unfinished, check_key
from bcp.backends.file_reads import (
    DIRECT_ALIGN,
    DIRECT_READ_FROM,
    NOFOLLOW,
    FileReader,
    direct_split,
    is_cached,
    on_memory_fs,
    pread_cold,
    pread_full,
)
from bcp.backends.file_writes import DirSync, DirSyncs, byte_views, cut, cut_end, pwritev_all, whole_pages
from bcp.backends.storage_errors import ObjectExistsError, StorageError, WriterClosedError, annotate
from bcp.backends.uri_options import as_bool, reject_unknown

log = logging.getLogger(__name__)

#: ``scheme://`` at the start: a URI (one this backend refuses unless it is ``file://``)
_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")

#: Marks an unfinished write. Keys may not contain it; ``list`` never shows such files.
PARTIAL_MARKER = ".bcp-partial-"


def _fchmod_path(path: str, mode: int, flags: int) -> None:
    """Set ``path``'s permission bits through a descriptor opened without following a link."""
    fd = os.open(path, flags | NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


class FileBackend(Backend):
    """Objects are files under a root directory; keys are relative paths."""

    scheme = "file"
    capabilities = Capability.CREATE_ONLY | Capability.RANGED_READ | Capability.PARALLEL_WRITES | Capability.POSIX

    def __init__(
        self,
        root: str,
        *,
        fsync: bool = True,
        direct: bool = True,
        direct_reads: bool = True,
        file_mode: int | None = None,
    ) -> None:
        """``file_mode``: the permission bits of every file this backend creates, set
        with ``fchmod`` whatever the umask, and of the directories it creates (with the
        search bit beside each read bit: 0o600 gives 0o700); None (the default): 0o644
        and 0o777 less the umask, as ``open`` and ``mkdir`` give them. Only a caller's
        argument, never a URI option: the local tier passes 0o600 (docs/tiers.md,
        "Security")."""
        if file_mode is not None and (isinstance(file_mode, bool) or not 0 <= file_mode <= 0o777):
            raise ValueError(f"file_mode must be permission bits from 0 to 0o777, got {file_mode!r}")
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root)
        self.root = root
        self.fsync = fsync
        #: write page-aligned parts with O_DIRECT (bypassing the page cache) where supported
        self.direct = direct and hasattr(os, "O_DIRECT")
        #: large reads take what the page cache holds, and read the rest with O_DIRECT
        self.direct_reads = direct_reads and hasattr(os, "O_DIRECT")
        #: directories below the root found not to be symbolic links (see _refuse_links)
        self._checked_dirs: set[str] = set()
        #: the syncs of directories writers made, still running (or failed)
        self._dir_syncs = DirSyncs()
        #: permission bits of created files (None: the umask's), and of created directories
        self.file_mode = file_mode
        self._dir_mode = None if file_mode is None else file_mode | ((file_mode & 0o444) >> 2)

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Self:
        """``file:///abs/path``, ``file://localhost/abs/path``, ``file:/abs/path`` (RFC
        8089's one-slash form; percent-escapes decoded), or a plain path taken as it is
        (``bcp.backends.backend_for`` refuses a ``?`` in one before it gets here)."""
        if uri[:5].lower() == "file:" or _URI_RE.match(uri):
            parts = urlsplit(uri)
            if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
                raise ValueError(f"not a local file URI: {uri!r} (use file:///absolute/path or a plain path)")
            if parts.fragment or uri.endswith("#"):
                raise ValueError(
                    f"{uri!r}: a file URI has no #fragment; a name that holds '#' is written %23 in a file URI"
                )
            path = unquote(parts.path)
            if not path.startswith("/"):
                raise ValueError(
                    f"{uri!r}: a file URI names an absolute path (file:///abs/path or file:/abs/path); "
                    "write a relative path as a plain path, without file:"
                )
        else:
            path = uri
        fsync = as_bool("fsync", options.pop("fsync", True))
        direct = as_bool("direct", options.pop("direct", True))
        direct_reads = as_bool("direct_reads", options.pop("direct_reads", True))
        reject_unknown("file", uri.partition("?")[0], options, known=("fsync", "direct", "direct_reads"))
        return cls(path, fsync=fsync, direct=direct, direct_reads=direct_reads)

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=None, concurrency=4, aligned_writes=self.direct, read_gap_bytes=FILE_GAP_BYTES)

    def _path(self, key: str) -> str:
        check_key(key)
        if PARTIAL_MARKER in key:
            raise ValueError(f"invalid object key {key!r}: contains the reserved {PARTIAL_MARKER!r}")
        path = os.path.join(self.root, *key.split("/"))
        self._refuse_links(key, path)
        return path

    def _refuse_links(self, key: str, path: str, *, final: bool = True, cached: bool = False) -> None:
        """Never follow a symbolic link below the root: a checkpoint copied from
        elsewhere may hold links that point anywhere (a data file linked to a secret,
        a step directory linked to another tree that a delete would then empty). The
        root itself may be a link; that is the user's choice. Only a read (``cached``:
        its bytes are checked against the catalog) trusts the directories checked
        before (one ``lstat`` per new directory): a write, a delete or a listing checks
        every one again, since one may have been replaced by a link since."""
        parts = key.split("/")
        at = self.root
        for i, part in enumerate(parts):
            at = os.path.join(at, part)
            last = i == len(parts) - 1
            if cached and not last and at in self._checked_dirs:
                continue
            if last and not final:
                return
            try:
                mode = os.lstat(at).st_mode
            except FileNotFoundError:
                return  # nothing further down exists, so nothing can be a link
            except OSError:
                return  # the operation itself reports it
            if stat.S_ISLNK(mode):
                raise StorageError(
                    "is a symbolic link; bcp never follows links inside a checkpoint",
                    uri=self.uri,
                    key="/".join(parts[: i + 1]),
                    action="opening",
                )
            if not last and stat.S_ISDIR(mode):
                self._checked_dirs.add(at)

    def _make_dirs(self, path: str) -> list[str]:
        """Create missing directories; those it created (synced by :class:`DirSyncs`)."""
        made: list[str] = []
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o777 if self._dir_mode is None else self._dir_mode)
            except FileExistsError:
                continue
            if self._dir_mode is not None:
                _fchmod_path(d, self._dir_mode, os.O_RDONLY | os.O_DIRECTORY)
            made.append(d)
        return made

    # -- writing -----------------------------------------------------------------------

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _FileWriter(self, key, size)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        final = self._path(key)
        writer = _FileWriter(self, key, len(data))
        linked = False
        try:
            if len(data):
                writer.write_at(0, data)
            writer.flush_and_close()
            with annotate(self.uri, key, "creating"):
                try:
                    os.link(writer.tmp, final)
                except OSError as e:
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                        raise
                    # No hard links on this filesystem: fall back to check-then-rename (racy).
                    if os.path.exists(final):
                        raise FileExistsError(final) from e
                    os.rename(writer.tmp, final)
                linked = True
                if self.fsync:
                    file_writes.fsync_dir(os.path.dirname(final))
        finally:
            try:
                writer.abort()  # the partial file: linked into place or not, it goes
            except OSError as e:
                if not linked:
                    raise
                # The object is created: a partial file left behind is only space (gc removes it).
                log.warning("created %r in %s but could not remove its partial file: %s", key, self.uri, e)

    # -- reading -----------------------------------------------------------------------

    def _read_path(self, key: str) -> str:
        """:meth:`_path` for a read, at less cost (a load reads a data file in many
        pieces): the key's checks are remembered, and the last component is not
        ``lstat``-ed, because the read opens it with O_NOFOLLOW, which refuses a link
        there (:meth:`_open_for_read`). Where O_NOFOLLOW is missing: :meth:`_path`."""
        if not NOFOLLOW:
            return self._path(key)
        path = _key_path(self.root, key)
        self._refuse_links(key, path, final=False, cached=True)
        return path

    def _open_for_read(self, key: str, path: str) -> int:
        """A read descriptor for ``path``; a link as the last component is refused as
        :meth:`_refuse_links` refuses it (O_NOFOLLOW fails with ELOOP)."""
        try:
            return os.open(path, os.O_RDONLY | NOFOLLOW)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise StorageError(
                "is a symbolic link; bcp never follows links inside a checkpoint",
                uri=self.uri,
                key=key,
                action="opening",
            ) from None

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        path = self._read_path(key)
        with annotate(self.uri, key, "reading"):
            fd = self._open_for_read(key, path)
            try:
                view = memoryview(buffer).cast("B")
                if not self.direct_reads or len(view) < DIRECT_READ_FROM or on_memory_fs(fd):
                    return pread_full(fd, view, offset)
                if is_cached(fd, path, len(view), offset):  # someone read it through the page cache: use that
                    return pread_full(fd, view, offset)
                return pread_cold(fd, path, view, offset)
            except IsADirectoryError as e:  # open(2) accepts a directory; it is not an object
                raise FileNotFoundError(errno.ENOENT, "not an object (a directory)", path) from e
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Callable[[int, memoryview], None]]:
        """One descriptor for many reads of ``key``: reads below
        :data:`~.file_reads.DIRECT_READ_FROM` (a load's pieces from memory) are a
        ``preadv`` each, without the open, the checks and the close of :meth:`read_into`
        (about a tenth of a warm load's CPU time, read in 2 MiB pieces); larger ones go
        through :meth:`read_exact`, which chooses O_DIRECT as usual. Adjacent small reads
        can be one ``preadv`` (``read_into_many``: :func:`bcp.backends.read_into_many`)."""
        path = self._read_path(key)
        with annotate(self.uri, key, "reading"):
            fd = self._open_for_read(key, path)
        try:
            exact = functools.partial(self.read_exact, key)
            yield FileReader(self.uri, key, path, fd, exact if self.direct_reads else None)
        finally:
            os.close(fd)

    def in_memory(self, key: str, offset: int, nbytes: int) -> bool:
        """Whether the file lies on tmpfs or ramfs, or the range is in the page cache
        (the probe ``read_into`` makes before a large read: :func:`is_cached`)."""
        try:
            path = self._read_path(key)
            fd = self._open_for_read(key, path)
            try:
                return on_memory_fs(fd) or is_cached(fd, path, nbytes, offset)
            finally:
                os.close(fd)
        except (OSError, StorageError, ValueError):  # advice only: the read itself reports the error
            return False

    def size(self, key: str) -> int:
        path = self._path(key)
        with annotate(self.uri, key, "sizing"):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(path)
            return st.st_size

    def exists(self, key: str) -> bool:
        try:
            path = self._path(key)
        except StorageError:  # a link is not an object
            return False
        return os.path.isfile(path) and not os.path.islink(path)

    def list(self, prefix: str = "") -> Iterator[str]:
        # Walk only the deepest directory the prefix names, then filter by string prefix.
        for key, _path, _partial in self._walk(prefix):
            if not _partial:
                yield key

    def _walk(self, prefix: str, *, empty_dirs: bool = False) -> Iterator[tuple[str, str, bool]]:
        """(key, path, is a partial file) of every regular file under ``prefix``;
        symbolic links are neither listed nor followed. With ``empty_dirs``, also
        (``<dir>/``, path, True) for each empty directory below the root."""
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._path(head) if head else self.root
        if not os.path.isdir(base) or (head and os.path.islink(base)):
            return
        with annotate(self.uri, prefix, "listing"):
            for dirpath, dirs, files in os.walk(base):  # never descends into linked directories
                rel = os.path.relpath(dirpath, self.root)
                rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                if empty_dirs and rel and not dirs and not files and rel.startswith(prefix):
                    yield rel, dirpath, True
                for name in files:
                    key = rel + name
                    path = os.path.join(dirpath, name)
                    if key.startswith(prefix) and not os.path.islink(path):
                        yield key, path, PARTIAL_MARKER in name

    def unfinished(self, prefix: str = "") -> Iterator[Unfinished]:
        """Partial files left by writers that were killed, and directories left empty
        (named with a trailing ``/``: a writer killed after creating them, a cleanup
        that stopped halfway); their age is since they last changed."""
        now = time.time()
        for key, path, partial in self._walk(prefix, empty_dirs=True):
            if partial:
                try:
                    age = now - os.lstat(path).st_mtime
                except FileNotFoundError:  # its writer just committed or aborted
                    continue
                yield Unfinished(key, age)

    def delete_unfinished(self, name: str) -> None:
        is_dir = name.endswith("/")
        key = name.rstrip("/") if is_dir else name
        check_key(key)
        if not is_dir and PARTIAL_MARKER not in key.rsplit("/", 1)[-1]:
            raise ValueError(f"{name!r} is not a partial file")
        path = os.path.join(self.root, *key.split("/"))
        self._refuse_links(key, path)
        with annotate(self.uri, name, "deleting"):
            try:
                os.rmdir(path) if is_dir else os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                if not (is_dir and e.errno == errno.ENOTEMPTY):  # written to since: not garbage
                    raise
                return
        self._prune_empty(os.path.dirname(path))

    # -- deleting ----------------------------------------------------------------------

    def delete_prefix(self, prefix: str) -> None:
        """A directory prefix goes in one ``rmtree``, which also removes the partial
        files of writers that were killed (``list`` hides those)."""
        if prefix.endswith("/") and os.path.isdir(path := self._path(prefix.rstrip("/"))):
            with annotate(self.uri, prefix, "deleting"):
                shutil.rmtree(path)  # removes links found inside, never what they point to
            self._prune_empty(os.path.dirname(path))
            return
        super().delete_prefix(prefix)

    def delete(self, key: str) -> None:
        check_key(key)
        path = os.path.join(self.root, *key.split("/"))
        self._refuse_links(key, path, final=False)  # unlinking a link removes the link only
        with annotate(self.uri, key, "deleting"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            self._prune_empty(os.path.dirname(path))

    def _prune_empty(self, directory: str) -> None:
        """Directories are not objects: drop the ones a delete emptied, up to the root."""
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)
            except OSError:
                break
            directory = os.path.dirname(directory)


@functools.lru_cache(maxsize=4096)
def _key_path(root: str, key: str) -> str:
    """The path of ``key`` under ``root`` after the key checks of :meth:`FileBackend._path`
    (a bad key raises, and is not remembered)."""
    check_key(key)
    if PARTIAL_MARKER in key:
        raise ValueError(f"invalid object key {key!r}: contains the reserved {PARTIAL_MARKER!r}")
    return os.path.join(root, *key.split("/"))


class _FileWriter(ObjectWriter):
    """A hidden partial file beside the target, renamed into place at commit."""

    def __init__(self, backend: FileBackend, key: str, size: int | None) -> None:
        super().__init__(backend.uri, key)
        self.backend = backend
        self.final = backend._path(key)
        self.tmp = f"{self.final}{PARTIAL_MARKER}{uuid.uuid4().hex[:12]}"
        self.fd: int | None = None
        self.dfd: int | None = None
        #: the fsyncs of the directories above it that writers made, waited for before the commit
        self._dirs: list[DirSync] = []
        #: page-aligned memory for the bytes ``write_parts`` copies (one request at a time)
        self._scratch: memoryview | None = None
        self._scratch_lock = threading.Lock()
        with annotate(backend.uri, key, "opening for write"):
            fd = self.fd = self._create_partial()
            if backend.direct:
                try:
                    self.dfd = os.open(self.tmp, os.O_WRONLY | os.O_DIRECT)
                except OSError as e:  # tmpfs and some network filesystems refuse O_DIRECT
                    if e.errno != errno.EINVAL:
                        self.abort()
                        raise
            if size and on_memory_fs(fd):
                # tmpfs, ramfs: preallocating allocates every page on the caller's path
                # (0.06 s for 256 MiB of /dev/shm here, before the writes' 0.075 s; the
                # writes into a sparse file take 0.098 s, in the writer threads) and
                # cannot prevent fragmentation; the file gets its size, sparse (gaps
                # the writes skip read as zeros, as after fallocate)
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    self.abort()
                    raise
            elif size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:  # tmpfs, some network filesystems cannot preallocate
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
                        self.abort()
                        raise

    def _create_partial(self) -> int:
        """Create the partial file (and its directory); its descriptor."""
        attempts_left = 3
        while True:
            backend = self.backend  # the syncs: waited for by flush_and_close (a retry's, the first's too)
            self._dirs += backend._dir_syncs.make(os.path.dirname(self.final), backend._make_dirs, backend.fsync)
            try:
                mode = self.backend.file_mode
                # link-ok: O_CREAT|O_EXCL fails on any existing name, a planted link or FIFO included
                fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode)
            except FileNotFoundError:
                # A concurrent delete pruned the directory we just made: make it again.
                attempts_left -= 1
                if not attempts_left:
                    raise
                continue
            if mode is not None:
                try:
                    os.fchmod(fd, mode)  # exactly these bits, whatever the umask took away
                except OSError:
                    os.close(fd)
                    os.unlink(self.tmp)
                    raise
            return fd

    def _write_at(self, offset: int, data: Buffer) -> None:
        fd, dfd = self.fd, self.dfd
        if fd is None:  # closed by a commit or abort that raced this write
            raise WriterClosedError("the partial file was already closed", uri=self.uri, key=self.key, action="writing")
        view = memoryview(data).cast("B")
        with annotate(self.backend.uri, self.key, "writing"):
            if dfd is None or (split := direct_split(view, offset)) is None:
                self._pwrite(fd, view, offset)
                return
            head, middle = split
            self._pwrite(fd, view[:head], offset)  # partial pages go through the page cache
            self._pwrite(dfd, view[head : head + middle], offset + head)
            self._pwrite(fd, view[head + middle :], offset + head + middle)

    def write_parts(self, offset: int, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` at ``offset``, as ``write_at(offset,
        b"".join(parts))`` would, without the join: the whole pages go out in O_DIRECT
        ``pwritev`` calls of many parts each, straight from the parts' memory where a
        part's page-aligned bytes lie page-aligned in memory; a page that several parts
        share (tensor edges, padding) or whose bytes lie unaligned is copied into an
        aligned page first (a few KiB a part). Only the partial pages at either end go
        through the page cache. Why: one request a tensor (2.5 MiB on average for a
        transformer's state) kept this disk at a third of its sequential speed, and each
        tensor's two partial pages were two more writes (docs/decisions.md, "Sync save:
        one request per 64 MiB")."""
        fd, dfd = self.fd, self.dfd
        if fd is None:  # closed by a commit or abort that raced this write
            raise WriterClosedError("the partial file was already closed", uri=self.uri, key=self.key, action="writing")
        views = byte_views(parts)
        total = sum(map(len, views))
        with annotate(self.backend.uri, self.key, "writing"):
            head = (-offset) % DIRECT_ALIGN
            middle = (total - head) // DIRECT_ALIGN * DIRECT_ALIGN if total > head else 0
            if dfd is None or not middle:
                pwritev_all(fd, views, offset)
                return
            first, rest = cut(views, head)
            inner, last = cut_end(rest, total - head - middle)  # from the end: a few parts, not all
            pwritev_all(fd, first, offset)  # partial pages go through the page cache
            with self._scratch_lock:  # taken while in use: a concurrent call makes its own
                scratch, self._scratch = self._scratch, None
            if scratch is None or len(scratch) < middle:  # kept from request to request, and save to save
                scratch = file_writes.take_scratch(middle)
            pwritev_all(dfd, whole_pages(inner, middle, scratch), offset + head)
            self._scratch = scratch  # the request is done with it (pwritev returned)
            pwritev_all(fd, last, offset + head + middle)

    @staticmethod
    def _pwrite(fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def flush_and_close(self) -> None:
        """Make the partial file durable and close it (``write_if_absent`` then links it)."""
        self._give_scratch()
        with annotate(self.backend.uri, self.key, "flushing"):
            if self.dfd is not None:
                dfd, self.dfd = self.dfd, None
                os.close(dfd)
            if self.fd is not None:
                fd, self.fd = self.fd, None
                try:
                    if self.backend.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            for sync in self._dirs:  # the entries of the directories above it, durable
                sync.wait()

    def _commit(self) -> None:
        self.flush_and_close()
        with annotate(self.backend.uri, self.key, "committing"):
            os.rename(self.tmp, self.final)
            if self.backend.fsync:
                file_writes.fsync_dir(os.path.dirname(self.final))

    def _give_scratch(self) -> None:
        with self._scratch_lock:
            scratch, self._scratch = self._scratch, None
        file_writes.give_scratch(scratch)

    def _abort(self) -> None:
        self._give_scratch()
        if self.dfd is not None:
            dfd, self.dfd = self.dfd, None
            os.close(dfd)
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


__all__ = ["PARTIAL_MARKER", "FileBackend", "ObjectExistsError"]


def file_directory(backend: Backend) -> str | None:
    """The local directory of a backend that stores files in one (the file backend, or a
    wrapper or plugin built on it), else None: where callers must check links and
    directories themselves."""
    inner = backend.unwrap()
    return inner.root if isinstance(inner, FileBackend) else None
