"""Where a rank's boxes go in its data file, and how the file is cut into chunks.

Apart from ``write_pipeline`` (which stages and writes the chunks) because the same
plan sizes staging reservations without a pipeline (``bcp.async_save.staging_bytes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from bcp.shards import Piece
from bcp.tensor_io import NUMPY_DTYPES, storage_identity

#: Fragments of at least this many bytes start at a multiple of 4096 (direct I/O,
#: page-aligned reads); smaller ones at a multiple of 64.
PAGE_ALIGN_FROM = 64 << 10


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    item: int  # index of the unique source
    start: int  # byte offset within that source
    nbytes: int
    at: int  # byte offset within the chunk


@dataclasses.dataclass(slots=True)
class Chunk:
    offset: int  # file offset
    nbytes: int
    segments: list[Segment]
    #: set by :func:`plan_pipeline` for a staged chunk whose every segment is a dense host
    #: tensor: its bytes as raw copies from the tensors' addresses. Valid only while the sources are the
    #: tensors the plan was made for (``bcp.kept_plans`` reuses a plan only for tensors of
    #: the same addresses, shapes, strides and dtypes).
    copies: ChunkCopies | None = None


def _align(offset: int, nbytes: int, phase: int = 0) -> int:
    """The first offset >= ``offset`` that is ``phase`` modulo 4096 (large fragments)
    or a multiple of 64 (small ones)."""
    if nbytes < PAGE_ALIGN_FROM:
        return -(-offset // 64) * 64
    return offset + (phase - offset) % 4096


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """Where each item of a rank's data file lies."""

    #: file offset of every item (an alias shares its source's offset)
    offsets: list[int]
    #: index of the item whose bytes each item uses (itself, unless it aliases an earlier one)
    source: list[int]
    #: indices of the items with bytes of their own, in file order
    unique: list[int]
    #: the file's size in bytes
    size: int


