"""Carry out a read plan: ranged reads straight into destination memory, each
checksum block verified as soon as the read holding it has landed.

Every block that lies wholly inside one read is checked right after that read, from
the destination memory it landed in: all of them with one CRC32C call, compared with
their block checksums combined, and block by block only on a mismatch, to name the
block (``_check_whole_blocks``). A read of bytes already in memory (the page
cache, tmpfs, a memory store: :meth:`~bcp.backends.Backend.in_memory`) goes in
pieces of :data:`IN_MEMORY_CHUNK` bytes, each checked at once, while it is still in
the CPU cache, so a warm load passes over the destination once, not twice. A block
that no single read holds whole (a run that covers only part of it, or that two
reads share) is verified once its fragment has landed, by reading the rest of that
block into scratch memory and chaining CRC32C over the pieces in order, so the data
itself is never copied to check it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from bcp import trace
from bcp.backends import Backend, ObjectNotFoundError
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_merge
from bcp.io_scheduler.read_merge import Part, Request, edge_blocks, whole_blocks
from bcp.io_scheduler.read_plan import RunSet
from bcp.metadata import Fragment, crc32c
from bcp.metadata.checksum import GROUP, combine_block_runs, combine_blocks, crc32c_c
from bcp.references import describe_file

log = logging.getLogger(__name__)

#: how an error names a data file (its key, and where it lies: :func:`bcp.references.describe_file`)
FileName = Callable[[str], str]

#: ``read(offset, buffer)`` of one file (:meth:`~bcp.backends.Backend.reading`)
_ReadFn = Callable[[int, memoryview], None]


@dataclasses.dataclass
class ReadStats:
    #: bytes of tensor data read (each needed byte once)
    bytes_read: int = 0
    #: storage requests
    requests: int = 0
    #: bytes read only to verify checksum blocks that a partial read touched
    verify_bytes: int = 0
    #: writers' padding between fragments, read only to join two reads into one request
    padding_bytes: int = 0

    def add(self, other: ReadStats) -> None:
        self.bytes_read += other.bytes_read
        self.requests += other.requests
        self.verify_bytes += other.verify_bytes
        self.padding_bytes += other.padding_bytes


def _read(
    backend: Backend, frag: Fragment, start: int, view: memoryview, name: FileName, read: _ReadFn | None = None
) -> None:
    """Fill ``view`` with the fragment's bytes from ``start`` (through ``read``, a
    :meth:`~bcp.backends.Backend.reading` function of the fragment's file, if given)."""
    try:
        with trace.span("fetch", len(view)):
            if read is None:
                backend.read_exact(frag.file, frag.byte_offset + start, view)
            else:
                read(frag.byte_offset + start, view)
    except (ObjectNotFoundError, EOFError) as e:
        raise read_error(name, frag, start, e) from e


def read_error(name: FileName, frag: Fragment, start: int, e: ObjectNotFoundError | EOFError) -> CorruptCheckpointError:
    """The error naming the tensor, file and offset of a read of ``frag`` from ``start`` that failed with ``e``."""
    if isinstance(e, ObjectNotFoundError):
        return _missing(name, frag, start)
    return CorruptCheckpointError(
        f"tensor {frag.fqn!r}: data file {name(frag.file)} is truncated: {e}",
        fqn=frag.fqn,
        file=frag.file,
        offset=frag.byte_offset + start,
    )


def _missing(name: FileName, frag: Fragment, start: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {frag.fqn!r}: data file {name(frag.file)} is missing",
        fqn=frag.fqn,
        file=frag.file,
        offset=frag.byte_offset + start,
    )


@contextlib.contextmanager
def _reading(backend: Backend, frag: Fragment, start: int, name: FileName) -> Iterator[_ReadFn]:
    """:meth:`~bcp.backends.Backend.reading` of the fragment's file; a missing file is
    reported as :func:`_read` reports it."""
    with contextlib.ExitStack() as stack:
        try:
            read = stack.enter_context(backend.reading(frag.file))
        except ObjectNotFoundError as e:
            raise _missing(name, frag, start) from e
        yield read


