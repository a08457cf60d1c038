"""The file backend's vectored writes: many buffers, one request (``_FileWriter.write_parts``).

Apart from ``file.py`` to keep each module short; why the writes are vectored is in
docs/decisions.md ("Sync save: one request per 64 MiB").
"""

from __future__ import annotations

import mmap
import os
import threading

from bcp.backends.file_reads import DIRECT_ALIGN, buffer_address

#: The most buffers one ``pwritev`` takes.
IOV_MAX = os.sysconf("SCIOV_MAX") if hasattr(os, "sysconf") and "SCIOV_MAX" in os.sysconf_names else 1024


def cut(views: list[memoryview], nbytes: int) -> tuple[list[memoryview], list[memoryview]]:
    """``views`` split after their first ``nbytes`` bytes."""
    head: list[memoryview] = []
    for i, v in enumerate(views):
        if nbytes >= len(v):
            head.append(v)
            nbytes -= len(v)
            continue
        if nbytes:
            head.append(v[:nbytes])
        return head, [v[nbytes:], *views[i + 1 :]]
    return head, []


def whole_pages(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` (``nbytes`` in all, a multiple of the page) as page-aligned buffers
    of whole pages: runs of whole pages that lie page-aligned in memory as they are,
    everything else copied into aligned pages of a scratch mapping."""
    scratch: mmap.mmap | None = None
    used = 0
    out: list[memoryview] = []
    page: memoryview | None = None  # the scratch page being filled
    fill = 0
    for v in views:
        i, n = 0, len(v)
        address = buffer_address(v)
        while i < n:
            if not fill and n - i >= DIRECT_ALIGN and address is not None and (address + i) % DIRECT_ALIGN == 0:
                k = (n - i) // DIRECT_ALIGN * DIRECT_ALIGN
                out.append(v[i : i + k])
                i += k
                continue
            if page is None:
                if scratch is None:
                    scratch = mmap.mmap(-1, nbytes)  # page-aligned; only the pages used are touched
                # whole pages of this part at once where it has them, else one page
                room = max(DIRECT_ALIGN, (n - i) // DIRECT_ALIGN * DIRECT_ALIGN) if not fill else DIRECT_ALIGN
                page = memoryview(scratch)[used : used + room]
                used += room
            take = min(len(page) - fill, n - i)
            page[fill : fill + take] = v[i : i + take]
            fill += take
            i += take
            if fill == len(page):
                out.append(page)
                page, fill = None, 0
    if page is not None:
        raise ValueError(f"{nbytes} bytes are not whole pages")
    return out


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back from ``offset``, ``IOV_MAX`` at a time, resuming after short writes."""
    views = [v for v in views if len(v)]
    while views:
        group = views[:IOV_MAX]
        done = os.pwritev(fd, group, offset)
        offset += done
        wrote = sum(len(v) for v in group)
        if done == wrote:
            views = views[len(group) :]
            continue
        _written, views = cut(views, done)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirSync:
    """The ``fsync`` of directories a writer created (the entries of its new directories),
    on a thread of its own while the data is written: the writer waits for it before
    its commit's rename (:meth:`wait`), so the object is as durable when the commit
    returns, but a new checkpoint's three directory fsyncs no longer delay its first
    data request (docs/decisions.md, "Sync save: one request per 64 MiB")."""

    def __init__(self, paths: list[str]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(paths,), name="bcp-dirsync", daemon=True)
        self._thread.start()

    def _run(self, paths: list[str]) -> None:
        try:
            for path in paths:
                fsync_dir(path)
        except BaseException as e:  # noqa: BLE001 - raised by wait(), in the writer's thread
            self._error = e

    def wait(self) -> None:
        """Return once every directory is durable; raise what the ``fsync`` raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
