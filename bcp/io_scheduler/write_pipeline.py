"""One rank's data file, written as a pipeline: stage -> checksum -> write -> durable.

The layout (boxes back to back, aligned) is cut into chunks of the slab size (a large
fragment at multiples of it, so each chunk's block checksums are the fragment's; small
ones packed). The producer (calling thread) stages chunks into pool slabs, or in a sync
save of contiguous CPU tensors hands their memory itself to ``streams`` writer threads
that checksum and write at file offsets; the pool bounds the bytes in flight. A sync save
to a ``write_parts`` writer (the file backend) goes out in :data:`BATCH_BYTES` batches,
checksummed ahead by the producer and written by one writer (docs/decisions.md).

Device tensors are copied into pinned slabs on a side stream ordered after the caller's
work at construction (``bcp.io_scheduler.device_copy``); a writer waits for a chunk's copy
events, and a slab returns to the pool only once its copies completed, also on failure.

Call order: the constructor (calling thread: "the call" for device copies), ``stage()``
(returns when every chunk is handed over: host sources may then change if ``stage_all``,
device sources once ``copies.wait()`` returns), then ``finish()`` (any thread), which
waits for the writers and commits the file.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from bcp import trace
from bcp.backends import Backend, ObjectWriter
from bcp.coordination.priority import lower_this_thread
from bcp.io_scheduler.chunk_bytes import DigestSink, RunCopies, StagedChunk, copy_bytes
from bcp.io_scheduler.chunk_plan import Chunk, ChunkCopies, PipelinePlan, plan_pipeline
from bcp.io_scheduler.device_copy import DeviceCopies, is_device_tensor, settle
from bcp.io_scheduler.staging import Slab, StagingPool
from bcp.metadata import FileEntry, block_checksums, digest_of_checksums
from bcp.metadata.checksum import crc32c_raw
from bcp.planning import TensorPlan
from bcp.planning.writer_rows import REPORT_SCHEMA, WriterReport, report_rows
from bcp.shards import Piece
from bcp.tensor_io import address_view, flat_bytes, host_contiguous

#: A sync save of host tensors to a ``write_parts`` writer (the file backend) writes
#: batches of this many bytes, one request each from the tensors' memory (decisions.md).
BATCH_BYTES = 64 << 20
#: Writer threads for batches: one sequential stream, as the raw O_DIRECT limit writes.
BATCH_STREAMS = 1
#: Batches the producer checksums and queues ahead of the writer (tensors' own memory).
BATCH_AHEAD = 2

_ZEROS = memoryview(bytes(2 * 4096))  # padding between a batch's segments (gaps are under a page)


class WriteItem(NamedTuple):
    """One box this rank writes: the tensor's plan and the local piece holding it."""

    plan: TensorPlan
    piece: Piece
    #: the tensor's index among this rank's tensors (its LocalLayout's metadata order)
    tensor: int = 0


#: What a released item's piece holds instead of the caller's tensor.
_RELEASED = torch.empty(0, dtype=torch.uint8)


