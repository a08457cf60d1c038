"""Loading into device (CUDA) tensors: reads land in pinned slabs and are copied to
the device asynchronously while the next reads run.

Each destination box is cut into pieces contiguous in its row-major bytes, each at
most a slab (pieces end on checksum-block boundaries where the shape allows, so
verification reads nothing extra). Small pieces share a slab. ``streams`` workers
each take a slab's worth of pieces: read and verify them into the slab, queue the
host-to-device copies on the side stream, wait for those copies, hand the slab
back. So reads of one slab overlap the copies of another, and host memory in use
stays at ``streams`` slabs, never the whole state.

A destination that is not dense row-major, or has another dtype than the stored
one, is filled piece by piece through a device temporary of the piece (allocated on
the side stream, freed once it is copied or cast into place): extra device memory
is at most one piece (a slab) per reading stream, whatever the number and size of
such destinations.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from bcp import trace
from bcp.backends import Backend
from bcp.io_scheduler.device_copy import DeviceCopies, settle
from bcp.io_scheduler.read_exec import ReadStats, execute_reads
from bcp.io_scheduler.read_plan import RunSet, plan_tensor_reads
from bcp.io_scheduler.run_all import run_all
from bcp.io_scheduler.staging import StagingPool
from bcp.metadata import TensorEntry
from bcp.metadata.geometry import Box
from bcp.tensor_io import flat_bytes, raw

#: Pieces smaller than this share slabs; larger ones get a slab of their own, placed
#: so that the memory address and the file offset agree modulo 4096 (O_DIRECT).
SHARE_BELOW = 4 << 20


def contiguous_pieces(lengths: tuple[int, ...], itemsize: int, limit: int, block: int) -> list[tuple[tuple, tuple]]:
    """(offsets, lengths) sub-boxes of a box of ``lengths``, in row-major order, each
    contiguous in the box's row-major bytes and at most ``limit`` bytes. Cuts fall on
    multiples of ``block`` bytes where whole rows allow it."""
    if not lengths:
        return [((), ())]
    if math.prod(lengths) == 0:
        return []
    limit = max(limit, itemsize)
    row = math.prod(lengths[1:]) * itemsize
    if row * lengths[0] <= limit:
        return [((0,) * len(lengths), tuple(lengths))]
    rest = (0,) * (len(lengths) - 1)
    if row <= limit:
        rows = limit // row
        step = block // math.gcd(row, block)  # rows per whole number of checksum blocks
        if rows >= step:
            rows -= rows % step
        return [((r, *rest), (min(rows, lengths[0] - r), *lengths[1:])) for r in range(0, lengths[0], rows)]
    inner = contiguous_pieces(tuple(lengths[1:]), itemsize, limit, block)
    return [((r, *o), (1, *n)) for r in range(lengths[0]) for o, n in inner]


@dataclasses.dataclass(slots=True)
class _Piece:
    """One contiguous part of a destination's box, read through a slab."""

    #: flat uint8 view of the device memory the piece lands in; None when the
    #: destination takes the bytes through a temporary (``final``)
    target: torch.Tensor | None
    plans: list[RunSet]  # reads of the piece, dest offsets relative to the piece
    nbytes: int
    phase: int  # wanted slab offset modulo 4096 (the first read's file offset)
    #: the part of a strided or cast destination this piece fills (from a device
    #: temporary of ``shape`` and the stored ``dtype``, made only while the piece lands)
    final: torch.Tensor | None = None
    shape: tuple = ()
    dtype: torch.dtype | None = None


@dataclasses.dataclass(slots=True)
class _SlabJob:
    pieces: list[_Piece]
    nbytes: int = 0


def _piece_plans(
    entry: TensorEntry, box: Box, itemsize: int, limit: int, block: int, prefer_rank: int, in_memory: frozenset
) -> list[tuple[tuple, tuple, int, int, list[RunSet]]]:
    """(offsets in the box, lengths, byte offset in the box, bytes, reads) of each
    contiguous piece of ``box``."""
    b_off, b_len = box
    strides = [math.prod(b_len[d + 1 :]) for d in range(len(b_len))]
    out = []
    for rel_off, p_len in contiguous_pieces(tuple(b_len), itemsize, limit, block):
        start = sum(o * s for o, s in zip(rel_off, strides, strict=True)) * itemsize
        p_box = (tuple(o + r for o, r in zip(b_off, rel_off, strict=True)), tuple(p_len))
        plans = plan_tensor_reads(entry, [p_box], prefer_rank=prefer_rank, in_memory=in_memory)
        out.append((tuple(rel_off), tuple(p_len), start, math.prod(p_len) * itemsize, plans))
    return out


def lands_directly(dest: torch.Tensor, stored: torch.dtype) -> bool:
    """Whether the stored bytes can be copied straight into ``dest``: dense row-major,
    of the stored dtype, no lazy conjugate or negative bit."""
    return dest.is_contiguous() and dest.dtype == stored and not dest.is_conj() and not dest.is_neg()


