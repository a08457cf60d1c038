"""How the file backend reads: positional reads into the caller's buffer, O_DIRECT for
large cold ranges (through a bounce buffer where the buffer and file offset disagree on
page alignment), and the two questions a read asks first: does the file live in memory
(tmpfs, ramfs), and is this range already in the page cache. Kept apart from
backends/file.py, which owns keys, links, writes and listing.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from bcp.backends.base import Buffer
from bcp.backends.storage_errors import annotate

#: Opening a final component that is a link fails (ELOOP) instead of following it.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

DIRECT_ALIGN = 4096


def reopen(path: str, flags: int, like: int | None) -> int:
    """``path`` opened again (``flags``) for a read already open as ``like``: never through
    a link, never waiting on a FIFO planted there since (O_NONBLOCK; no effect on a
    regular file), and an error (ESTALE) unless it is the very file ``like`` holds."""
    fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (like is not None and not os.path.samestat(st, os.fstat(like))):
            raise OSError(errno.ESTALE, "replaced while being read (not the file opened)", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def flat_bytes(buffer: Buffer) -> memoryview:
    """``buffer`` as a flat byte view: a flat one as it is (one check, not a new view: the
    reads and writes of a load or save of many small tensors pass thousands of them)."""
    b = buffer
    if type(b) is memoryview and b.format == "B" and b.ndim == 1 and b.c_contiguous:
        return b
    return memoryview(b).cast("B")


def buffer_address(view: memoryview) -> int | None:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # read-only buffer
        return None


#: Reads at least this large use O_DIRECT for their whole pages when ``direct_reads``.
DIRECT_READ_FROM = 4 << 20


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def iov_max() -> int:
    """The most buffers one ``preadv`` takes (IOV_MAX, 1024 on Linux)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        n = -1
    return n if n > 0 else 16  # POSIX's least IOV_MAX where the system does not say


IOV_MAX = iov_max()


def preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` (byte views) with consecutive bytes from ``offset``: one ``preadv``
    per :data:`IOV_MAX` buffers, looping on short reads. The bytes read: fewer than
    asked only where the file ends."""
    got = 0
    for g in range(0, len(views), IOV_MAX):
        group = views[g : g + IOV_MAX]
        want = sum(map(len, group))  # flat byte views: len is nbytes
        done = 0
        while done < want:
            n = os.preadv(fd, group, offset + got)
            if n == 0:
                return got
            got += n
            done += n
            if done < want:  # short: drop the buffers filled, cut the one partly filled
                while n >= group[0].nbytes:
                    n -= group[0].nbytes
                    group = group[1:]
                group = [group[0][n:], *group[1:]]
    return got


#: statfs(2) f_type of the filesystems that keep files in memory: tmpfs, ramfs
MEMORY_FS_TYPES = frozenset({0x01021994, 0x858458F6})
#: st_dev -> whether that filesystem keeps its files in memory (one fstatfs per filesystem)
_memory_devices: dict[int, bool] = {}


def on_memory_fs(fd: int) -> bool:
    """Whether the open file lies on tmpfs or ramfs: its pages are always in memory, a
    read is a copy, and the page-cache probe (RWF_NOWAIT, which tmpfs refuses) and
    O_DIRECT would only add system calls. False where fstatfs(2) cannot say."""
    dev = os.fstat(fd).st_dev
    known = _memory_devices.get(dev)
    if known is None:
        known = _memory_devices[dev] = fs_type(fd) in MEMORY_FS_TYPES
    return known


def fs_type(fd: int) -> int | None:
    """statfs(2) f_type of the filesystem holding ``fd`` (Linux; None elsewhere or on error)."""
    if (libc := _libc()) is None:  # not Linux
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if libc.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def is_cached(fd: int, path: str, nbytes: int, offset: int) -> bool:
    """Whether the range of the open file ``fd`` (at ``path``) is in the page cache (most
    of its middle), asked without reading it: cachestat(2) (Linux 6.5+), else mincore(2)
    of a one-page mapping of its middle, else a one-page RWF_NOWAIT read on a descriptor
    of its own. The read is the last resort because on a miss it still reads that page: a
    second probe of the range then answered yes, and a load read its cold ranges through
    the page cache instead of O_DIRECT (bulk reads at about half the disk's speed)."""
    for probe in (cached_share, cached_middle_page):
        answer = probe(fd, offset, nbytes)
        if answer is not None:
            return answer
    own = reopen(path, os.O_RDONLY, fd)  # readahead turned off on this one only
    try:
        return nowait_probe(own, offset + nbytes // 2)
    finally:
        os.close(own)


#: cachestat(2)'s number, the same on every Linux architecture (added in 6.5)
_CACHESTAT = 451
_probes_unavailable: set[str] = set()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with errno kept, its mmap/munmap/mincore typed (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


#: the part of a range the cachestat probe looks at, around its middle (cachestat walks
#: every page asked about: about 0.5 ms for 64 MiB, 10 us for this)
PROBE_WINDOW = 1 << 20
#: the probes' argument types, made once: ``c_uint64 * 2`` in a call makes a new class a
#: call, a reference cycle left to the garbage collector after every load
_RANGE, _CACHESTAT_OUT, _VEC = ctypes.c_uint64 * 2, ctypes.c_uint64 * 5, ctypes.c_ubyte * 1


def cached_share(fd: int, offset: int, nbytes: int) -> bool | None:
    """Whether at least half the pages of the range's middle :data:`PROBE_WINDOW` are
    cached, by cachestat(2); None where the kernel lacks it or refuses it for this file."""
    if "cachestat" in _probes_unavailable or (libc := _libc()) is None:
        return None
    window = min(max(nbytes, 1), PROBE_WINDOW)
    first = (offset + (nbytes - window) // 2) // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(offset + (nbytes + window) // 2 - first) // mmap.PAGESIZE)
    rng = _RANGE(first, pages * mmap.PAGESIZE)
    stat = _CACHESTAT_OUT()
    if libc.syscall(ctypes.c_long(_CACHESTAT), ctypes.c_uint(fd), rng, stat, ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _probes_unavailable.add("cachestat")
        return None
    return 2 * stat[0] >= pages


def cached_middle_page(fd: int, offset: int, nbytes: int) -> bool | None:
    """Whether the range's middle page is cached, by mincore(2) of a mapping of it (a
    mapping reads nothing until touched). None where mincore would not tell the truth:
    since Linux 5.0 it reports every page of a file the caller neither owns nor may write
    as cached."""
    if (libc := _libc()) is None:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() and not os.access(f"/proc/self/fd/{fd}", os.W_OK):
        return None
    page = (offset + nbytes // 2) // mmap.PAGESIZE * mmap.PAGESIZE
    if page >= st.st_size:
        return None
    addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, page)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = _VEC()
        if libc.mincore(ctypes.c_void_p(addr), mmap.PAGESIZE, vec) != 0:
            return None
        return bool(vec[0] & 1)
    finally:
        libc.munmap(ctypes.c_void_p(addr), mmap.PAGESIZE)


def nowait_probe(fd: int, at: int) -> bool:
    """A one-page preadv2 with RWF_NOWAIT and readahead off: fails rather than waits on a
    page not cached (but reads that page in the background)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        scratch = bytearray(4096)
        return os.preadv(fd, [scratch], at // 4096 * 4096, flag) > 0
    except BlockingIOError:
        return False
    except OSError as e:  # kernels or filesystems without RWF_NOWAIT
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return False
        raise


def open_direct(path: str, like: int | None = None) -> tuple[int, bool]:
    """A read descriptor with O_DIRECT, or a buffered one where the filesystem refuses it
    (:func:`reopen`: the file ``like`` holds, if given)."""
    try:
        return reopen(path, os.O_RDONLY | os.O_DIRECT, like), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return reopen(path, os.O_RDONLY, like), False


def pread_direct(path: str, view: memoryview, offset: int, like: int | None = None) -> int:
    """Read whole pages bypassing the page cache; a short read at end of file is
    returned as such (``like``: :func:`open_direct`)."""
    fd, _direct = open_direct(path, like)
    try:
        return pread_full(fd, view, offset)
    finally:
        os.close(fd)


_BOUNCE_BYTES = 8 << 20
_bounce = threading.local()


def pread_bounced(path: str, view: memoryview, offset: int, like: int | None = None) -> int:
    """O_DIRECT reads of the aligned pages covering the range into a reusable
    page-aligned per-thread buffer, copied into ``view`` (a memcpy is several times
    faster than the disk; a buffered read of a cold file here was 2-3x slower)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = mmap.mmap(-1, _BOUNCE_BYTES)  # page-aligned, reused by this thread
    mv = memoryview(buf)
    fd, direct = open_direct(path, like)
    try:
        if not direct:
            return pread_full(fd, view, offset)
        got, end = 0, offset + len(view)
        start = offset // DIRECT_ALIGN * DIRECT_ALIGN
        while start < end:
            want = min(_BOUNCE_BYTES, -(-(end - start) // DIRECT_ALIGN) * DIRECT_ALIGN)
            n = pread_full(fd, mv[:want], start)
            lo = max(offset, start)
            hi = min(end, start + n)
            if hi <= lo:
                break
            view[lo - offset : hi - offset] = mv[lo - start : hi - start]
            got = hi - offset
            if n < want:
                break
            start += want
        return got
    finally:
        os.close(fd)


def pread_cold(fd: int, path: str, view: memoryview, offset: int) -> int:
    """A large read of a range not in the page cache: its whole pages O_DIRECT straight
    into ``view`` where memory and file agree modulo 4096 (the unaligned head and tail
    through ``fd``, prefetched first), else bounced through aligned memory."""
    split = direct_split(view, offset)
    if split is None:
        return pread_bounced(path, view, offset, fd)
    head, middle = split
    prefetch_edges(fd, offset, head, middle, len(view))
    mid = pread_direct(path, view[head : head + middle], offset + head, fd)
    got = pread_full(fd, view[:head], offset)
    if got == head:
        got += mid
        if mid == middle:
            got += pread_full(fd, view[head + middle :], offset + got)
    return got


def prefetch_edges(fd: int, offset: int, head: int, middle: int, nbytes: int) -> None:
    """Ask the kernel to start reading the buffered head and tail of a direct read
    (``head`` bytes from ``offset``, the rest after ``middle``) before the direct middle
    is sent: read after it, they are then in memory, where each read alone waited behind
    the other streams' large requests with no large one of its own in flight."""
    tail = nbytes - head - middle
    if head:
        os.posix_fadvise(fd, offset, head, os.POSIX_FADV_WILLNEED)
    if tail > 0:
        os.posix_fadvise(fd, offset + head + middle, tail, os.POSIX_FADV_WILLNEED)


def direct_split(view: memoryview, offset: int) -> tuple[int, int] | None:
    """(head, middle) byte counts when the middle of the write can go O_DIRECT: it needs
    file offset and memory address aligned to 4096 together, so they must agree
    modulo 4096. None when they do not (or when there is no whole page)."""
    if not len(view):
        return None
    address = buffer_address(view)
    if address is None or (address - offset) % DIRECT_ALIGN:
        return None
    head = (-offset) % DIRECT_ALIGN
    middle = (len(view) - head) // DIRECT_ALIGN * DIRECT_ALIGN if len(view) > head else 0
    return (head, middle) if middle else None


class FileReader:
    """The reader ``FileBackend.reading`` yields, on one open descriptor:
    ``reader(offset, buffer)`` and ``reader.read_into_many(offset, buffers)``
    (:func:`bcp.backends.read_into_many`). ``exact``: the backend's ``read_exact`` for
    reads of :data:`DIRECT_READ_FROM` or more (O_DIRECT), None when it reads none so."""

    __slots__ = ("exact", "fd", "key", "path", "uri")

    def __init__(self, uri: str, key: str, path: str, fd: int, exact: Callable[[int, memoryview], None] | None) -> None:
        self.uri, self.key, self.path, self.fd, self.exact = uri, key, path, fd, exact

    def __call__(self, offset: int, buffer: memoryview) -> None:
        view = memoryview(buffer).cast("B")
        if self.exact is not None and len(view) >= DIRECT_READ_FROM:
            self.exact(offset, view)
            return
        try:
            got = pread_full(self.fd, view, offset)
        except OSError as e:  # as annotate() translates it, without a context manager per read
            self._failed(e)
        if got < len(view):
            self._ended(offset, got, len(view))

    def read_into_many(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` with consecutive bytes from ``offset``: one ``preadv`` per
        :data:`IOV_MAX` buffers (with a large one, one read each, as ``__call__``)."""
        views = list(map(flat_bytes, buffers))  # the bulk load's flat byte views as they are
        want = sum(map(len, views))
        if self.exact is not None and views and max(map(len, views)) >= DIRECT_READ_FROM:
            for v in views:
                self(offset, v)
                offset += len(v)
            return
        try:
            got = preadv_full(self.fd, views, offset)
        except OSError as e:
            self._failed(e)
        if got < want:
            self._ended(offset, got, want)

    def _failed(self, e: OSError) -> NoReturn:
        with annotate(self.uri, self.key, "reading"):
            if isinstance(e, IsADirectoryError):  # open(2) accepts a directory; it is not an object
                raise FileNotFoundError(errno.ENOENT, "not an object (a directory)", self.path) from e
            raise e
        raise AssertionError("annotate re-raises")  # pragma: no cover

    def _ended(self, offset: int, got: int, want: int) -> NoReturn:
        raise EOFError(
            f"{self.key!r} in {self.uri} ended at byte {offset + got}; expected {want} bytes from offset {offset}"
        )