class WritePipeline:
    """Writes the given items (a tensor plan and the local piece) of one rank into ``data_key``."""

    def __init__(
        self,
        backend: Backend,
        data_key: str,
        rank: int,
        items: Sequence[WriteItem],
        *,
        block: int,
        pool: StagingPool,
        streams: int,
        stage_all: bool,
        deferred: bool = False,
        plan: PipelinePlan | None = None,
    ) -> None:
        self.backend, self.data_key, self.rank, self.items = backend, data_key, rank, items
        #: per item, its piece's tensor (read when first needed: :meth:`source`)
        self._tensors: Sequence[torch.Tensor] | None = None
        #: stage now, write later (:meth:`start_writing`, with the data file's key): nothing
        #: reaches the backend before; a pool too small for every chunk raises StagingFull
        self.deferred, self._begun, self._close_requested, self._writing = deferred, False, False, not deferred
        self.block, self.pool, self.streams, self.stage_all = block, pool, max(1, streams), stage_all
        self.aligned_writes = backend.hints.aligned_writes
        self.part_size = backend.hints.part_size
        if self.part_size is not None and (self.part_size > pool.slab_bytes or self.part_size % block):
            raise ValueError(
                f"{backend.uri}: part_size {self.part_size} must be at most the staging slab size "
                f"{pool.slab_bytes} and a multiple of the checksum block {block}"
            )
        #: the file layout, chunks and the like (given: kept from an earlier save of the same structure)
        self.plan = plan if plan is not None else self._make_plan(items)
        self.item_nbytes = self.plan.item_nbytes
        self.file_layout = self.plan.file_layout
        self.offsets, self.unique, self.size = self.file_layout.offsets, self.file_layout.unique, self.file_layout.size
        self.sources: dict[int, torch.Tensor] = {}
        #: host sources' bytes as numpy arrays (staged with numpy: see copy_bytes)
        self._arrays: dict[int, np.ndarray] = {}
        #: a sync save's view over its dense host items' memory (:meth:`_host_memory`)
        self._memory: tuple[memoryview, int] | None = None
        self.checksums: dict[tuple[int, int], list[int]] = {}
        self.error: BaseException | None = None
        self.bytes_staged = 0
        # Staged chunks are bounded by the pool; only zero-copy chunks need a bounded queue.
        self._queue: queue.Queue = queue.Queue(maxsize=0 if stage_all else 2 * self.streams)
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        #: writers in their loop, counted by themselves: finish() waits for none left, also one
        #: whose start() a KeyboardInterrupt cut short (running, not in _threads)
        self._live, self._ended, self._closed = 0, threading.Condition(), False
        self._writer: ObjectWriter | None = None
        self._pending: list[Chunk] = []
        #: write in batches from the tensors' memory (decided when the writer opens)
        self.batched = False
        #: per item, the segments still to stage (None: not read yet, :meth:`_uses`)
        self._uses_left: dict[int, int] | None = None
        #: device-to-host copies; "the call" is now (this runs in the caller's thread)
        self.copies = DeviceCopies()
        self.copies.start(self.plan.devices)
        #: the calling thread: only it stages chunks by their runs (:meth:`_stage_runs`)
        self._caller = threading.get_ident()
        self._runs = RunCopies()  # their copies in flight (the chunks handed over once copied)
        #: an incremental save's: fed each segment after its checksums; set before staging
        self.digests: DigestSink | None = None

    def _make_plan(self, items: Sequence[WriteItem]) -> PipelinePlan:
        return plan_pipeline(
            [item.piece for item in items],
            match_memory=self.aligned_writes and not self.stage_all,
            part_size=self.part_size,
            block=self.block,
            slab_bytes=self.pool.slab_bytes,
            packed=self.stage_all,
            is_device=is_device_tensor,
            released=[WriteItem(item.plan, Piece(item.piece.box, _RELEASED), item.tensor) for item in items],
        )

    # -- calling thread ---------------------------------------------------------------------

    def source(self, index: int) -> torch.Tensor:
        """Item ``index``'s tensor (``items[index].piece.tensor``): the items' tensors taken
        as a column when first needed (a kept plan's items are not made one by one)."""
        tensors = self._tensors
        if tensors is None:
            column = getattr(self.items, "tensors", None)  # bcp.kept_plans.KeptItems
            tensors = self._tensors = column() if column is not None else [i.piece.tensor for i in self.items]
        return tensors[index]

    def _flat_source(self, index: int) -> torch.Tensor:
        """The item's bytes as a flat uint8 tensor (on its device). A device tensor
        that is not dense row-major is made so on the side stream (after the caller's
        work, before the copies that read it)."""
        t = self.source(index)
        if self.plan.host_dense[index]:  # its own memory, as it is
            return flat_bytes(t) if self.item_nbytes[index] else torch.empty(0, dtype=torch.uint8)
        t = t.detach()
        if not is_device_tensor(t):
            t = host_contiguous(t)
        elif not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = self.copies.contiguous(t)
        return flat_bytes(t) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)

    def _can_batch(self) -> bool:
        """Whether the save can write batches (:data:`BATCH_BYTES`) straight from the
        tensors' memory: synchronous, host tensors only, and a writer that takes many
        buffers in one request."""
        return (
            not self.stage_all
            and not self.deferred
            and self.part_size is None
            and callable(getattr(self._writer, "write_parts", None))
            and not self.plan.devices  # no device tensor (the plan found them, one check each)
        )

    def chunks(self) -> list[Chunk]:
        if self.batched:  # the batches are cut when the writer opens (they depend on it), kept in the plan
            return list(self.plan.batches(BATCH_BYTES, self.block)[0])
        return list(self.plan.chunks)

    def stage(self, select: Callable[[Chunk], bool] | None = None, last: bool = True) -> None:
        """Produce the chunks ``select(chunk)`` accepts (every chunk when None) that
        were not produced yet; ``last`` closes the queue afterwards."""
        if not self.items:
            return
        if not self._begun:
            self._begun = True
            if not self.deferred and not self.stage_all:
                self._writer = self.backend.open_writer(self.data_key, size=self.size)
            self.batched = self._can_batch()
            if self.batched:
                self.streams = min(self.streams, BATCH_STREAMS)
                self._queue = queue.Queue(maxsize=BATCH_AHEAD)  # no writer has started yet
            self._pending = self.chunks()
            # a batched save's uses, copied (else copied when first read)
            self._uses_left = dict(self.plan.batches(BATCH_BYTES, self.block)[1]) if self.batched else None
            if not self.stage_all:
                self._start_writers()
        staged = trace.span("stage")
        try:
            staged.__enter__()
            before = self.bytes_staged
            keep = []
            for chunk in self._pending:
                if self.error is not None:
                    break
                if select is None or select(chunk):
                    self._produce(chunk)
                else:
                    keep.append(chunk)
            self._pending = keep
            self._hand_over(self._runs.finish())
            if isinstance(staged, trace.Span):
                staged.nbytes = self.bytes_staged - before
        finally:
            for lost in self._runs.drop():  # after an error: the copies in flight stopped
                self.pool.release(lost.slab)
            staged.__exit__()
            if last:
                self.close_queue()
                if self.stage_all:
                    self._release_sources()

    def _release_sources(self) -> None:
        """Every chunk is in a slab: let go of the caller's tensors, so memory the
        caller frees returns at once rather than when the save has written it. Device
        copies still in flight keep their sources' memory reserved (record_stream)."""
        self.sources.clear()
        self._arrays.clear()
        self.items, self._tensors = self.plan.released, None

    def _start_writers(self) -> None:
        """At once for a sync save; an async one's own thread opens the file and starts
        them after staging (:meth:`start_writers`), unless the pool runs out of slabs."""
        with self._start_lock:
            if self._threads:
                return
            if self._writer is None and self._writing and self.error is None:
                try:
                    self._writer = self.backend.open_writer(self.data_key, size=self.size)
                except BaseException as e:  # noqa: BLE001 - reported by finish()
                    self.error = e
            for _ in range(self.streams):
                thread = threading.Thread(target=self._write_loop, name="bcp-writer", daemon=True)
                thread.start()
                self._threads.append(thread)

    def start_writers(self) -> None:
        """(the save's thread) Open the file and start the writers, once staging has begun."""
        if self._begun and self._writing and self.items:
            self._start_writers()

    def close_queue(self) -> None:
        if not self._writing:  # deferred: closed once writing starts
            self._close_requested = True
            return
        if not self.stage_all:  # else started later (the queue is unbounded)
            self._start_writers()
        if not self._closed:  # one end mark: each writer puts it back for the next (_write_loop)
            self._queue.put(None)
            self._closed = True

    def start_writing(self, data_key: str) -> None:
        """(a deferred pipeline) Open ``data_key`` and write what was staged."""
        self.data_key = data_key
        self._writing = True
        if self.items:
            self._writer = self.backend.open_writer(data_key, size=self.size)
        if self._close_requested:
            self.close_queue()
        self._start_writers()

    def discard(self) -> None:
        """(a deferred pipeline that will not write) Return every staged slab."""
        while not self._queue.empty():
            staged = self._queue.get_nowait()
            if staged is not None and staged.slab is not None:
                settle(staged.events)
                self.pool.release(staged.slab)
        self._release_sources()

    def _produce(self, chunk: Chunk) -> None:
        if chunk.copies is not None and self.stage_all and threading.get_ident() == self._caller:
            self._stage_runs(chunk, chunk.copies)
            return
        # those are read in _stage_chunk, or as arrays by _batch (no flat uint8 tensor)
        dense = self.plan.host_dense if self.stage_all or self.batched else None
        for seg in chunk.segments:
            item = seg.item
            if (dense is None or not dense[item]) and item not in self.sources:
                self.sources[item] = self._flat_source(item)
        try:
            staged = self._stage_chunk(chunk)
            if staged.views is not None:  # a batch: its checksums are taken here, ahead of the writer
                self._sum_batch(staged)
            self._queue.put(staged)
        finally:
            self._forget_sources(chunk)

    def _host_array(self, item: int) -> np.ndarray:
        """A dense host item's bytes as a numpy array (no copy)."""
        if not self.item_nbytes[item]:
            return np.empty(0, np.uint8)
        t = self.source(item)
        if self.plan.host_dense[item] == 2:  # two torch calls instead of four: this runs for every tensor
            return (t.detach() if t.requires_grad else t).numpy().reshape(-1).view(np.uint8)
        return flat_bytes(t).numpy()

    def _stage_chunk(self, chunk: Chunk) -> StagedChunk:
        if self.batched:
            return self._batch(chunk)
        first = self.sources.get(chunk.segments[0].item) if chunk.segments else None
        whole = len(chunk.segments) == 1 and chunk.segments[0].at == 0 and chunk.segments[0].nbytes == chunk.nbytes
        if first is not None and not self.stage_all and whole and not is_device_tensor(first):
            seg = chunk.segments[0]
            data = first[seg.start : seg.start + seg.nbytes]
            if not self.aligned_writes or (data.data_ptr() - chunk.offset) % 4096 == 0:
                return StagedChunk(chunk, None, data, [])  # zero-copy: the tensor's own memory
        slab = self._slab()
        out = slab.view(chunk.nbytes, shift=chunk.offset % 4096)  # same phase as the file: O_DIRECT-able
        out_bytes = out.numpy()  # host copies and padding go through numpy: few Python operations a segment
        cursor, events = 0, []
        dense = self.plan.host_dense if self.stage_all else None
        copying = trace.span("copy", chunk.nbytes)  # issuing the copies only, for device sources
        try:
            copying.__enter__()
            for seg in chunk.segments:
                if seg.at > cursor:
                    out_bytes[cursor : seg.at] = 0  # padding: never leak an earlier save's bytes
                array = self._arrays.get(seg.item)
                if array is None and dense is not None and dense[seg.item]:
                    array = self._host_array(seg.item)
                    if self._uses()[seg.item] > 1:  # read by a later chunk too
                        self._arrays[seg.item] = array
                elif array is None:
                    source = self.sources[seg.item]
                    if is_device_tensor(source):
                        src = source[seg.start : seg.start + seg.nbytes]
                        events.append(self.copies.to_host(out[seg.at : seg.at + seg.nbytes], src))
                        cursor = seg.at + seg.nbytes
                        continue
                    array = self._arrays[seg.item] = source.numpy()
                copy_bytes(out_bytes[seg.at : seg.at + seg.nbytes], array[seg.start : seg.start + seg.nbytes])
                cursor = seg.at + seg.nbytes
            if cursor < chunk.nbytes:
                out_bytes[cursor : chunk.nbytes] = 0
            copying.__exit__()
        except BaseException:
            settle(events)
            self.pool.release(slab)
            raise
        self.bytes_staged += chunk.nbytes
        return StagedChunk(chunk, slab, out, events)

    def _slab(self) -> Slab:
        """A pool slab. None free: the chunks copied so far go to the writers, started if
        they were not (only writing frees slabs; a deferred pipeline raises instead)."""
        if self.pool.would_block():
            self._hand_over(self._runs.finish())
            if not self._threads:
                if self.deferred:
                    raise StagingFull(f"rank {self.rank}: the staging pool cannot hold the whole save before writing")
                self._start_writers()
        return self.pool.acquire()

    def _hand_over(self, staged: list[StagedChunk]) -> None:
        for s in staged:
            self._queue.put(s)

    def _stage_runs(self, chunk: Chunk, copies: ChunkCopies) -> None:
        """Stage a chunk of dense host tensors by its runs (``Chunk.copies``): one ``memmove``
        a segment (each releases the GIL), the padding zeroed by ``memset`` or one numpy
        assignment, no Python object per tensor; the caller and the helper threads copy, and
        the chunk goes to the writers once copied, while the next is set up (``RunCopies``).
        The addresses are the plan's, reused only while every tensor keeps its address,
        shape, strides and dtype (``bcp.kept_plans``); only the calling thread takes this
        path, during the call, while the caller holds the state (an overlapped save's
        background staging reads the tensors through numpy, bounds-checked, as they are then)."""
        slab = self._slab()
        try:
            out = slab.view(chunk.nbytes, shift=chunk.offset % 4096)  # same phase as the file: O_DIRECT-able
            if copies.zeros is not None:
                out.numpy()[copies.zeros] = 0
        except BaseException:
            self.pool.release(slab)
            raise
        self.bytes_staged += chunk.nbytes
        with trace.span("copy", chunk.nbytes):  # on the caller's cores, as a large Tensor.copy_
            self._hand_over(self._runs.copy(out.data_ptr(), copies.parts, StagedChunk(chunk, slab, out, [])))

    def _batch(self, chunk: Chunk) -> StagedChunk:
        """A batch: its segments' bytes as views of the sources' memory (no copy), with
        the zeros of the padding between them. A dense host item's view is a slice of
        :meth:`_host_memory` at its planned address: the items (``self.items``, never
        released in a sync save) hold every tensor until the writer has written it."""
        views, parts, cursor = [], [], 0
        dense, addresses = self.plan.host_dense, self.plan.addresses
        memory, low = self._host_memory()
        for seg in chunk.segments:
            item = seg.item
            if seg.at > cursor:
                parts.append(_ZEROS[: seg.at - cursor])
            if dense[item]:
                at = addresses[item] - low + seg.start
                view = memory[at : at + seg.nbytes] if seg.nbytes else _ZEROS[:0]
            else:  # a flat uint8 copy (_produce): its bytes as they are
                source = self.sources[item][seg.start : seg.start + seg.nbytes]
                view = memoryview(source.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ only for Python >= 3.12
            views.append(view)
            parts.append(view)
            cursor = seg.at + seg.nbytes
        return StagedChunk(chunk, None, _RELEASED, [], views, parts)

    def _host_memory(self) -> tuple[memoryview, int]:
        """One view over the plan's :meth:`~.PipelinePlan.host_range`, and its
        start: a batch slices it per segment (a view each through ``Tensor.numpy`` was
        most of a 10,000-tensor save's producer time)."""
        if self._memory is None:
            low, high = self.plan.host_range()
            self._memory = (address_view(low, high - low) if high > low else _ZEROS[:0], low)  # never a NULL view
        return self._memory

    def _uses(self) -> dict[int, int]:
        """:attr:`_uses_left`, copied from the plan's counts when first read (a save whose
        chunks are all staged by their runs never reads it: no dict of every item a call)."""
        if self._uses_left is None:
            self._uses_left = dict(self.plan.uses)
        return self._uses_left

    def _forget_sources(self, chunk: Chunk) -> None:
        """Drop a source once its last chunk is staged (a device temporary's memory
        returns to the allocator, reusable only behind the side stream's copies)."""
        uses = self._uses()
        for seg in chunk.segments:
            left = uses[seg.item] = uses[seg.item] - 1
            if not left:
                self.sources.pop(seg.item, None)
                self._arrays.pop(seg.item, None)

    # -- writer threads ---------------------------------------------------------------------

    def _write_loop(self) -> None:
        with self._ended:
            self._live += 1
        try:
            self._write_chunks()
        finally:
            with self._ended:
                self._live -= 1
                self._ended.notify_all()

    def _write_chunks(self) -> None:
        if self.stage_all:  # an async save's writers: behind training for the CPU
            lower_this_thread()
        while True:
            task = self._queue.get()
            if task is None:  # left for the others: full, it holds end marks only (none queued after)
                with contextlib.suppress(queue.Full):
                    self._queue.put_nowait(None)
                return
            staged: StagedChunk = task
            chunk, slab, data = staged.chunk, staged.slab, staged.data
            try:
                if self.error is None:
                    assert self._writer is not None, "stage() opens the writer before queueing chunks"
                    if staged.parts is not None:
                        self._write_batch(staged)
                        continue
                    for event in staged.events:
                        event.synchronize()
                    view = memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ only for Python >= 3.12
                    with trace.span("checksum", sum(s.nbytes for s in chunk.segments) if trace.enabled() else 0):
                        for seg in chunk.segments:
                            sums = block_checksums(view[seg.at : seg.at + seg.nbytes], self.block)
                            self.checksums[(seg.item, seg.start)] = sums
                            if self.digests is not None:
                                self.digests.feed(seg.item, seg.start, view[seg.at : seg.at + seg.nbytes])
                    with trace.span("write", chunk.nbytes):
                        self._writer.write_at(chunk.offset, view[: chunk.nbytes])
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.error = self.error or e
            finally:
                if slab is not None:
                    settle(staged.events)  # a copy still landing in the slab must not meet its next use
                    self.pool.release(slab)

    def _sum_batch(self, staged: StagedChunk) -> None:
        """(the producer) Checksum a batch's segments, the very memory its request
        writes, before it is queued; an error fails the save naming the data file."""
        chunk, views = staged.chunk, staged.views or []
        try:
            with trace.span("checksum", sum(s.nbytes for s in chunk.segments) if trace.enabled() else 0):
                block, sums = self.block, self.checksums
                for seg, view in zip(chunk.segments, views, strict=True):
                    # one block or less (most of a model's small tensors): one call, no slicing
                    n = len(view)
                    sums[(seg.item, seg.start)] = (
                        block_checksums(view, block) if n > block else [crc32c_raw(view)] if n else []
                    )
                    if self.digests is not None:
                        self.digests.feed(seg.item, seg.start, view)
        except Exception as e:
            e.add_note(f"checksumming {self.data_key} at {self.backend.uri}, bytes {chunk.offset}+{chunk.nbytes}")
            raise

    def _write_batch(self, staged: StagedChunk) -> None:
        """Write a batch in one request; its checksums were taken ahead (:meth:`_sum_batch`)."""
        assert staged.parts is not None
        with trace.span("write", staged.chunk.nbytes):
            self._writer.write_parts(staged.chunk.offset, staged.parts)  # type: ignore[union-attr]  # _can_batch checked it

    # -- any thread ---------------------------------------------------------------------------

    def finish(self) -> WriterReport:
        """Wait for the writers, make the file durable, return its fragment rows."""
        if not self.items:
            return WriterReport(REPORT_SCHEMA.empty_table(), None, self.rank)
        self.start_writers()  # an asynchronous save's, if its thread has not yet
        with trace.span("drain"):  # waiting for the writers
            for thread in self._threads:
                thread.join()
            with self._ended:
                self._ended.wait_for(lambda: not self._live)
        self.sources.clear()
        self._arrays.clear()
        writer = self._writer
        if self.error is not None:
            if writer is not None:  # None when opening it is what failed
                writer.abort_after_failure()
            raise self.error
        assert writer is not None, "finish() after stage()"
        try:
            if self.size == 0:
                writer.write_at(0, b"")
            layout, items = self.file_layout, self.plan.released  # the items' plans and boxes, made with the plan
            rows, file_sums = report_rows(
                self.checksums, layout.unique, layout.offsets, layout.source, items, self.item_nbytes
            )
            self.checksums = {}  # let go here, not in the caller of a later save that drops this one
            with trace.span("durable", self.size):
                writer.commit()
        except BaseException:
            writer.abort_after_failure()
            raise
        tensors = {item.tensor: item.plan for item in self.plan.released}  # the items' plans and boxes
        return WriterReport(
            rows, FileEntry(self.data_key, self.size, digest_of_checksums(file_sums)), self.rank, tensors
        )

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


class StagingFull(Exception):
    """A deferred pipeline's chunks do not all fit in the staging pool at once."""
