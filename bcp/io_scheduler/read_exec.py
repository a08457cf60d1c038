"""Carry out a read plan: ranged reads straight into destination memory, then
checksum verification of every block the reads touched.

A run that covers only part of a checksum block is verified by reading the rest of
that block into scratch memory and chaining CRC32C over the pieces in order, so the
data itself is never copied to check it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from bcp.backends import Backend, ObjectNotFoundError
from bcp.metadata import Fragment, crc32c

from ..errors import CorruptCheckpointError
from .read_plan import RunSet


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


def _read(backend: Backend, frag: Fragment, start: int, view: memoryview, uri: str) -> None:
    try:
        backend.read_exact(frag.file, frag.byte_offset + start, view)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(
            f"tensor {frag.fqn!r}: data file {frag.file!r} of {uri} is missing",
            fqn=frag.fqn,
            file=frag.file,
            offset=frag.byte_offset + start,
        ) from e
    except EOFError as e:
        raise CorruptCheckpointError(
            f"tensor {frag.fqn!r}: data file {frag.file!r} of {uri} is truncated: {e}",
            fqn=frag.fqn,
            file=frag.file,
            offset=frag.byte_offset + start,
        ) from e


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
#: Writers pad between fragments (64-byte alignment, page alignment for O_DIRECT): a
#: request may read across such padding, less than this many bytes, from the end of one
#: fragment to the start of the next (never a gap inside a fragment: a partial box reads
#: only its bytes).
MAX_PADDING = 4096


class _Part(NamedTuple):
    """Bytes of one fragment read into one target view."""

    fragment: Fragment
    #: offset in the fragment
    start: int
    target: memoryview


@dataclasses.dataclass(slots=True)
class _Request:
    """One ranged read of ``file``: one part read in place, or several parts (in file
    order, ``at`` their offsets in the request) read into scratch memory and copied."""

    file: str
    offset: int
    nbytes: int
    parts: list[_Part]
    at: list[int]


def coalesce(
    parts: list[_Part], *, limit: int = COALESCE_BYTES, below: int = COALESCE_BELOW, padding: int = MAX_PADDING
) -> list[_Request]:
    """Storage requests for ``parts``: parts smaller than ``below`` that follow each other
    in one file (back to back, or across less than ``padding`` bytes between the end of
    one fragment and the start of another) merge into requests of at most ``limit``
    bytes; others stay alone. Requests come in file order, then offset."""
    keyed = sorted(parts, key=lambda p: (p.fragment.file, p.fragment.byte_offset + p.start))
    out: list[_Request] = []
    last: _Request | None = None
    for part in keyed:
        offset, n = part.fragment.byte_offset + part.start, len(part.target)
        if last is not None and n < below and len(last.parts[-1].target) < below and last.file == part.fragment.file:
            prev = last.parts[-1]
            gap = offset - (last.offset + last.nbytes)
            joins = gap == 0 or (
                0 < gap < padding
                and part.start == 0
                and prev.start + len(prev.target) == prev.fragment.nbytes
                and prev.fragment.byte_offset != part.fragment.byte_offset
            )
            if joins and last.nbytes + gap + n <= limit:
                last.parts.append(part)
                last.at.append(last.nbytes + gap)
                last.nbytes += gap + n
                continue
        last = _Request(part.fragment.file, offset, n, [part], [0])
        out.append(last)
    return out


def _fetch(backend: Backend, request: _Request, uri: str) -> None:
    """Carry out one request. A coalesced read that fails is retried part by part, so
    the error names the fragment (tensor, file, offset) that is truly missing."""
    if len(request.parts) == 1:
        part = request.parts[0]
        _read(backend, part.fragment, part.start, part.target, uri)
        return
    scratch = memoryview(bytearray(request.nbytes))
    try:
        backend.read_exact(request.file, request.offset, scratch)
    except (ObjectNotFoundError, EOFError):
        for part in request.parts:
            _read(backend, part.fragment, part.start, part.target, uri)
        return
    for part, at in zip(request.parts, request.at, strict=True):
        part.target[:] = scratch[at : at + len(part.target)]


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
    reads; each fragment is verified as soon as its last read has landed. Small runs
    that follow each other in a file are fetched together (see :func:`coalesce`)."""
    stats = ReadStats()
    spans: dict[Fragment, list[Run]] = defaultdict(list)
    for plan in plans:  # a fragment is its row: equal rows are the same stored bytes and checksums
        spans[plan.fragment] += [
            Run(s, plan.dest, d, plan.run_bytes) for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True)
        ]
    by_fragment: dict[Fragment, list[tuple[int, memoryview]]] = {}
    parts: list[_Part] = []
    for frag, runs in spans.items():
        runs.sort()
        merged: list[Run] = []
        for run in runs:  # coalesce runs adjacent both in the fragment and in one destination
            if merged and merged[-1].continued_by(run):
                merged[-1] = merged[-1]._replace(nbytes=merged[-1].nbytes + run.nbytes)
            else:
                merged.append(run)
        by_fragment[frag] = [(r.start, dest_views[r.dest][r.dest_offset : r.dest_offset + r.nbytes]) for r in merged]
        for s, target in by_fragment[frag]:
            for off in range(0, len(target), READ_PIECE_BYTES):
                parts.append(_Part(frag, s + off, target[off : off + READ_PIECE_BYTES]))
    streams = streams or backend.hints.concurrency
    limit = max(COALESCE_BELOW, min(COALESCE_BYTES, COALESCE_BUDGET // max(streams, 1)))
    requests = coalesce(parts, limit=limit)
    if streams <= 1 or len(requests) <= 1:
        for request in requests:
            _fetch(backend, request, backend.uri)
        pieces_done = by_fragment
    else:
        remaining: defaultdict[Fragment, int] = defaultdict(int)
        for part in parts:
            remaining[part.fragment] += 1
        lock = threading.Lock()
        verify_errors: list[BaseException] = []
        extra = [0]

        def read_task(request: _Request) -> None:
            _fetch(backend, request, backend.uri)
            landed = []
            with lock:
                for part in request.parts:
                    remaining[part.fragment] -= 1
                    if remaining[part.fragment] == 0:
                        landed.append(part.fragment)
            if verify:
                for frag in landed:
                    n = _verify_fragment(backend, frag, _pieces(by_fragment[frag]), block_bytes)
                    with lock:
                        extra[0] += n

        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="bcp-reader") as pool:
            for future in [pool.submit(read_task, r) for r in requests]:
                try:
                    future.result()
                except BaseException as e:  # noqa: BLE001 - first error wins, after all reads stop
                    verify_errors.append(e)
        if verify_errors:
            raise verify_errors[0]
        stats.verify_bytes += extra[0]
        pieces_done = {}
    stats.requests = len(requests)
    stats.bytes_read = sum(len(p.target) for p in parts)
    stats.padding_bytes = sum(r.nbytes for r in requests) - stats.bytes_read
    if verify:
        for frag, landed in pieces_done.items():
            stats.verify_bytes += _verify_fragment(backend, frag, _pieces(landed), block_bytes)
    return stats


def _pieces(runs: list[tuple[int, memoryview]]) -> list[tuple[int, int, memoryview]]:
    return [(s, s + len(v), v) for s, v in runs]


def _verify_fragment(backend: Backend, frag: Fragment, pieces: list[tuple[int, int, memoryview]], block: int) -> int:
    """Check every block that ``pieces`` touch; return bytes read only to verify."""
    pieces.sort(key=lambda p: p[0])
    extra = 0
    i = 0
    touched = sorted({b for s, e, _v in pieces for b in range(s // block, (e - 1) // block + 1)})
    for b in touched:
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
            _read(backend, frag, cursor, scratch, backend.uri)
            extra += len(scratch)
            crc = crc32c(scratch, crc)
            cursor = gap_end
        if crc != frag.checksums[b]:
            start = frag.byte_offset + b_start
            raise CorruptCheckpointError(
                f"checksum mismatch in tensor {frag.fqn!r}: file {frag.file!r} of {backend.uri}, bytes "
                f"[{start}, {frag.byte_offset + b_end}) (crc32c {crc:#010x}, expected {frag.checksums[b]:#010x})",
                fqn=frag.fqn,
                file=frag.file,
                offset=start,
            )
    return extra