class DeviceFill:
    """Fills device destinations of one ``CheckpointReader.fill`` call.

    1. ``add`` each (entry, box, destination) and ``add_host_part`` values already in
       host memory (calling thread).
    2. ``run`` (calling thread): reads, copies, casts; returns once every byte is on
       the device and the slabs are back in the pool.

    A destination that is strided or of another dtype than the stored one is filled
    piece by piece through a device temporary of the piece (at most a slab), made on
    the side stream when the piece's slab is copied and freed once the piece is
    copied or cast into place: extra device memory is at most one piece per reading
    stream, never a temporary per destination.
    """

    def __init__(self, pool: StagingPool, copies: DeviceCopies, *, block: int, prefer_rank: int) -> None:
        self.pool, self.copies, self.block, self.prefer_rank = pool, copies, block, prefer_rank
        self.limit = max(pool.slab_bytes - 4096, 4096)
        self.pieces: list[_Piece] = []
        self.host_parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device slice, host values)

    def add(self, entry: TensorEntry, box: Box, dest: torch.Tensor, stored: torch.dtype, in_memory: frozenset) -> None:
        """Read box ``box`` of ``entry`` (stored as ``stored``) into ``dest`` (its shape)."""
        dest = dest.detach()
        if not dest.numel():
            return
        direct = lands_directly(dest, stored)
        flat = flat_bytes(dest) if direct else None
        for rel_off, p_len, start, nbytes, plans in _piece_plans(
            entry, box, stored.itemsize, self.limit, self.block, self.prefer_rank, in_memory
        ):
            if not plans:
                continue
            first = min(plans, key=lambda p: int(p.dst[0]))
            phase = (first.fragment.byte_offset + int(first.src[0]) - int(first.dst[0])) % 4096
            if flat is not None:
                self.pieces.append(_Piece(flat[start : start + nbytes], plans, nbytes, phase))
            else:
                part = dest[tuple(slice(o, o + n) for o, n in zip(rel_off, p_len, strict=True))]
                self.pieces.append(_Piece(None, plans, nbytes, phase, part, p_len, stored))

    def add_host_part(self, device_slice: torch.Tensor, values: torch.Tensor) -> None:
        """Values already in host memory (shared by another rank) for part of a
        destination; copied after every piece (a piece's slab holds no bytes for
        them, and its copy covers them)."""
        self.host_parts.append((device_slice, values))

    def _jobs(self) -> list[_SlabJob]:
        jobs: list[_SlabJob] = []
        small: _SlabJob | None = None
        for piece in self.pieces:
            if piece.nbytes >= SHARE_BELOW:
                jobs.append(_SlabJob([piece], piece.nbytes))
                continue
            at = -(-small.nbytes // 64) * 64 if small is not None else 0
            if small is None or at + piece.nbytes > self.limit:
                small = _SlabJob([], 0)
                jobs.append(small)
                at = 0
            small.pieces.append(piece)
            small.nbytes = at + piece.nbytes
        return jobs

    def _land(self, piece: _Piece, view: torch.Tensor) -> list:
        """Queue the copies that put ``view``'s bytes into the piece's destination."""
        if piece.target is not None:
            return [self.copies.to_device(piece.target, view)]
        assert piece.final is not None and piece.dtype is not None, "a piece lands directly or through a temporary"
        temp = self.copies.empty(piece.shape, piece.dtype, piece.final.device)  # on the side stream
        events = [self.copies.to_device(flat_bytes(temp), view)]
        events.append(self.copies.to_device(*_bitwise(piece.final, temp)))
        return events  # ``temp`` is freed here: the allocator reuses it only behind these copies

    def _run_job(self, backend: Backend, job: _SlabJob, verify: bool) -> ReadStats:
        slab = self.pool.acquire()
        events: list = []
        try:
            if len(job.pieces) == 1:
                piece = job.pieces[0]
                views = [slab.view(piece.nbytes, shift=piece.phase)]
            else:
                views, at = [], 0
                for piece in job.pieces:
                    at = -(-at // 64) * 64
                    views.append(slab.tensor[at : at + piece.nbytes])
                    at += piece.nbytes
            plans = [dataclasses.replace(p, dest=i) for i, piece in enumerate(job.pieces) for p in piece.plans]
            mem = [memoryview(v.numpy()).cast("B") for v in views]  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ only for Python >= 3.12
            stats = execute_reads(backend, plans, mem, block_bytes=self.block, verify=verify, streams=1)
            with trace.span("h2d", sum(p.nbytes for p in job.pieces) if trace.enabled() else 0):
                for piece, view in zip(job.pieces, views, strict=True):
                    events.extend(self._land(piece, view))
                for event in events:  # the slab is reused only once its copies have run
                    event.synchronize()
            events = []
            return stats
        finally:
            settle(events)  # an error: still wait for what was queued before handing the slab back
            self.pool.release(slab)

    def run(self, backend: Backend, *, verify: bool, streams: int) -> ReadStats:
        stats = ReadStats()
        jobs = self._jobs()
        try:
            for done in run_all(
                lambda job: self._run_job(backend, job, verify), jobs, streams=streams, name="bcp-device-reader"
            ):
                stats.add(done)
            # after every piece on the same stream: a piece's copy covers held parts with slab bytes
            for device_slice, values in self.host_parts:  # pageable host memory: torch copies synchronously
                self.copies.to_device(*_bitwise(device_slice, values))
        finally:
            self.copies.wait()  # every byte is on the device before load returns
        return stats


def _bitwise(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of ``dst[...] = src``: same-width integer views when the dtypes
    match (bit-exact; torch has no CUDA copy kernel for sub-byte dtypes), the tensors
    themselves for a cast or a conjugate/negative view (whose bits the copy applies)."""
    if dst.dtype == src.dtype and not (dst.is_conj() or dst.is_neg() or src.is_conj() or src.is_neg()):
        return raw(dst), raw(src)
    return dst, src
