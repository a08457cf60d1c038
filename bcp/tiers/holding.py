"""``holding.json``: the data files one host holds for one local step, each checked.

A data file counts for recovery only once it is listed here, and it is listed only
after its size and digest were recomputed from the bytes on this host and matched
the manifest (``FileEntry.nbytes`` and ``FileEntry.crc32c``: a CRC32C over the
block checksums of the file's fragments, in file order; metadata/FORMAT.md). A file
cut short by a host that died while receiving it is therefore never used.

Several ranks of a host add files to the same ``holding.json``: each takes an
exclusive ``flock`` on ``holding.lock`` beside it, reads, adds, and replaces the file
atomically (a partial file, then ``rename``), so a reader never sees half a file.

One reader, :func:`read_holding`, serves both sides (the ranks adding files, and a
recovery's inventory). It is strict about the content and lenient about failure: a
``holding.json`` that is not exactly what :func:`add_held` writes (another format, a
file entry without an integer size and digest, a link, over ``MAX_HOLDING_BYTES``)
holds nothing, with a WARNING, and never raises: the files of that step then do
not count for recovery, and the next :func:`add_held` replaces it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from bcp.metadata import Catalog, FileEntry, block_checksums, digest_of_checksums
from bcp.tiers.paths import FILE_MODE, HOLDING_LOCK, HOLDING_NAME, READ_FLAGS, read_regular

log = logging.getLogger(__name__)

FORMAT = "bcp-holding"
VERSION = 1
#: holdings larger than this are not read (one entry is about 100 bytes)
MAX_HOLDING_BYTES = 64 << 20
#: bytes read at a time when a file is verified (a multiple of any block size up to it)
READ_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Holding:
    """A step directory's ``holding.json``: the save it is of, and its checked files."""

    save_id: str
    #: manifest path -> the entry its size and digest were checked against
    files: dict[str, FileEntry]


def read_holding(step_dir: str) -> Holding | None:
    """The ``holding.json`` of a step directory; None when there is none, or when it is
    not one that :func:`add_held` wrote (a WARNING: nothing of the step is held)."""
    path = os.path.join(step_dir, HOLDING_NAME)
    data = read_regular(path, MAX_HOLDING_BYTES)
    if data is None:
        return None
    try:
        return parse_holding(data)
    except ValueError as e:
        log.warning("local tier: %s holds nothing: %s", path, e)
        return None


def parse_holding(data: bytes) -> Holding:
    """``holding.json``'s bytes, checked: ValueError unless they are what :func:`add_held` writes."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    save_id, listed = doc.get("save_id"), doc.get("files")
    if not isinstance(save_id, str) or not isinstance(listed, dict):
        raise ValueError("no save_id string or no files object")
    files: dict[str, FileEntry] = {}
    for name, item in listed.items():
        nbytes, digest = (item.get("nbytes"), item.get("crc32c")) if isinstance(item, dict) else (None, None)
        if type(nbytes) is not int or type(digest) is not int or nbytes < 0 or digest < 0:
            raise ValueError(f"file {name!r} has no integer nbytes and crc32c")
        files[name] = FileEntry(name, nbytes, digest)
    return Holding(save_id, files)


def held_files(step_dir: str, save_id: str) -> dict[str, FileEntry]:
    """The data files listed for the save ``save_id`` (none for another save's list)."""
    holding = read_holding(step_dir)
    return dict(holding.files) if holding is not None and holding.save_id == save_id else {}


def open_regular(name: str, flags: int, dir_fd: int, where: str) -> int:
    """``name`` under ``dir_fd`` opened with ``flags`` never through a link and never
    blocking (O_NOFOLLOW | O_NONBLOCK; created 0600 with O_CREAT), refused
    (PermissionError naming ``where``) unless it is a regular file."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, FILE_MODE, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise PermissionError(f"local tier: {where} is a symbolic link; bcp never opens one: remove it") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PermissionError(f"local tier: {where} is not a regular file; remove it")
    return fd


@contextlib.contextmanager
def _locked(dir_fd: int, step_dir: str) -> Iterator[None]:
    fd = open_regular(HOLDING_LOCK, os.O_RDWR | os.O_CREAT, dir_fd, os.path.join(step_dir, HOLDING_LOCK))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def add_held(step_dir: str, save_id: str, entries: Sequence[FileEntry]) -> None:
    """List ``entries`` (checked files of the save ``save_id``) in the step's
    ``holding.json``, under the host's lock; a list of another save, or one that
    holds nothing (:func:`read_holding`), is replaced. Every file is opened relative
    to the step directory's descriptor, never through a link, created 0600."""
    # link-ok: inside the private 0700 root; a link planted as step_dir fails the O_NOFOLLOW open below
    os.makedirs(step_dir, mode=0o700, exist_ok=True)
    dfd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        with _locked(dfd, step_dir):
            files = held_files(step_dir, save_id)
            files.update((e.path, e) for e in entries)
            listed = {path: {"nbytes": e.nbytes, "crc32c": e.crc32c} for path, e in sorted(files.items())}
            doc = {"format": FORMAT, "version": VERSION, "save_id": save_id, "files": listed}
            data = json.dumps(doc, indent=1).encode("utf-8")
            tmp = f"{HOLDING_NAME}.partial-{secrets.token_hex(4)}"
            fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dfd, os.path.join(step_dir, tmp))
            try:
                os.fchmod(fd, FILE_MODE)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, HOLDING_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def file_spans(catalog: Catalog) -> dict[str, list[tuple[int, int]]]:
    """Each data file's fragments as (byte offset, bytes), in file order, each once
    (rows of tied weights share their bytes); empty fragments are left out: they have
    no checksum blocks."""
    names = catalog.file_names
    spans: dict[int, set[tuple[int, int]]] = {}
    for fqn in catalog.tensors:
        entry = catalog.tensors[fqn]
        for code, off, n in zip(entry.files.tolist(), entry.byte_offsets.tolist(), entry.sizes.tolist(), strict=True):
            if n:
                spans.setdefault(code, set()).add((off, n))
    return {names[code]: sorted(s) for code, s in spans.items()}


