"""The bulk read of a load's tensors stored whole (issue 37, per-tensor costs).

A load of 10,000 small tensors spent most of its time on objects made per tensor:
a Fragment, a RunSet, runs and parts, a request each, and the grouping of all of them
(read_exec.execute_reads). Here a tensor stored whole in one row and wanted whole is
one :class:`WholeRead` tuple: the reads are sorted by file and offset, batched where
they follow each other in a file, and each destination's blocks are verified with one
CRC32C call as it lands, against expected values combined for every read in one
vectorised pass. Guarantees are read_exec's: every byte verified before the call
returns, errors naming the tensor, file and offset (the Fragment is built only then).
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from bcp import trace
from bcp.backends import Backend, ObjectNotFoundError, read_into_many
from bcp.io_scheduler import device_copy, read_exec
from bcp.io_scheduler.read_exec import (
    COALESCE_BELOW,
    COALESCE_BUDGET,
    COALESCE_BYTES,
    ReadStats,
)
from bcp.io_scheduler.run_all import run_all
from bcp.io_scheduler.shared_dest import Span
from bcp.metadata import Catalog, Fragment
from bcp.metadata.checksum import combine_block_runs, combine_blocks, crc32c_c
from bcp.metadata.geometry import Box
from bcp.references import describe_file
from bcp.tensor_io import address_view
from bcp.torch_dtypes import torch_dtype_or_none

if TYPE_CHECKING:
    from bcp.metadata.catalog.whole import WholeRows

#: A tensor larger than this is read in ranges of about this size (from memory, of a
#: stream's task if larger), shared out among the streams, as the planner cuts a large
#: run (:data:`~.read_exec.READ_PIECE_BYTES`).
SPLIT_ABOVE = 32 << 20
#: The largest tensor the bulk path takes (None: any size); tests lower it to send
#: tensors to the planner.
BULK_LARGEST: int | None = None
#: Tensors of a batch found in memory are read in one vectored read where they follow
#: each other across less than this (the bytes between go to a scratch buffer).
GAP_BYTES = 64


class WholeRead(NamedTuple):
    """A whole stored fragment (one writer saved the tensor whole) read into a
    destination of exactly its bytes: the common load, planned without a RunSet or a
    Fragment (one is built only to name an error)."""

    fqn: str
    file: str
    offset: int
    nbytes: int
    #: where the fragment's block checksums start in the flat checksum column
    sum_start: int
    #: the destination's bytes, a slice of a raw view that holds no reference to it
    target: memoryview
    #: the destination itself: holds it alive while ``target`` is written
    dest: torch.Tensor


def split_whole(
    catalog: Catalog,
    block: int,
    requests: list[tuple[str, Box, torch.Tensor]],
    in_memory: dict[tuple[str, Box], torch.Tensor],
    spans: list[Span],
) -> tuple[list[WholeRead], np.ndarray, list[tuple[str, Box, torch.Tensor]]]:
    """Split off the requests the bulk path reads (:func:`execute_whole_reads`): the
    whole tensor wanted, stored whole in one row (:meth:`Catalog.whole_rows`), of any
    size (tests lower :data:`BULK_LARGEST`), into a dense CPU tensor of its dtype, none
    of it at hand already; the rest is planned as before. Everything here is the
    checks fill makes, for the case where they all pass (any doubt: the rest).
    ``spans``: each destination's (address, bytes, dtype) if dense, else (0, 0, None), as
    :func:`~.shared_dest.without_shared_destinations` found them just before.
    Also the checksum column the reads' ``sum_start`` index."""
    if not requests:
        return [], np.zeros(0, np.uint32), requests
    if not catalog.is_whole:  # a catalog read in part: rows come with the boxes
        catalog.require([(fqn, box) for fqn, box, _dest in requests])
    info = catalog.whole_rows([fqn for fqn, _box, _dest in requests])
    whole, rest = pick_bulk(info, block, requests, in_memory, spans, exact=False)
    return whole, info.sums, rest  # the checksum column the reads index (a later require may replace it)


