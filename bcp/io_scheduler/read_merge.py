"""Which byte ranges of a data file one load reads with one storage request.

A partial load (a column shard, a box) needs many short runs of a fragment, each a
request of its own if read alone; and verifying a run that covers part of a checksum
block reads the rest of that block anyway. So with verification a partial run's request
covers the whole checksum blocks it touches (clipped to its fragment), and runs whose
blocks overlap or touch, or lie less than the backend's
:attr:`~bcp.backends.IOHints.read_gap_bytes` apart, are read with one request: a
column shard of a 512 x 256 float32 tensor is one request, not 512 plus 512 more to
verify. A request holds at most ``limit`` bytes (its scratch memory) and never reaches
beyond the fragments it serves, so never beyond a data file's declared size.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from bcp.metadata import Fragment


class Part(NamedTuple):
    """Bytes of one fragment read into one target view."""

    fragment: Fragment
    #: offset in the fragment
    start: int
    target: memoryview


@dataclasses.dataclass(slots=True)
class Request:
    """One ranged read of ``file``: one part read in place, or several parts (``at``
    their offsets in the request) read into scratch memory and copied."""

    file: str
    offset: int
    nbytes: int
    parts: list[Part]
    at: list[int]
    #: bytes between the parts' needed ranges read only to join them into one request
    gaps: int = 0
    #: bytes of partly needed checksum blocks read only to verify them
    extra: int = 0


def needed(part: Part, block: int | None) -> tuple[int, int]:
    """The file range [lo, hi) that ``part`` needs read: its bytes, widened to whole
    checksum blocks of its fragment (``block``; None: no verification) when it covers
    only part of the fragment."""
    frag, start, n = part.fragment, part.start, len(part.target)
    lo = frag.byte_offset + start
    if not block or (not start and n == frag.nbytes) or not n:
        return lo, lo + n
    first, stop = start // block * block, min(frag.nbytes, -(-(start + n) // block) * block)
    return frag.byte_offset + first, frag.byte_offset + stop


def coalesce(
    parts: list[Part],
    *,
    limit: int,
    below: int,
    padding: int,
    block: int | None = None,
    gap: int = 0,
) -> list[Request]:
    """Storage requests for ``parts``. Parts smaller than ``below`` in one file merge into
    requests of at most ``limit`` bytes where their needed ranges (:func:`needed`)
    overlap or touch, lie less than ``gap`` bytes apart, or are separated by less than
    ``padding`` bytes between the end of one whole fragment and the start of another (a
    writer's alignment); others stay alone. A needed range larger than ``limit`` is read
    as its bare bytes. Requests come in file order, then offset."""
    ranged = []
    for part in parts:
        lo, hi = needed(part, block)
        if hi - lo > limit:
            lo = part.fragment.byte_offset + part.start
            hi = lo + len(part.target)
        ranged.append((part.fragment.file, lo, hi, part))
    ranged.sort(key=lambda r: (r[0], r[1], r[2]))
    out: list[Request] = []
    last: Request | None = None
    for file, lo, hi, part in ranged:
        n = len(part.target)
        if last is not None and n < below and len(last.parts[-1].target) < below and last.file == file:
            prev = last.parts[-1]
            space = lo - (last.offset + last.nbytes)
            joins = (
                space <= 0
                or space < gap
                or (
                    space < padding
                    and part.start == 0
                    and prev.start + len(prev.target) == prev.fragment.nbytes
                    and prev.fragment.byte_offset != part.fragment.byte_offset
                )
            )
            end = max(hi, last.offset + last.nbytes)
            if joins and end - last.offset <= limit:
                last.parts.append(part)
                last.at.append(part.fragment.byte_offset + part.start - last.offset)
                last.gaps += max(space, 0)
                last.nbytes = end - last.offset
                continue
        last = Request(file, lo, hi - lo, [part], [part.fragment.byte_offset + part.start - lo])
        out.append(last)
    for request in out:
        request.extra = request.nbytes - request.gaps - _covered(request)
    return out


def _covered(request: Request) -> int:
    """Bytes of ``request`` that its parts land (each byte once)."""
    spans = sorted((at, at + len(p.target)) for at, p in zip(request.at, request.parts, strict=True))
    total, reach = 0, 0
    for lo, hi in spans:
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def whole_blocks(frag: Fragment, start: int, nbytes: int, block: int) -> range:
    """The checksum blocks of ``frag`` that lie wholly inside its bytes [start, start + nbytes)."""
    end = start + nbytes
    last = -(-frag.nbytes // block) if end >= frag.nbytes else end // block
    first = -(-start // block)
    return range(first, max(first, last))


def edge_blocks(frag: Fragment, parts: list[tuple[int, int]], block: int) -> list[int]:
    """The blocks of ``frag`` that ``parts`` ((start, nbytes) of each read) touch but
    no single part holds whole: the ones a check of each read alone cannot verify."""
    out: set[int] = set()
    for start, n in parts:
        if n:
            whole = whole_blocks(frag, start, n, block)
            out.update(b for b in (start // block, (start + n - 1) // block) if b not in whole)
    return sorted(out)
