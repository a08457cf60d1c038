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
one, is filled through a device temporary (allocated on the side stream) that is
then copied or cast into place on the device: extra device memory for one tensor.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from bcp.metadata import TensorEntry

from ..boxes import Box
from ..tensor_io import flat_bytes, raw
from .device_copy import DeviceCopies, settle
from .read_exec import ReadStats, execute_reads
from .read_plan import RunSet, plan_tensor_reads
from .staging import StagingPool

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
    """One contiguous part of a destination, read through a slab."""

    target: torch.Tensor  # flat uint8 view of the device memory the piece lands in
    plans: list[RunSet]  # reads of the piece, dest offsets relative to the piece
    nbytes: int
    phase: int  # wanted slab offset modulo 4096 (the first read's file offset)


@dataclasses.dataclass(slots=True)
class _SlabJob:
    pieces: list[_Piece]
    nbytes: int = 0


def _piece_plans(
    entry: TensorEntry, box: Box, itemsize: int, limit: int, block: int, prefer_rank: int, in_memory: frozenset
) -> list[tuple[int, int, list[RunSet]]]:
    """(byte offset in the box, bytes, reads) of each contiguous piece of ``box``."""
    b_off, b_len = box
    strides = [math.prod(b_len[d + 1 :]) for d in range(len(b_len))]
    out = []
    for rel_off, p_len in contiguous_pieces(tuple(b_len), itemsize, limit, block):
        start = sum(o * s for o, s in zip(rel_off, strides, strict=True)) * itemsize
        p_box = (tuple(o + r for o, r in zip(b_off, rel_off, strict=True)), tuple(p_len))
        plans = plan_tensor_reads(entry, [p_box], prefer_rank=prefer_rank, in_memory=in_memory)
        out.append((start, math.prod(p_len) * itemsize, plans))
    return out


class DeviceFill:
    """Fills device destinations of one ``CheckpointReader.fill`` call.

    1. ``add`` each (entry, box, destination) (calling thread).
    2. ``run`` (calling thread): reads, copies, casts; returns once every byte is on
       the device and the slabs are back in the pool.
    """

    def __init__(self, pool: StagingPool, copies: DeviceCopies, *, block: int, prefer_rank: int) -> None:
        self.pool, self.copies, self.block, self.prefer_rank = pool, copies, block, prefer_rank
        self.limit = max(pool.slab_bytes - 4096, 4096)
        self.pieces: list[_Piece] = []
        self.finals: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, device temporary)
        self.host_parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device slice, host values)

    def landing(self, dest: torch.Tensor, stored: torch.dtype, shape: tuple) -> torch.Tensor:
        """Where the stored bytes of ``dest`` land: ``dest`` itself when dense and of the
        stored dtype, else a device temporary copied into ``dest`` at the end."""
        dest = dest.detach()
        if dest.is_contiguous() and dest.dtype == stored and not dest.is_conj() and not dest.is_neg():
            return dest
        temp = self.copies.empty(shape, stored, dest.device)
        self.finals.append((dest, temp))
        return temp

    def add(self, entry: TensorEntry, box: Box, landing: torch.Tensor, in_memory: frozenset) -> None:
        itemsize = landing.element_size()
        flat = flat_bytes(landing) if landing.numel() else None
        for start, nbytes, plans in _piece_plans(
            entry, box, itemsize, self.limit, self.block, self.prefer_rank, in_memory
        ):
            if not plans or flat is None:
                continue
            first = min(plans, key=lambda p: int(p.dst[0]))
            phase = (first.fragment.byte_offset + int(first.src[0]) - int(first.dst[0])) % 4096
            self.pieces.append(_Piece(flat[start : start + nbytes], plans, nbytes, phase))

    def add_host_part(self, device_slice: torch.Tensor, values: torch.Tensor) -> None:
        """Values already in host memory (shared by another rank) for part of a landing."""
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

    def _run_job(self, backend, job: _SlabJob, verify: bool) -> ReadStats:
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
            for piece, view in zip(job.pieces, views, strict=True):
                events.append(self.copies.to_device(piece.target, view))
            for event in events:  # the slab is reused only once its copies have run
                event.synchronize()
            events = []
            return stats
        finally:
            settle(events)  # an error: still wait for what was queued before handing the slab back
            self.pool.release(slab)

    def run(self, backend, *, verify: bool, streams: int) -> ReadStats:
        stats = ReadStats()
        for device_slice, values in self.host_parts:  # pageable host memory: torch copies synchronously
            self.copies.to_device(*_bitwise(device_slice, values))
        jobs = self._jobs()
        try:
            if streams <= 1 or len(jobs) <= 1:
                for job in jobs:
                    stats.add(self._run_job(backend, job, verify))
            else:
                with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="bcp-device-reader") as workers:
                    futures = [workers.submit(self._run_job, backend, job, verify) for job in jobs]
                    errors = []
                    for future in futures:
                        try:
                            stats.add(future.result())
                        except BaseException as e:  # noqa: BLE001 - first error wins, after all jobs stop
                            errors.append(e)
                    if errors:
                        raise errors[0]
            for dest, temp in self.finals:
                self.copies.to_device(*_bitwise(dest, temp))
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