def pick_bulk(
    info: WholeRows,
    block: int,
    requests: list[tuple[str, Box, torch.Tensor]],
    in_memory: dict[tuple[str, Box], torch.Tensor],
    spans: list[Span],
    *,
    exact: bool,
) -> tuple[list[WholeRead], list[tuple[str, Box, torch.Tensor]]]:
    """The bulk reads of the requests whose rows ``info`` found (:meth:`Catalog.whole_rows`)
    and the requests left: a row of a size read in bulk with one checksum a block, none of
    the tensor at hand already, into a dense CPU destination of its dtype (``spans``: as
    :func:`split_whole` takes them) holding the whole tensor, or with ``exact`` (a box
    equal to one row, :mod:`.shard_reads`) of the box's shape."""
    # the catalog's side, for every request at once
    nbytes_all = info.nbytes_array
    fits = (info.row_array >= 0) & (nbytes_all > 0)
    if BULK_LARGEST is not None:  # read at run time (tests change it)
        fits &= nbytes_all <= BULK_LARGEST
    fits &= info.blocks_array == -(-nbytes_all // block)
    wanted = {name: torch_dtype_or_none(name) for name in set(info.dtypes)}
    if in_memory:
        held = {fqn for fqn, _box in in_memory}
        fits &= np.fromiter((fqn not in held for fqn, _box, _dest in requests), bool, len(requests))
    # the device seam (device_copy.api) decides what is device memory; the real one by device type
    on_device = None if getattr(device_copy.api, "by_device", False) else device_copy.api.is_device
    picked: list[int] = []  # the requests read in bulk, with their destinations' addresses
    ptrs: list[int] = []
    shapes, dtypes, all_nbytes = info.shapes, info.dtypes, info.nbytes
    # only the requests the catalog's side allows are looked at
    for i in np.flatnonzero(fits).tolist():
        ptr, size, dest_dtype = spans[i]  # found by the overlap check's pass: no tensor accessor here
        if size != all_nbytes[i] or dest_dtype is None or dest_dtype is not wanted[dtypes[i]]:
            continue  # not dense (strided, empty, meta), not the row's size, not plain CPU or another dtype
        _fqn, (d_off, d_len), dest = requests[i]
        if exact:
            if dest.shape != tuple(d_len):
                continue
        elif tuple(d_len) != shapes[i] or any(d_off):
            continue
        if on_device is not None and on_device(dest):
            continue
        picked.append(i)
        ptrs.append(ptr)
    if len(picked) == len(requests):
        rest: list[tuple[str, Box, torch.Tensor]] = []
    else:
        taken = np.ones(len(requests), bool)
        taken[picked] = False
        rest = [requests[i] for i in np.flatnonzero(taken).tolist()]
    targets = destination_views(ptrs, [all_nbytes[i] for i in picked])
    names, files, offsets, starts = info.file_names, info.files, info.byte_offsets, info.sum_starts
    new = tuple.__new__  # WholeRead's own __new__ is a Python call: 10,000 of them per load
    reads = [
        new(WholeRead, (requests[i][0], names[files[i]], offsets[i], all_nbytes[i], starts[i], target, requests[i][2]))
        for i, target in zip(picked, targets, strict=True)
    ]
    return reads, rest


def destination_views(ptrs: list[int], sizes: list[int]) -> list[memoryview]:
    """Writable byte views of the dense CPU destinations at addresses ``ptrs`` (from
    ``data_ptr()``) of ``sizes`` bytes: one memoryview over the address range they
    span, sliced once per destination. A view each through ``numpy()`` was a third
    of a load's per-tensor cost. The views hold no reference to the tensors: each
    :class:`WholeRead` holds its destination beside its view (and
    :meth:`CheckpointReader.fill` its requests) until every read has returned; only
    the slices are touched."""
    if not ptrs:
        return []
    low = min(ptrs)
    span = max(p + n for p, n in zip(ptrs, sizes, strict=True)) - low
    whole = address_view(low, span)
    return [whole[p - low : p - low + n] for p, n in zip(ptrs, sizes, strict=True)]


def execute_whole_reads(
    backend: Backend,
    reads: list[WholeRead],
    sums: np.ndarray,
    fragment: Callable[[WholeRead], Fragment],
    *,
    block_bytes: int,
    verify: bool = True,
    streams: int | None = None,
) -> ReadStats:
    """Carry out ``reads`` in bulk (``sums``: the flat block checksum column their
    ``sum_start`` index; ``fragment(read)``: the stored row ``read`` reads, built only
    to name an error): sorted by file and offset, those that follow each other in a file (across
    less than :data:`~.read_exec.MAX_PADDING` bytes) grouped into batches; a batch found in memory
    is read in place through one open file, tensors that follow each other in the file
    (across less than :data:`GAP_BYTES`, up to a piece of :data:`~.read_exec.IN_MEMORY_CHUNK`)
    in one vectored read
    (:func:`bcp.backends.read_into_many`), the others one each; a batch from storage in
    one request into scratch memory, copied into place. Every destination's blocks are
    checked as soon as it has landed: one CRC32C call over its whole blocks against
    their checksums combined (for every read in one vectorised pass beforehand), one
    for a short last block; block by block only on a mismatch, to name the block."""
    stats = ReadStats()
    if not reads:
        return stats
    block = block_bytes
    n = len(reads)
    # every read's numbers as arrays (no attribute access a read in Python): C-level gathers
    nbytes_np = np.fromiter(map(_NBYTES, reads), np.int64, n)
    offsets_np = np.fromiter(map(_OFFSET, reads), np.int64, n)
    full_np = nbytes_np // block
    full: list[int] = full_np.tolist()
    expected: list[int] = [0] * n
    tails: list[int] = [0] * n
    # one CRC32C over a read's destination is checked against ``wants`` where ``cuts`` is 0
    # (whole blocks, or one short block); elsewhere its whole blocks and its tail apart from
    # the cut, or check_one at -1 (read whole from storage: its blocks combined then). Lists,
    # so that the reader threads ask no read for an attribute per tensor
    wants = expected
    first_piece: list[int] = []  # a read from memory in pieces: its first piece's index in piece_wants
    piece_wants: list[int] = []
    chunk = -(-read_exec.IN_MEMORY_CHUNK // block) * block  # larger ones from memory are checked piece by piece
    if verify:
        starts = np.fromiter(map(_SUM_START, reads), np.int64, n)
        has_tail = nbytes_np % block != 0
        expected_np = sums[starts]
        tails_np = sums[np.where(has_tail, starts + full_np, starts)]
        multi = np.flatnonzero((full_np > 1) & (nbytes_np <= chunk))
        if len(multi):
            runs = np.stack((starts[multi], starts[multi] + full_np[multi]), axis=1)  # no list of pairs
            expected_np[multi] = combine_block_runs(sums, block, runs)
        expected, tails = expected_np.tolist(), tails_np.tolist()
        wants = np.where(full_np == 0, tails_np, expected_np).tolist()
        first_piece, piece_wants = piece_checksums(sums, starts, nbytes_np, block, chunk)
    whole_np = full_np * block
    cut_np = np.where((whole_np == nbytes_np) | (full_np == 0), 0, whole_np)
    cuts: list[int] = np.where((full_np > 1) & (nbytes_np > chunk), -1, cut_np).tolist()
    targets: list[memoryview] = list(map(_TARGET, reads))
    ends: list[int] = (offsets_np + nbytes_np).tolist()
    offsets: list[int] = offsets_np.tolist()
    file_names = sorted(set(map(_FILE, reads)))
    code_of = {f: c for c, f in enumerate(file_names)}
    file_codes = np.fromiter(map(code_of.__getitem__, map(_FILE, reads)), np.int64, n)
    order_np = np.lexsort((offsets_np, file_codes))  # by file, then offset (stable: as sorted() did)
    order: list[int] = order_np.tolist()
    total = int(nbytes_np.sum())
    streams = streams or backend.hints.concurrency
    limit = max(COALESCE_BELOW, min(COALESCE_BYTES, COALESCE_BUDGET // max(streams, 1)))
    nbytes_sorted = nbytes_np[order_np]
    spans_at = batch_bounds(file_codes[order_np], offsets_np[order_np], nbytes_sorted, read_exec.MAX_PADDING, limit)
    batches = [order[a:b] for a, b in spans_at]
    name = describe_file(backend)
    check = verify

    def verify_one(i: int) -> None:
        if trace.enabled():  # a span per tensor only when traced
            with trace.span("verify", reads[i].nbytes):
                check_one(i)
        else:
            check_one(i)

    def check_one(i: int) -> None:
        r = reads[i]
        target, f = r.target, full[i]
        if f > 1 and r.nbytes > chunk:  # read whole from storage: its blocks combined now
            check_range(i, 0, r.nbytes)
            return
        whole = f * block
        ok = not f or crc32c_c(target[:whole]) == expected[i]
        if ok and whole < r.nbytes:
            ok = crc32c_c(target[whole:]) == tails[i]
        if not ok:
            frag = fragment(r)
            read_exec.name_block(name, frag, 0, target, block, range(len(frag.checksums)))

    def check_many(many: list[int]) -> None:
        """:func:`verify_one` of each of ``many``, in one loop without a call a tensor
        beyond its CRC32C (a load of 10,000 small tensors); a mismatch named by check_one."""
        if trace.enabled():
            for i in many:
                verify_one(i)
            return
        for i in many:
            cut = cuts[i]
            if not cut:  # whole blocks only, or one short block (nbytes is never 0 here)
                if crc32c_c(targets[i]) != wants[i]:
                    check_one(i)
            elif cut < 0 or crc32c_c(targets[i][:cut]) != expected[i] or crc32c_c(targets[i][cut:]) != tails[i]:
                check_one(i)

    def read_in_pieces(i: int, read: Callable[[int, memoryview], None], lo: int = 0, hi: int = 0) -> None:
        """A read from memory larger than :data:`~.read_exec.IN_MEMORY_CHUNK` (its bytes ``lo``
        to ``hi``, a multiple of the chunk from ``lo``; all by default), in pieces of about
        that size, each piece's whole blocks checked while still in the CPU cache against
        the value :func:`piece_checksums` combined for it before the readers started (a
        numpy pass a tensor here held the other readers back)."""
        r = reads[i]
        n, whole = r.nbytes, full[i] * block
        k = first_piece[i] + lo // chunk
        for a in range(lo, hi or n, chunk):
            b = min(a + chunk, n)
            piece = r.target[a:b]
            try:
                read(r.offset + a, piece)
            except (ObjectNotFoundError, EOFError) as e:
                raise read_exec.read_error(name, fragment(r), a, e) from e
            top = min(b, whole)
            ok = top <= a or crc32c_c(piece[: top - a]) == piece_wants[k]
            if ok and b == n and whole < n:
                ok = crc32c_c(r.target[whole:]) == tails[i]
            if not ok:
                read_exec.name_block(name, fragment(r), 0, r.target, block, range(a // block, -(-b // block)))
            k += 1

    def read_range(i: int, resident: bool, lo: int, hi: int) -> tuple[int, int]:
        """Bytes ``lo`` to ``hi`` of a read too large for one stream (:data:`SPLIT_ABOVE`),
        one task among its others: from memory in pieces, each checked in cache; from
        storage in one request, its whole blocks then checked with one CRC32C call."""
        r = reads[i]
        try:
            with backend.reading(r.file) as read, trace.span("fetch", hi - lo):
                if check and resident:
                    read_in_pieces(i, read, lo, hi)
                    return 1, 0
                read(r.offset + lo, r.target[lo:hi])
        except (ObjectNotFoundError, EOFError) as e:
            raise read_exec.read_error(name, fragment(r), lo, e) from e
        if check:
            with trace.span("verify", hi - lo):
                check_range(i, lo, hi)
        return 1, 0

    def check_range(i: int, lo: int, hi: int) -> None:
        """Verify bytes ``lo`` to ``hi`` of a read (``lo`` a multiple of the block) from storage:
        one CRC32C call over its whole blocks against their checksums combined now, one for
        a short last block; a mismatch named block by block."""
        r = reads[i]
        whole = full[i] * block
        top, s = min(hi, whole), r.sum_start
        if top > lo and crc32c_c(r.target[lo:top]) != combine_blocks(sums[s + lo // block : s + top // block], block):
            read_exec.name_block(name, fragment(r), 0, r.target, block, range(lo // block, top // block))
        if hi == r.nbytes > whole and crc32c_c(r.target[whole:]) != tails[i]:
            read_exec.name_block(name, fragment(r), 0, r.target, block, range(full[i], full[i] + 1))

    def span_of(batch: list[int]) -> int:
        return reads[batch[-1]].offset + reads[batch[-1]].nbytes - reads[batch[0]].offset

    def adjacent(batch: list[int], k: int) -> tuple[list[int], list[memoryview]]:
        """The reads of ``batch`` from ``k`` on that follow each other in the file (across
        less than :data:`GAP_BYTES`: the writer aligns each tensor to 64 bytes), spanning
        at most a piece, and the buffers of one vectored read of them: their destinations,
        the bytes between read into a scratch. Checked while still in the CPU cache."""
        first = batch[k]
        start, end = offsets[first], ends[first]
        many, views = [first], [targets[first]]
        scratch = None
        for i in itertools.islice(batch, k + 1, None):
            gap = offsets[i] - end
            end = ends[i]
            if not 0 <= gap < GAP_BYTES or end - start > chunk:
                break
            if gap:
                if scratch is None:
                    scratch = memoryview(bytearray(GAP_BYTES))
                views.append(scratch[:gap])
            views.append(targets[i])
            many.append(i)
        return many, views

    def read_each(batch: list[int], resident: bool) -> tuple[int, int]:
        """Each read of ``batch`` in place, one request each (``resident``: in memory)."""
        at = reads[batch[0]]
        try:
            with backend.reading(at.file) as read, trace.span("fetch", span_of(batch)):
                k = 0
                while k < len(batch):
                    i = batch[k]
                    at = reads[i]
                    if check and resident and at.nbytes > chunk:
                        read_in_pieces(i, read)
                        k += 1
                        continue
                    many, views = adjacent(batch, k) if resident else ([i], [])
                    if len(many) > 1:  # one vectored read; each tensor verified after it as below
                        try:
                            read_into_many(read, at.offset, views)
                        except Exception:  # noqa: BLE001 - read one by one: the error names its tensor
                            for j in many:
                                at = reads[j]
                                read(at.offset, at.target)
                    else:
                        read(at.offset, at.target)
                    if check:
                        check_many(many)
                    k += len(many)
        except (ObjectNotFoundError, EOFError) as e:
            raise read_exec.read_error(name, fragment(at), 0, e) from e
        return len(batch), 0

    def run_batch(batch: list[int], resident: bool, lo: int, hi: int) -> tuple[int, int]:
        """(requests, padding bytes) of one batch (``resident``: found in memory), or of
        bytes ``lo`` to ``hi`` of its one read (``hi`` 0: all of the batch).
        Not recursive: a closure that calls itself is a reference cycle, which would keep
        the destinations alive until the garbage collector runs."""
        if hi:
            return read_range(batch[0], resident, lo, hi)
        if len(batch) == 1 or resident:
            return read_each(batch, resident)
        first = reads[batch[0]]
        span = span_of(batch)
        scratch = scratches.get(span, first.offset)
        try:
            with trace.span("fetch", span):
                backend.read_exact(first.file, first.offset, scratch)
        except (ObjectNotFoundError, EOFError):
            for i in batch:  # one by one, so the error names the tensor truly missing
                read_each([i], False)
            return len(batch), 0
        for i in batch:
            r = reads[i]
            at_ = r.offset - first.offset
            r.target[:] = scratch[at_ : at_ + r.nbytes]
            if check:
                verify_one(i)
        return 1, span - sum(reads[i].nbytes for i in batch)

    scratches = ThreadScratch(limit)  # freed with this call: each reader thread's, reused batch after batch
    # one probe per batch: a batch in memory is read tensor by tensor, so it is cut
    # into pieces enough to share out among the streams; one from storage stays whole
    tasks: list[tuple[list[int], bool]] = []
    resident_bytes = piece = 0
    for batch in batches:
        first = reads[batch[0]]
        resident = backend.in_memory(first.file, first.offset, span_of(batch))
        tasks.append((batch, resident))
        resident_bytes += span_of(batch) if resident else 0
    if resident_bytes:
        piece = max(read_exec.IN_MEMORY_CHUNK, resident_bytes // max(4 * streams, 1))
        cut: list[tuple[list[int], bool]] = []
        cum = np.concatenate(([0], np.cumsum(nbytes_sorted)))  # bytes before each position in ``order``
        for (a, b), (batch, resident) in zip(spans_at, tasks, strict=True):
            if not resident:
                cut.append((batch, resident))
                continue
            cut += [(order[x:y], True) for x, y in greedy_cuts(cum, a, b, piece)]
        tasks = cut
        if streams > read_exec.usable_cpus() and resident_bytes * 2 >= total:
            streams = read_exec.usable_cpus()  # copies from memory are CPU work
    # a read too large for one stream: in ranges of about SPLIT_ABOVE (from storage, as the
    # planner cuts a large run) or of a piece if larger (from memory), multiples of the chunk
    sub = -(-SPLIT_ABOVE // chunk) * chunk  # from storage even on one stream: a retry repeats one range
    ranged = split_large(tasks, nbytes_np, max(sub, -(-piece // chunk) * chunk), sub)
    done = run_all(lambda task: run_batch(*task), ranged, streams=streams, name="bcp-reader")
    stats.requests = sum(n for n, _p in done)
    stats.padding_bytes = sum(p for _n, p in done)
    stats.bytes_read = total
    return stats


def piece_checksums(
    sums: np.ndarray, starts: np.ndarray, nbytes: np.ndarray, block: int, chunk: int
) -> tuple[list[int], list[int]]:
    """For the reads larger than ``chunk`` (read from memory in pieces of it, from their
    start): the index of each one's first piece (0 for the others), and each piece's whole
    blocks' checksums combined (0 for a piece holding only a short last block), pieces in
    order, in one vectorised pass. ``starts``: each read's first block in ``sums``."""
    big = np.flatnonzero(nbytes > chunk)
    if not len(big):
        return [], []
    counts = -(-nbytes[big] // chunk)
    firsts = np.cumsum(counts) - counts
    first_piece = np.zeros(len(nbytes), np.int64)
    first_piece[big] = firsts
    of = np.repeat(big, counts)  # each piece's read
    lo = (np.arange(int(counts.sum())) - np.repeat(firsts, counts)) * chunk
    top = np.maximum(lo, np.minimum(lo + chunk, nbytes[of] // block * block))  # its whole blocks' end
    runs = np.stack((starts[of] + lo // block, starts[of] + top // block), axis=1)
    return first_piece.tolist(), combine_block_runs(sums, block, runs)


def split_large(
    tasks: list[tuple[list[int], bool]], nbytes: np.ndarray, from_memory: int, from_storage: int
) -> list[tuple[list[int], bool, int, int]]:
    """``tasks`` as (reads, resident, lo, hi): each read larger than a range (``from_memory``
    or ``from_storage`` bytes, as its task is resident or not) taken out of its batch into
    tasks of a range of it (``lo`` to ``hi``; the last may be less), for the streams to
    share; the reads between stay batched (``hi`` 0: the whole batch)."""
    out: list[tuple[list[int], bool, int, int]] = []
    for batch, resident in tasks:
        sub = from_memory if resident else from_storage
        if int(nbytes[batch].max()) <= sub:
            out.append((batch, resident, 0, 0))
            continue
        run: list[int] = []
        for i in batch:
            size = int(nbytes[i])
            if size <= sub:
                run.append(i)
                continue
            if run:
                out.append((run, resident, 0, 0))
                run = []
            out += [([i], resident, lo, min(size, lo + sub)) for lo in range(0, size, sub)]
        if run:
            out.append((run, resident, 0, 0))
    return out


def batch_bounds(
    files: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, pad: int, limit: int
) -> list[tuple[int, int]]:
    """The batches of reads sorted by (file, offset), as (first, end) positions: a read
    joins the batch before it when in the same file, starting less than ``pad`` bytes
    after the previous read ends (never before), and the batch then spans at most
    ``limit`` bytes. Found in numpy, a Python step a batch, not one a read (a load of
    10,000 tensors); the same batches as adding the reads one by one."""
    n = len(offsets)
    if not n:
        return []
    ends = offsets + nbytes
    gaps = offsets[1:] - ends[:-1]
    breaks = np.flatnonzero((files[1:] != files[:-1]) | (gaps < 0) | (gaps >= pad)) + 1
    out: list[tuple[int, int]] = []
    starts = [0, *breaks.tolist()]
    for first, end in zip(starts, [*starts[1:], n], strict=True):
        if end - first == 1:  # a read alone (storage holes between reads): no search
            out.append((first, end))
            continue
        run_ends = ends[first:end]  # within a run ends only grow: a batch takes every read ending within limit
        at = first
        while at < end:
            k = max(at + 1, first + int(np.searchsorted(run_ends, offsets[at] + limit, side="right")))
            out.append((at, k))
            at = k
    return out


def greedy_cuts(cum: np.ndarray, first: int, end: int, piece: int) -> list[tuple[int, int]]:
    """Positions ``first``..``end`` cut into pieces of at least ``piece`` bytes (the last
    may be less), ``cum[k]``: the bytes before position ``k``; one search a piece."""
    out: list[tuple[int, int]] = []
    at = first
    while at < end:
        k = min(end, max(at + 1, int(np.searchsorted(cum, cum[at] + piece, side="left"))))
        out.append((at, k))
        at = k
    return out


_NBYTES, _OFFSET, _SUM_START, _FILE, _TARGET = (
    operator.itemgetter(WholeRead._fields.index(f)) for f in ("nbytes", "offset", "sum_start", "file", "target")
)


class ThreadScratch:
    """Scratch memory for coalesced storage reads, one buffer per reader thread, reused
    from batch to batch of one load: a fresh buffer a batch page-faulted in every byte of
    a cold load once more (about 15% of its CPU here). Each thread reads into its buffer,
    copies out and checks before its next batch, so no two reads share one."""

    def __init__(self, nbytes: int) -> None:
        self._local = threading.local()
        self._nbytes = nbytes  # a batch's most (untouched until used: np.empty)

    def get(self, nbytes: int, offset: int) -> memoryview:
        """``nbytes`` of this thread's scratch whose address agrees with file ``offset``
        modulo the page size (:func:`~.read_exec.scratch_memory`), grown when too small."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes + read_exec.PAGE:
            buf = self._local.buf = np.empty(max(nbytes, self._nbytes) + read_exec.PAGE, np.uint8)
        return read_exec.page_aligned(buf, nbytes, offset)
