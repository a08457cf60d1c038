"""Carry out a read plan: ranged reads straight into destination memory, then
checksum verification of every block the reads touched.

A run that covers only part of a checksum block is verified by reading the rest of
that block into scratch memory and chaining CRC32C over the pieces in order, so the
data itself is never copied to check it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from bcp.backends import Backend, ObjectNotFoundError
from bcp.metadata import Fragment, crc32c

from .errors import CorruptCheckpointError
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
            f"tensor {frag.fqn!r}: data file {frag.file!r} of {uri} is missing", fqn=frag.fqn, file=frag.file,
            offset=frag.byte_offset + start,
        ) from e
    except EOFError as e:
        raise CorruptCheckpointError(
            f"tensor {frag.fqn!r}: data file {frag.file!r} of {uri} is truncated: {e}", fqn=frag.fqn, file=frag.file,
            offset=frag.byte_offset + start,
        ) from e


def execute_reads(
    backend: Backend,
    plans: list[RunSet],
    dest_views: list[memoryview],
    *,
    block_bytes: int,
    verify: bool = True,
) -> ReadStats:
    """Fill ``dest_views[plan.dest]`` for every plan; verify checksums if asked."""
    stats = ReadStats()
    landed: dict[int, list[tuple[int, int, memoryview]]] = defaultdict(list)
    fragments: dict[int, Fragment] = {}
    for plan in plans:
        view = dest_views[plan.dest]
        n = plan.run_bytes
        key = id(plan.fragment)
        fragments[key] = plan.fragment
        for s, d in zip(plan.src.tolist(), plan.dst.tolist()):
            target = view[d : d + n]
            _read(backend, plan.fragment, s, target, backend.uri)
            stats.requests += 1
            stats.bytes_read += n
            if verify:
                landed[key].append((s, s + n, target))
    if verify:
        for key, pieces in landed.items():
            stats.verify_bytes += _verify_fragment(backend, fragments[key], pieces, block_bytes)
    return stats


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
                fqn=frag.fqn, file=frag.file, offset=start,
            )
    return extra