class Run(NamedTuple):
    """Bytes of one fragment that land contiguously in one destination."""

    #: offset in the fragment
    start: int
    #: index of the destination view
    dest: int
    #: offset in that destination
    dest_offset: int
    nbytes: int

    def continued_by(self, other: Run) -> bool:
        """``other`` starts where this run ends, both in the fragment and in the same destination."""
        return (
            self.start + self.nbytes == other.start
            and self.dest == other.dest
            and self.dest_offset + self.nbytes == other.dest_offset
        )


#: Reads are cut into pieces of at most this many bytes so several streams share a big run.
READ_PIECE_BYTES = 32 << 20
#: Pieces smaller than this that lie back to back in one file are fetched by one request
#: into scratch memory and copied into place (a full export of an FSDP checkpoint reads
#: each writer's file in large requests instead of one request per fragment).
COALESCE_BELOW = 8 << 20
#: A coalesced request spans at most this many bytes; its scratch buffer is the memory
#: it costs, so at most ``streams`` of them are allocated at a time ...
COALESCE_BYTES = 64 << 20
#: ... and all streams together hold at most this much scratch memory.
COALESCE_BUDGET = 512 << 20
#: Reads of bytes already in memory go in pieces of this many bytes (rounded up to a
#: multiple of the checksum block), each verified as soon as it lands: small enough to
#: stay in the CPU's caches between the copy and the CRC, large enough that the calls
#: cost little (1 MiB pieces were 4-10% slower here, 4 MiB no faster; docs/benchmarks.md).
IN_MEMORY_CHUNK = 2 << 20
#: A coalesced request found in memory reads its parts in place (no scratch buffer,
#: no second copy) when they average at least this many bytes; smaller ones cost
#: more in calls than the copy.
IN_PLACE_FROM_MEMORY = 64 << 10
#: Writers pad between fragments (64-byte alignment, page alignment for O_DIRECT): a
#: request may read across such padding, less than this many bytes, from the end of one
#: fragment to the start of the next (gaps inside a fragment: the backend's
#: ``read_gap_bytes`` and the checksum blocks a partial read verifies, read_merge.py).
MAX_PADDING = 4096


#: a part of a read (:class:`~bcp.io_scheduler.read_merge.Part`)
_Part = Part


def coalesce(
    parts: list[Part],
    *,
    limit: int = COALESCE_BYTES,
    below: int = COALESCE_BELOW,
    padding: int = MAX_PADDING,
    block: int | None = None,
    gap: int = 0,
) -> list[Request]:
    """The storage requests for ``parts`` (:func:`bcp.io_scheduler.read_merge.coalesce`)."""
    return read_merge.coalesce(parts, limit=limit, below=below, padding=padding, block=block, gap=gap)


#: blocks of a fragment verified from a request's scratch memory (None: read in place)
Verified = list[tuple[Fragment, range]] | None