def layout(
    pieces: Sequence[Piece], *, match_memory: bool = False, part_size: int | None = None, block: int = 64 << 10
) -> FileLayout:
    """Place each item in the file; an item sharing storage with an earlier one (a tied
    weight) is written once and aliases it. With ``match_memory`` a large
    CPU tensor is placed at an offset congruent to its address modulo 4096, so its
    whole pages can be written with O_DIRECT straight from its memory. With
    ``part_size`` (object stores) a fragment that crosses a part boundary starts at a
    multiple of ``block``, so every part boundary cuts it between checksum blocks."""
    offsets: list[int] = []
    source: list[int] = []
    unique: list[int] = []
    first_at: dict[tuple, int] = {}
    end = 0
    for index, piece in enumerate(pieces):
        ident = storage_identity(piece.tensor)
        if ident in first_at:
            offsets.append(offsets[first_at[ident]])
            source.append(first_at[ident])
            continue
        nbytes = piece.tensor.numel() * piece.tensor.element_size()
        first_at[ident] = index
        t = piece.tensor
        phase = t.data_ptr() % 4096 if match_memory and t.device.type == "cpu" and t.is_contiguous() else 0
        # an empty item takes no place: aligning it would leave the file's declared
        # size beyond its last written byte (stores that keep only what was written differ)
        start = _align(end, nbytes, phase) if nbytes else end
        if part_size and nbytes and start // part_size != (start + nbytes - 1) // part_size:
            start = -(-start // block) * block
        offsets.append(start)
        source.append(index)
        unique.append(index)
        end = start + nbytes
    return FileLayout(offsets, source, unique, end)


#: Fragments smaller than this are packed together into one staged chunk (one write
#: instead of many small ones); larger ones get chunks of their own, written from
#: their own memory when the save is synchronous.
PACK_BELOW = 1 << 20


def plan_chunks(spans: list[tuple[int, int, int]], chunk_bytes: int) -> list[Chunk]:
    """Chunks for (item, file offset, nbytes) spans given in file order."""
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for item, offset, nbytes in spans:
        if nbytes == 0:
            continue
        if nbytes >= min(chunk_bytes, PACK_BELOW):
            current = None
            for s in range(0, nbytes, chunk_bytes):
                n = min(chunk_bytes, nbytes - s)
                chunks.append(Chunk(offset + s, n, [Segment(item, s, n, 0)]))
            continue
        if current is not None and offset + nbytes - current.offset <= chunk_bytes:
            current.segments.append(Segment(item, 0, nbytes, offset - current.offset))
            current.nbytes = offset + nbytes - current.offset
        else:
            current = Chunk(offset, nbytes, [Segment(item, 0, nbytes, 0)])
            chunks.append(current)
    return chunks


def plan_packed_chunks(spans: list[tuple[int, int, int]], chunk_bytes: int, block: int) -> list[Chunk]:
    """Chunks for (item, file offset, nbytes) spans given in file order, packed: each
    chunk fills its slab as far as the next item allows, whatever the items' sizes.
    An item that does not fit the room left is split at a multiple of ``block`` from
    its start (each piece's block checksums are the item's), its head ending the
    chunk and its tail starting the next. What an asynchronous save stages: the
    staging memory it takes is then about the state's bytes (one slab per chunk),
    where :func:`plan_chunks` gives each item of 1 MiB or more slabs of its own (a
    4 MiB tensor would take a whole 32 MiB slab)."""
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for item, offset, nbytes in spans:
        pos = 0
        while pos < nbytes:
            at = offset + pos
            if current is not None:
                room = current.offset + chunk_bytes - at
                take = nbytes - pos if nbytes - pos <= room else max(0, room) // block * block
                if take > 0:
                    current.segments.append(Segment(item, pos, take, at - current.offset))
                    current.nbytes = at + take - current.offset
                    pos += take
                    continue
                current = None  # full: the rest starts a chunk of its own
            take = min(chunk_bytes, nbytes - pos)
            current = Chunk(at, take, [Segment(item, pos, take, 0)])
            chunks.append(current)
            pos += take
    return chunks


def plan_part_chunks(spans: list[tuple[int, int, int]], part_size: int, size: int) -> list[Chunk]:
    """One chunk per part of ``[0, size)`` (the last one shorter): what a multipart
    upload needs. Items are cut at part boundaries; bytes no item covers are padding."""
    chunks = [Chunk(k, min(part_size, size - k), []) for k in range(0, size, part_size)]
    for item, offset, nbytes in spans:
        pos = 0
        while pos < nbytes:
            at = offset + pos
            chunk = chunks[at // part_size]
            n = min(nbytes - pos, chunk.offset + chunk.nbytes - at)
            chunk.segments.append(Segment(item, pos, n, at - chunk.offset))
            pos += n
    return chunks


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Everything a write pipeline works out from its items before copying a byte:
    kept with the rank's prepared tensors (``bcp.kept_plans``) and reused while
    the structure, this rank's writes and the backend and pool settings are unchanged.
    Read-only once made (two saves in flight may share it)."""

    file_layout: FileLayout
    chunks: list[Chunk]
    #: bytes of every item
    item_nbytes: list[int]
    #: the devices whose tensors are copied on a side stream, sorted
    devices: list[torch.device]
    #: per item: 0, or a dense host tensor (its bytes are its own memory, read as they
    #: are): 1, or 2 when its dtype has a numpy twin (read through ``Tensor.numpy``)
    host_dense: list[int]
    #: per item: a dense host tensor's address (``data_ptr()``), else 0: valid while the
    #: plan is, the kept plan's fingerprint holding every address (``bcp.kept_plans``)
    addresses: list[int]
    #: per unique item: how many segments read it
    uses: Mapping[int, int]
    #: the items with the caller's tensors let go (what the pipeline keeps once staged)
    released: list[Any]
    #: what the first save that asks works out from the plan (:meth:`batches`, :meth:`host_range`)
    worked_out: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def batches(self, batch_bytes: int, block: int) -> tuple[list[Chunk], dict[int, int]]:
        """A sync save's batches of ``batch_bytes`` (:func:`plan_packed_chunks`) and how
        many of them read each item, cut once per plan (the same from any thread)."""
        key = ("batches", batch_bytes, block)
        if key not in self.worked_out:
            layout = self.file_layout
            spans = [(i, layout.offsets[i], self.item_nbytes[i]) for i in layout.unique]
            batches = plan_packed_chunks(spans, batch_bytes, block)
            self.worked_out[key] = (batches, count_uses(batches))
        return self.worked_out[key]

    def host_range(self) -> tuple[int, int]:
        """(start, end) of the addresses holding every dense host item's bytes ((0, 0)
        if none): a sync save's batches slice one view of it (``WritePipeline._batch``)."""
        if "host_range" not in self.worked_out:
            dense = zip(self.addresses, self.item_nbytes, self.host_dense, strict=True)
            held = [(a, n) for a, n, d in dense if d and n]
            low = min((a for a, _n in held), default=0)
            self.worked_out["host_range"] = (low, max((a + n for a, n in held), default=low))
        return self.worked_out["host_range"]


def count_uses(chunks: Sequence[Chunk]) -> dict[int, int]:
    """Item -> how many segments of ``chunks`` read it."""
    uses: dict[int, int] = {}
    for chunk in chunks:
        for seg in chunk.segments:
            uses[seg.item] = uses.get(seg.item, 0) + 1
    return uses


def plan_pipeline(
    pieces: Sequence[Piece],
    *,
    match_memory: bool,
    part_size: int | None,
    block: int,
    slab_bytes: int,
    packed: bool,
    is_device: Callable[[torch.Tensor], bool],
    released: list[Any],
) -> PipelinePlan:
    """A write pipeline's plan for ``pieces`` (:func:`layout`'s options; ``packed``:
    every chunk is staged, :func:`plan_packed_chunks`, else :func:`plan_chunks`; with
    ``part_size``, :func:`plan_part_chunks`)."""
    tensors = [p.tensor for p in pieces]
    placed = layout(pieces, match_memory=match_memory, part_size=part_size, block=block)
    nbytes = [t.numel() * t.element_size() for t in tensors]
    spans = [(i, placed.offsets[i], nbytes[i]) for i in placed.unique]
    if part_size is not None:
        chunks = plan_part_chunks(spans, part_size, placed.size)
    elif packed:  # everything is copied: fill the slabs (none is written from the tensor's memory)
        chunks = plan_packed_chunks(spans, slab_bytes, block)
    else:
        chunks = plan_chunks(spans, slab_bytes)
    device = [is_device(t) for t in tensors]
    host_dense = [
        (2 if t.dtype in NUMPY_DTYPES else 1)
        if not d and t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
        else 0
        for t, d in zip(tensors, device, strict=True)
    ]
    address = [t.data_ptr() if dense else 0 for t, dense in zip(tensors, host_dense, strict=True)]
    if packed or part_size is not None:  # every chunk is staged (copied into a slab)
        for chunk in chunks:
            chunk.copies = chunk_copies(chunk, address)
    return PipelinePlan(
        file_layout=placed,
        chunks=chunks,
        item_nbytes=nbytes,
        devices=sorted({t.device for t, d in zip(tensors, device, strict=True) if d}, key=str),
        host_dense=host_dense,
        addresses=address,
        uses=count_uses(chunks),
        released=released,
    )


#: Bytes of one part of a staged chunk's runs: the unit the caller and the copy helpers
#: take in turn (``chunk_bytes.RunCopies``); a larger run is split.
COPY_PART_BYTES = 4 << 20

#: Padding shorter than this is zeroed through :attr:`ChunkCopies.zeros` (one numpy
#: assignment a chunk), longer padding by a ``memset`` run of its own.
SHORT_PADDING = 256


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkCopies:
    """A staged chunk of dense host tensors as raw copies (``WritePipeline._stage_runs``)."""

    #: (offset in the chunk, source address or 0 for zeros, nbytes), in chunk order, in parts
    #: of about :data:`COPY_PART_BYTES` (runs longer than that split)
    parts: tuple[tuple[tuple[int, int, int], ...], ...]
    #: offsets in the chunk of every byte of the short padding (zeroed at once), or None
    zeros: Any = None


def chunk_copies(chunk: Chunk, address: Sequence[int]) -> ChunkCopies | None:
    """``chunk``'s bytes as runs covering it exactly (the padding zeroed), when every
    segment's source is dense host memory (``address[item]`` non-zero); else None.
    Staging such a chunk costs one ``memmove`` a segment, or one for segments adjacent
    both in the chunk and in memory (views of one buffer): no Python object per tensor."""
    runs: list[tuple[int, int, int]] = []
    short: list[tuple[int, int]] = []
    cursor = 0

    def pad(at: int, n: int) -> None:
        if n >= SHORT_PADDING:
            runs.append((at, 0, n))
        elif n > 0:
            short.append((at, n))

    for seg in chunk.segments:
        src = address[seg.item]
        if not src:
            return None
        if not seg.nbytes:
            continue  # no bytes to copy: runs on either side may still be one copy
        pad(cursor, seg.at - cursor)  # never leak an earlier save's bytes
        src += seg.start
        last = runs[-1] if runs else (0, 0, 0)
        if last[1] and last[0] + last[2] == seg.at and last[1] + last[2] == src:
            runs[-1] = (last[0], last[1], last[2] + seg.nbytes)  # adjacent in the chunk and in memory: one copy
        else:
            runs.append((seg.at, src, seg.nbytes))
        cursor = seg.at + seg.nbytes
    pad(cursor, chunk.nbytes - cursor)
    zeros = np.concatenate([np.arange(at, at + n, dtype=np.intp) for at, n in short]) if short else None
    return ChunkCopies(split_parts(runs, COPY_PART_BYTES), zeros)


def split_parts(runs: Sequence[tuple[int, int, int]], part: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """``runs`` cut into consecutive parts of about ``part`` bytes (a run crossing a
    part's end is split there), covering exactly the same bytes in the same order."""
    parts: list[tuple[tuple[int, int, int], ...]] = []
    current: list[tuple[int, int, int]] = []
    room = part
    for at, src, n in runs:
        while n > room:
            if room:
                current.append((at, src, room))
                at, src, n = at + room, src + room if src else 0, n - room
            parts.append(tuple(current))
            current, room = [], part
        current.append((at, src, n))
        room -= n
    if current:
        parts.append(tuple(current))
    return tuple(parts)