def file_digest(path: str, spans: Sequence[tuple[int, int]], block_bytes: int) -> tuple[int, int]:
    """(size, digest) of the file at ``path``: the digest recomputed from its bytes
    (each fragment in ``block_bytes`` blocks from its first byte), read in pieces of
    at most READ_BYTES."""
    step = max(block_bytes, READ_BYTES // block_bytes * block_bytes)
    sums: list[int] = []
    fd = os.open(path, READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        size = st.st_size
        for offset, nbytes in spans:
            done = 0
            while done < nbytes:
                take = min(step, nbytes - done)
                data = os.pread(fd, take, offset + done)
                if len(data) != take:
                    return size, -1  # the file ends inside a fragment
                sums.extend(block_checksums(data, block_bytes))
                done += take
    finally:
        os.close(fd)
    return size, digest_of_checksums(sums)


def verify(path: str, entry: FileEntry, spans: Mapping[str, Sequence[tuple[int, int]]], block_bytes: int) -> str | None:
    """Why the file at ``path`` is not ``entry`` (its size or digest differ), or None when it is."""
    try:
        size, digest = file_digest(path, spans.get(entry.path, ()), block_bytes)
    except OSError as e:
        return f"cannot read it: {e}"
    if size != entry.nbytes:
        return f"it has {size} bytes; the manifest says {entry.nbytes}"
    if digest != entry.crc32c:
        return f"its digest is {digest:#010x}; the manifest says {entry.crc32c:#010x}"
    return None


class StreamedDigest:
    """A data file's digest (``FileEntry.crc32c``) from the parts an upload reads, in
    any order and on any thread: each block's CRC32C over the very bytes uploaded.
    A block across a part's edge is summed by both parts, each completing it with an
    extra read of the bytes beyond its edge (``read_outside``); the two sums must
    agree, so every byte uploaded was checked as uploaded, none read again between
    the check and the copy. :meth:`problem` compares the whole with the manifest."""

    def __init__(self, spans: Sequence[tuple[int, int]], block_bytes: int) -> None:
        self.spans, self.block = list(spans), block_bytes
        self.first: list[int] = []  # each span's first block index, blocks in file order
        count = 0
        for _off, n in self.spans:
            self.first.append(count)
            count += -(-n // block_bytes)
        self.sums: list[int | None] = [None] * count
        self.disagree: list[int] = []  # blocks whose two parts summed different bytes
        self.starts = [off for off, _n in self.spans]
        self.lock = threading.Lock()  # parts are fed from several upload threads

    def feed(self, offset: int, data: bytes, read_outside: Callable[[int, int], bytes]) -> None:
        """Sum the blocks that part ``[offset, offset + len(data))`` holds bytes of."""
        end, view, block = offset + len(data), memoryview(data), self.block
        k = max(0, bisect.bisect_right(self.starts, offset) - 1)  # spans are sorted and apart
        while k < len(self.spans) and self.spans[k][0] < end:
            off, n = self.spans[k]
            lo, hi = max(off, offset), min(off + n, end)
            if lo < hi:
                first, last = (lo - off) // block, (hi - 1 - off) // block
                inner_lo = first + (off + first * block < offset)  # blocks wholly inside the part
                inner_hi = last - (min(off + (last + 1) * block, off + n) > end)
                if inner_lo <= inner_hi:
                    a, b = off + inner_lo * block - offset, min(off + (inner_hi + 1) * block, off + n) - offset
                    self._put(self.first[k] + inner_lo, block_checksums(view[a:b], block))
                for edge in {first, last} - set(range(inner_lo, inner_hi + 1)):  # across an edge of the part
                    at, stop = off + edge * block, min(off + (edge + 1) * block, off + n)
                    head = read_outside(at, offset - at) if at < offset else b""
                    tail = read_outside(end, stop - end) if stop > end else b""
                    inside = bytes(view[max(at, offset) - offset : min(stop, end) - offset])
                    self._put(self.first[k] + edge, block_checksums(head + inside + tail, block))
            k += 1

    def _put(self, index: int, sums: list[int]) -> None:
        with self.lock:
            for i, crc in enumerate(sums, index):
                seen = self.sums[i]
                if seen is not None and seen != crc:
                    self.disagree.append(i)
                self.sums[i] = crc

    def problem(self, entry: FileEntry) -> str | None:
        """Why the bytes fed are not ``entry``'s, or None."""
        if self.disagree:
            return f"{len(self.disagree)} checksum block(s) changed while the file was read"
        if any(s is None for s in self.sums):
            return "part of its fragments was never read"
        digest = digest_of_checksums([s for s in self.sums if s is not None])
        if digest != entry.crc32c:
            return f"its digest is {digest:#010x}; the manifest says {entry.crc32c:#010x}"
        return None
