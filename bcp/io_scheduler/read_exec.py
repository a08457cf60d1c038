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
    bytes_read: int = 0
    requests: int = 0
    verify_bytes: int = 0

    def add(self, other: ReadStats) -> None:
        self.bytes_read += other.bytes_read
        self.requests += other.requests
        self.verify_bytes += other.verify_bytes


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
    reads; each fragment is verified as soon as its last read has landed."""
    stats = ReadStats()
    spans: dict[int, list[Run]] = defaultdict(list)
    fragments: dict[int, Fragment] = {}
    for plan in plans:
        key = id(plan.fragment)
        fragments[key] = plan.fragment
        spans[key] += [
            Run(s, plan.dest, d, plan.run_bytes) for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True)
        ]
    by_fragment: dict[int, list[tuple[int, memoryview]]] = {}
    tasks: list[tuple[int, int, memoryview]] = []  # (fragment key, start in fragment, target)
    for key, runs in spans.items():
        runs.sort()
        merged: list[Run] = []
        for run in runs:  # coalesce runs adjacent both in the fragment and in one destination
            if merged and merged[-1].continued_by(run):
                merged[-1] = merged[-1]._replace(nbytes=merged[-1].nbytes + run.nbytes)
            else:
                merged.append(run)
        by_fragment[key] = [(r.start, dest_views[r.dest][r.dest_offset : r.dest_offset + r.nbytes]) for r in merged]
        for s, target in by_fragment[key]:
            for off in range(0, len(target), READ_PIECE_BYTES):
                tasks.append((key, s + off, target[off : off + READ_PIECE_BYTES]))
    streams = streams or backend.hints.concurrency
    if streams <= 1 or len(tasks) <= 1:
        for key, start, target in tasks:
            _read(backend, fragments[key], start, target, backend.uri)
        pieces_done = by_fragment
    else:
        remaining: defaultdict[int, int] = defaultdict(int)
        for key, _s, _t in tasks:
            remaining[key] += 1
        lock = threading.Lock()
        verify_errors: list[BaseException] = []
        extra = [0]

        def read_task(task: tuple[int, int, memoryview]) -> None:
            key, start, target = task
            _read(backend, fragments[key], start, target, backend.uri)
            with lock:
                remaining[key] -= 1
                last = remaining[key] == 0
            if last and verify:
                n = _verify_fragment(backend, fragments[key], _pieces(by_fragment[key]), block_bytes)
                with lock:
                    extra[0] += n

        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="bcp-reader") as pool:
            for future in [pool.submit(read_task, t) for t in tasks]:
                try:
                    future.result()
                except BaseException as e:  # noqa: BLE001 - first error wins, after all reads stop
                    verify_errors.append(e)
        if verify_errors:
            raise verify_errors[0]
        stats.verify_bytes += extra[0]
        pieces_done = {}
    stats.requests = len(tasks)
    stats.bytes_read = sum(len(t) for _k, _s, t in tasks)
    if verify:
        for key, landed in pieces_done.items():
            stats.verify_bytes += _verify_fragment(backend, fragments[key], _pieces(landed), block_bytes)
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
