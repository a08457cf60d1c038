"""The file backend's vectored writes: many buffers, one request (``_FileWriter.write_parts``).

Apart from ``file.py`` to keep each module short; why the writes are vectored is in
docs/decisions.md ("Sync save: one request per 64 MiB").
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence

from bcp.backends.base import Buffer
from bcp.backends.file_reads import DIRECT_ALIGN, buffer_address, flat_bytes

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


def cut_end(views: list[memoryview], nbytes: int) -> tuple[list[memoryview], list[memoryview]]:
    """``views`` split before their last ``nbytes`` bytes (as :func:`cut` at the
    total less ``nbytes``, looking only at the views it splits off)."""
    tail: list[memoryview] = []
    i = len(views)
    while nbytes and i:
        i -= 1
        v = views[i]
        if nbytes >= len(v):
            tail.append(v)
            nbytes -= len(v)
            continue
        tail.append(v[len(v) - nbytes :])
        return [*views[:i], v[: len(v) - nbytes]], tail[::-1]
    return views[:i], tail[::-1]


def byte_views(parts: Sequence[Buffer]) -> list[memoryview]:
    """The non-empty ``parts`` as flat byte views (a flat one as it is: one check, not
    two new views, for each of a batch's thousands of parts)."""
    return [v for v in map(flat_bytes, parts) if len(v)]


def whole_pages(views: list[memoryview], nbytes: int, scratch: memoryview | None = None) -> list[memoryview]:
    """``views`` (``nbytes`` in all, a multiple of the page) as page-aligned buffers
    of whole pages: each view's whole pages that lie page-aligned in memory as they
    are, every other byte copied to its own position in a scratch mapping as long as
    the request, whose runs of pages between the views' own go out as they are. A few
    integer operations and at most two copies a view (the writer's Python per small
    tensor, issue 37); only the scratch pages written are touched. ``scratch``: a
    page-aligned mapping of at least ``nbytes`` to copy into (a writer's, reused from
    request to request: its pages are faulted in once), else one made for the call."""
    if nbytes % DIRECT_ALIGN:
        raise ValueError(f"{nbytes} bytes are not whole pages")
    if scratch is not None and len(scratch) < nbytes:
        raise ValueError(f"a scratch mapping of {len(scratch)} bytes cannot hold {nbytes}")
    out: list[memoryview] = []
    pos = run = 0  # where the next view goes; where the scratch pages not yet in ``out`` begin
    for v in views:
        n = len(v)
        if not n:
            continue
        end = pos + n
        lo = -(-pos // DIRECT_ALIGN) * DIRECT_ALIGN  # the view's first page boundary
        hi = end // DIRECT_ALIGN * DIRECT_ALIGN  # and its last
        address = buffer_address(v) if hi > lo else None
        if scratch is None:
            scratch = _private_mapping(nbytes)
        if address is None or (address - pos) % DIRECT_ALIGN:  # no whole page of it lies aligned: copied
            scratch[pos:end] = v
        else:
            if lo > pos:
                scratch[pos:lo] = v[: lo - pos]
            if lo > run:
                out.append(scratch[run:lo])
            out.append(v[lo - pos : hi - pos])
            if end > hi:
                scratch[hi:end] = v[hi - pos :]
            run = hi
        pos = end
    if pos != nbytes:
        raise ValueError(f"the buffers hold {pos} bytes, not {nbytes}")
    if nbytes > run:
        assert scratch is not None
        out.append(scratch[run:nbytes])
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
    # link-ok: only fsync is done through it (nothing read or written), O_DIRECTORY refuses
    # anything but a directory, and a root may itself be a link to the storage it names
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirSync:
    """The ``fsync`` of the directories whose entries a writer's new directories
    changed, on a thread of its own while the data is written: the writer waits for
    it before its commit's rename (:meth:`wait`), so the object is as durable when
    the commit returns, and nothing is visible before; a new checkpoint's three
    directory fsyncs no longer delay its first data request (issue 37)."""

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

    def pending(self) -> bool:
        """Whether the ``fsync`` still runs, or failed (a writer must not commit below)."""
        return self._thread.is_alive() or self._error is not None

    def wait(self) -> None:
        """Return once every directory is durable; raise what the ``fsync`` raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error


class DirSyncs:
    """A backend's directory syncs (:class:`DirSync`) still running (or failed), by directory:
    a writer waits for those above it too, not only its own, since the writer that made
    a directory it found may commit after it does."""

    def __init__(self) -> None:
        self._syncs: dict[str, DirSync] = {}
        #: held while directories are made and noted: none is found before its sync is
        self._lock = threading.Lock()

    def make(self, path: str, make_dirs: Callable[[str], list[str]], fsync: bool) -> list[DirSync]:
        """Make ``path`` (``make_dirs``: the directories it made); with ``fsync``, the
        syncs a writer in ``path`` waits for before its commit (its own started here)."""
        with self._lock:
            made = make_dirs(path)
            if not fsync:
                return []
            syncs = self._syncs
            for d in [d for d, sync in syncs.items() if not sync.pending()]:
                del syncs[d]
            waits: list[DirSync] = []
            if made:
                mine = DirSync([os.path.dirname(d) for d in made])
                syncs.update(dict.fromkeys(made, mine))
                waits.append(mine)
            while True:
                other = syncs.get(path)
                if other is not None and other not in waits:
                    waits.append(other)
                up = os.path.dirname(path)
                if up == path:
                    return waits
                path = up


#: The scratch mapping of the last writer that closed, for the next one (its pages stay
#: faulted in: a save of many small tensors copies tens of MiB into it; at most one kept).
_spare: list[memoryview] = []
_spare_lock = threading.Lock()


def take_scratch(nbytes: int) -> memoryview:
    """A page-aligned mapping of at least ``nbytes`` (the spare one when large enough)."""
    with _spare_lock:
        if _spare and len(_spare[0]) >= nbytes:
            return _spare.pop()
    return _private_mapping(max(nbytes, SCRATCH_BYTES))


def _private_mapping(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory of this process alone: ``mmap(-1, n)`` alone is
    MAP_SHARED, so after a fork the parent and the child would copy into the same pages
    (a spare kept from save to save: each would write the other's bytes to its files)."""
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE))


def give_scratch(scratch: memoryview | None) -> None:
    """Keep ``scratch`` for the next writer (the larger of it and the spare)."""
    if scratch is None:
        return
    with _spare_lock:
        if not _spare or len(_spare[0]) < len(scratch):
            _spare[:] = [scratch]


#: The smallest scratch mapping made: a sync save's request (``BATCH_BYTES`` in
#: ``bcp.io_scheduler.write_pipeline``), so one mapping serves every request.
SCRATCH_BYTES = 64 << 20