def _fetch(backend: Backend, request: Request, name: FileName, block: int | None) -> Verified:
    """Carry out one request, checking every block that lies wholly inside one of its
    parts, or read into scratch memory wholly inside the request, as soon as it has
    landed (``block``: the checksum block size; None: no verification); return the
    blocks checked from scratch. A coalesced read that fails is retried part by part, so
    the error names the fragment (tensor, file, offset) that is truly missing."""
    at, n = request.offset, request.nbytes
    if len(request.parts) == 1 and (
        n == len(request.parts[0].target) or backend.in_memory(request.file, at, n)
    ):  # in place; from memory, the blocks a partial part lacks are read when its fragment is done
        _fetch_part(backend, request.parts[0], name, block)
        return None
    if (
        block
        and request.nbytes >= len(request.parts) * IN_PLACE_FROM_MEMORY
        and backend.in_memory(request.file, request.offset, request.nbytes)
    ):  # from memory, a scratch buffer would only add a copy; one open file for every part
        first = request.parts[0]
        traced = trace.enabled()
        with _reading(backend, first.fragment, first.start, name) as read:
            for part in request.parts:
                frag, start, target = part
                n = len(target)
                if start or n != frag.nbytes or not 0 < n <= block or traced:
                    _fetch_part(backend, part, name, block, resident=True, read=read)
                    continue
                # a whole fragment of one block (a small tensor): one read, one CRC, no
                # span or wrapper per tensor (thousands of them in a load of many tensors)
                try:
                    read(frag.byte_offset, target)
                except (ObjectNotFoundError, EOFError) as e:
                    raise read_error(name, frag, 0, e) from e
                if crc32c_c(target) != frag.checksums[0]:
                    name_block(name, frag, 0, target, block, range(1))
        return None
    scratch = scratch_memory(n, at)
    # from memory, in pieces of a chunk, as _fetch_part reads (a merged partial read spans blocks)
    step = -(-IN_MEMORY_CHUNK // block) * block if block and n > IN_MEMORY_CHUNK else n
    step = n if step == n or not backend.in_memory(request.file, at, n) else step
    try:
        with trace.span("fetch", n):
            for pos in range(0, n, step or 1):
                backend.read_exact(request.file, at + pos, scratch[pos : pos + step])
    except (ObjectNotFoundError, EOFError):
        for part in request.parts:
            _fetch_part(backend, part, name, block)
        return None
    verified = _check_scratch(name, request, scratch, block) if block else None
    for part, at in zip(request.parts, request.at, strict=True):
        part.target[:] = scratch[at : at + len(part.target)]
    return verified


def _check_scratch(name: FileName, request: Request, scratch: memoryview, block: int) -> list[tuple[Fragment, range]]:
    """Verify, for each fragment of ``request``'s parts, every block that lies wholly
    inside the request's bytes in ``scratch`` (those of every part among them); return them."""
    out: list[tuple[Fragment, range]] = []
    seen: set[int] = set()
    end = request.offset + request.nbytes
    for part in request.parts:
        frag = part.fragment
        if id(frag) in seen:
            continue
        seen.add(id(frag))
        lo, hi = max(frag.byte_offset, request.offset), min(frag.byte_offset + frag.nbytes, end)
        start = lo - frag.byte_offset
        view = scratch[lo - request.offset : hi - request.offset]
        if not (blocks := whole_blocks(frag, start, hi - lo, block)):
            continue
        with trace.span("verify", len(view)):
            _checkwhole_blocks(name, frag, start, view, block, blocks)
        out.append((frag, blocks))
    return out


#: the page size O_DIRECT aligns file offsets and memory to
PAGE = 4096


def scratch_memory(nbytes: int, offset: int) -> memoryview:
    """Scratch memory for a coalesced request of ``nbytes`` from file ``offset``, whose
    address agrees with ``offset`` modulo the page size, so a storage read goes O_DIRECT
    straight into it (not through a bounce buffer). Private process memory (an anonymous
    shared mapping is shmem: its page faults cost twice the system time here), not zeroed."""
    return page_aligned(np.empty(nbytes + PAGE, np.uint8), nbytes, offset)


def page_aligned(buf: np.ndarray, nbytes: int, offset: int) -> memoryview:
    """``nbytes`` of ``buf`` (at least a page longer) whose address agrees with ``offset`` modulo the page."""
    shift = (offset - buf.ctypes.data) % PAGE
    return memoryview(buf)[shift : shift + nbytes]  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ only for Python >= 3.12


def _fetch_part(
    backend: Backend,
    part: Part,
    name: FileName,
    block: int | None,
    *,
    resident: bool | None = None,
    read: _ReadFn | None = None,
) -> None:
    """Read one part in place. Without verification, or from storage, in one read;
    from memory (``resident``, or else ``backend.in_memory``), in pieces of
    :data:`IN_MEMORY_CHUNK` cut at fragment offsets that are multiples of it, each
    piece's whole blocks checked while they are still in the CPU cache. ``read``: a
    :meth:`~bcp.backends.Backend.reading` function of the part's file, already open."""
    frag, start, target = part
    n = len(target)
    step = n
    if block and n > block:
        chunk = -(-IN_MEMORY_CHUNK // block) * block
        if n > chunk and (resident or (resident is None and backend.in_memory(frag.file, frag.byte_offset + start, n))):
            step = chunk
    if step == n:
        _read(backend, frag, start, target, name, read)
        if block:
            _check_blocks(name, frag, start, target, block)
        return
    assert block  # pieces only when verifying
    with contextlib.ExitStack() as stack:
        if read is None:  # one open for all the pieces
            read = stack.enter_context(_reading(backend, frag, start, name))
        if step // block <= GROUP and not trace.enabled():
            _read_pieces(frag, start, target, step, block, name, read)
            return
        pos = 0
        while pos < n:
            end = min(n, ((start + pos) // step + 1) * step - start)
            piece = target[pos:end]
            _read(backend, frag, start + pos, piece, name, read)
            _check_blocks(name, frag, start + pos, piece, block)
            pos = end


def _read_pieces(
    frag: Fragment, start: int, target: memoryview, step: int, block: int, name: FileName, read: _ReadFn
) -> None:
    """:func:`_fetch_part`'s loop from memory, untraced: the pieces' expected values (their
    whole blocks' checksums combined) come from one vectorised pass before the first
    read, so a piece costs one read and one CRC call (two with the short last block)."""
    n, short, sums = len(target), frag.nbytes % block, frag.checksums
    cuts = [*range(0, n, step)] if not start % step else [0, *range(step - start % step, n, step)]
    checks: list[tuple[int, int, int, int]] = []  # (pos, end, first, stop) of whole full-size blocks
    for pos, end in zip(cuts, [*cuts[1:], n], strict=True):
        blocks = whole_blocks(frag, start + pos, end - pos, block)
        checks.append(
            (pos, end, blocks.start, max(blocks.start, blocks.stop - (short and blocks.stop * block > frag.nbytes)))
        )
    expected = combine_block_runs(sums, block, [(c[2], c[3]) for c in checks])
    pos = 0
    try:
        for (pos, end, first, stop), want in zip(checks, expected, strict=True):
            piece, at = target[pos:end], start + pos
            read(frag.byte_offset + at, piece)
            if stop > first and crc32c_c(piece[first * block - at : stop * block - at]) != want:
                name_block(name, frag, at, piece, block, range(first, stop))
            tail = short and end + start == frag.nbytes and stop * block < frag.nbytes  # holds the short block
            if tail and crc32c_c(piece[stop * block - at :]) != sums[stop]:
                name_block(name, frag, at, piece, block, range(stop, stop + 1))
    except (ObjectNotFoundError, EOFError) as e:
        raise read_error(name, frag, start + pos, e) from e


def _check_blocks(name: FileName, frag: Fragment, start: int, view: memoryview, block: int) -> None:
    """Verify each block of ``frag`` that lies wholly inside ``view``, which holds the
    fragment's bytes from ``start``. One comprehension per read: this runs for every
    block a load reads, so it keeps Python's work per block to a slice and a call."""
    n = len(view)
    if not start and n == frag.nbytes and 0 < n <= block and not trace.enabled():
        # a whole fragment of one block (a small tensor): one CRC, no ranges
        if crc32c_c(view) != frag.checksums[0]:
            name_block(name, frag, start, view, block, range(1))
        return
    blocks = whole_blocks(frag, start, n, block)
    if not blocks:
        return
    with trace.span("verify", len(view)):
        _checkwhole_blocks(name, frag, start, view, block, blocks)


def _checkwhole_blocks(name: FileName, frag: Fragment, start: int, view: memoryview, block: int, blocks: range) -> None:
    """One CRC call over the run's whole full-size blocks, compared with their block
    checksums combined (:func:`~bcp.metadata.checksum.combine_blocks`), and one for a
    short last block; only on a mismatch block by block, to name the block. Equal iff
    the bytes' CRC32C equals the one the checksums imply, as with a check per block."""
    lo = blocks.start * block - start
    stop = blocks.stop
    hi = stop * block - start
    if hi > frag.nbytes - start:  # the fragment's short last block: its own call
        stop -= 1
        hi = stop * block - start
        tail = view[hi : frag.nbytes - start]
        if crc32c_c(tail) != frag.checksums[stop]:
            name_block(name, frag, start, view, block, range(stop, stop + 1))
    if stop <= blocks.start:
        return
    sums = frag.checksums[blocks.start : stop]
    if crc32c_c(view[lo:hi]) != combine_blocks(sums, block):
        name_block(name, frag, start, view, block, range(blocks.start, stop))


def name_block(name: FileName, frag: Fragment, start: int, view: memoryview, block: int, blocks: range) -> None:
    """Check ``blocks`` one by one and raise for the first that does not match."""
    for b in blocks:
        b_lo = b * block
        b_hi = min(b_lo + block, frag.nbytes)
        value = crc32c_c(view[b_lo - start : b_hi - start])
        if value != frag.checksums[b]:
            raise _mismatch(name, frag, b, b_lo, b_hi, value)
    # Every block matched on its own: the bytes are verified; only the combining disagreed.
    log.warning("tensor %r: file %s: block checksums combined disagree with the blocks", frag.fqn, name(frag.file))


def _mismatch(name: FileName, frag: Fragment, b: int, b_start: int, b_end: int, crc: int) -> CorruptCheckpointError:
    start = frag.byte_offset + b_start
    return CorruptCheckpointError(
        f"checksum mismatch in tensor {frag.fqn!r}: file {name(frag.file)}, bytes "
        f"[{start}, {frag.byte_offset + b_end}) (crc32c {crc:#010x}, expected {frag.checksums[b]:#010x})",
        fqn=frag.fqn,
        file=frag.file,
        offset=start,
    )


def execute_reads(
    backend: Backend,
    plans: list[RunSet],
    dest_views: list[memoryview],
    *,
    block_bytes: int,
    verify: bool = True,
    streams: int | None = None,
) -> ReadStats:
    """Fill ``dest_views[plan.dest]`` for every plan, with ``streams`` concurrent
    reads. Each checksum block is verified as soon as the read holding it has landed,
    or, where no single read holds it whole, as soon as its fragment's last read has
    (every byte is verified before this returns). Small runs that follow each other
    in a file are fetched together (see :func:`coalesce`)."""
    stats = ReadStats()
    # a fragment is its row: equal rows are the same stored bytes and checksums, so
    # their runs are read and verified together. Keyed by where the bytes lie (a
    # Fragment's own hash covers its checksums: thousands of ints for a large one);
    # two unequal fragments claiming the same bytes (a hostile catalog) stay apart.
    groups: dict[tuple, tuple[Fragment, list[Run]]] = {}
    for plan in plans:
        frag = plan.fragment
        key: tuple = (frag.file, frag.byte_offset, frag.nbytes, frag.fqn)
        group = groups.get(key)
        if group is not None and group[0] is not frag and group[0] != frag:
            key = (*key, id(frag))
            group = groups.get(key)
        if group is None:
            group = groups[key] = (frag, [])
        if len(plan.src) == 1:
            group[1].append(Run(int(plan.src[0]), plan.dest, int(plan.dst[0]), plan.run_bytes))
        else:
            group[1].extend(
                Run(s, plan.dest, d, plan.run_bytes) for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True)
            )
    spans = list(groups.values())
    # keyed by id() of the one Fragment object per row that ``spans`` kept
    by_fragment: dict[int, list[tuple[int, memoryview]]] = {}
    parts: list[Part] = []
    for frag, runs in spans:
        if len(runs) > 1:
            runs.sort()
            merged: list[Run] = []
            for run in runs:  # coalesce runs adjacent both in the fragment and in one destination
                if merged and merged[-1].continued_by(run):
                    merged[-1] = merged[-1]._replace(nbytes=merged[-1].nbytes + run.nbytes)
                else:
                    merged.append(run)
            runs = merged
        landed = [(r.start, dest_views[r.dest][r.dest_offset : r.dest_offset + r.nbytes]) for r in runs]
        by_fragment[id(frag)] = landed
        for s, target in landed:
            if len(target) <= READ_PIECE_BYTES:
                parts.append(Part(frag, s, target))
                continue
            for off in range(0, len(target), READ_PIECE_BYTES):
                parts.append(Part(frag, s + off, target[off : off + READ_PIECE_BYTES]))
    streams = streams or backend.hints.concurrency
    limit = max(COALESCE_BELOW, min(COALESCE_BYTES, COALESCE_BUDGET // max(streams, 1)))
    block = block_bytes if verify else None
    requests = coalesce(parts, limit=limit, block=block, gap=backend.hints.read_gap_bytes)
    order = requests  # the order the streams take them in
    if streams > 1 and len(requests) > 1:
        cpus = usable_cpus()
        largest = max(requests, key=lambda r: r.nbytes)
        if backend.in_memory(largest.file, largest.offset, largest.nbytes):
            streams = min(streams, cpus)  # copies from memory are CPU work: more threads only thrash caches
            # largest first (ties in file order): each stream takes the next when done, so the
            # last to start are the smallest and no core copies a 32 MiB piece alone at the end
            order = sorted(requests, key=lambda r: -r.nbytes)
    name = describe_file(backend)

    def finish(frag: Fragment) -> int:
        """Verify the blocks of a fragment, all of whose reads have landed, that no one
        read held whole; the bytes read only for that."""
        mine = parts_of[id(frag)]
        if len(mine) == 1 and not mine[0].start and len(mine[0].target) == frag.nbytes:
            return 0  # read whole by one part: every block was checked with it
        edges = edge_blocks(frag, [(p.start, len(p.target)) for p in mine], block_bytes)
        if done := checked_in_scratch.get(id(frag)):
            edges = [e for e in edges if not any(e in r for r in done)]
        if not edges:
            return 0
        checked = sum(min(block_bytes, frag.nbytes - e * block_bytes) for e in edges) if trace.enabled() else 0
        with trace.span("verify", checked):
            return _verify_fragment(backend, frag, _pieces(by_fragment[id(frag)]), block_bytes, edges)

    # blocks verified from a request's scratch memory, by id() of their fragment
    checked_in_scratch: defaultdict[int, list[range]] = defaultdict(list)
    scratch_extra = [0]

    def fetched(request: Request, verified: Verified) -> None:
        if verified is not None:
            scratch_extra[0] += request.extra
            for frag, blocks in verified:
                checked_in_scratch[id(frag)].append(blocks)

    parts_of: defaultdict[int, list[Part]] = defaultdict(list)
    for part in parts:
        parts_of[id(part.fragment)].append(part)
    if streams <= 1 or len(requests) <= 1:
        for request in requests:
            fetched(request, _fetch(backend, request, name, block))
        if verify:
            for frag, _runs in spans:
                stats.verify_bytes += finish(frag)
    else:
        remaining = {key: len(ps) for key, ps in parts_of.items()}
        lock = threading.Lock()
        verify_errors: list[BaseException] = []
        extra = [0]

        def read_task(request: Request) -> None:
            verified = _fetch(backend, request, name, block)
            landed = []
            with lock:
                fetched(request, verified)
                for part in request.parts:
                    key = id(part.fragment)
                    remaining[key] -= 1
                    if remaining[key] == 0:
                        landed.append(part.fragment)
            if verify:
                for frag in landed:
                    n = finish(frag)
                    with lock:
                        extra[0] += n

        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="bcp-reader") as pool:
            futures = {id(r): pool.submit(read_task, r) for r in order}
            for future in [futures[id(r)] for r in requests]:  # the first error in file order
                try:
                    future.result()
                except BaseException as e:  # noqa: BLE001 - first error wins, after all reads stop
                    verify_errors.append(e)
        if verify_errors:
            raise verify_errors[0]
        stats.verify_bytes += extra[0]
    stats.requests = len(requests)
    stats.bytes_read = sum(len(p.target) for p in parts)
    stats.padding_bytes = sum(r.gaps for r in requests)
    stats.verify_bytes += scratch_extra[0]
    return stats


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def _pieces(runs: list[tuple[int, memoryview]]) -> list[tuple[int, int, memoryview]]:
    return [(s, s + len(v), v) for s, v in runs]


def _verify_fragment(
    backend: Backend, frag: Fragment, pieces: list[tuple[int, int, memoryview]], block: int, blocks: list[int]
) -> int:
    """Check ``blocks`` (sorted; each touched by ``pieces``, the landed runs of the
    fragment as (start, end, bytes)), reading what the pieces lack of each; return the
    bytes read only to verify."""
    pieces.sort(key=lambda p: p[0])
    extra = 0
    i = 0
    for b in blocks:
        b_start, b_end = b * block, min((b + 1) * block, frag.nbytes)
        while i < len(pieces) and pieces[i][1] <= b_start:
            i += 1
        crc, cursor, j = 0, b_start, i
        while cursor < b_end:
            if j < len(pieces) and pieces[j][0] <= cursor < pieces[j][1]:
                s, e, v = pieces[j]
                stop = min(e, b_end)
                crc = crc32c(v[cursor - s : stop - s], crc)
                cursor = stop
                if stop == e:
                    j += 1
                continue
            if j < len(pieces) and pieces[j][1] <= cursor:
                j += 1
                continue
            gap_end = min(pieces[j][0], b_end) if j < len(pieces) else b_end
            scratch = memoryview(bytearray(gap_end - cursor))
            _read(backend, frag, cursor, scratch, describe_file(backend))
            extra += len(scratch)
            crc = crc32c(scratch, crc)
            cursor = gap_end
        if crc != frag.checksums[b]:
            raise _mismatch(describe_file(backend), frag, b, b_start, b_end, crc)
    return extra
