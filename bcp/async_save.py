"""Asynchronous save: training blocks only while the state is copied to host memory.

``async_save`` plans collectively, copies every box this rank writes into staging
slabs from the process-wide pool (reused across saves, so the copy runs at warm-memory
speed), and returns a handle; writing, checksums and the commit run in a background
thread. Two saves may be in flight at once (ping-pong): save k+1 stages while save k
writes when the pool has room for both, and otherwise waits for k's slabs to drain,
so it never corrupts k. A third waits for the first.

Collectives: planning runs on the caller's lane of bcp's gloo groups, the commit
on the background lane; the commits of one process group run one at a time, in
the order of their ``async_save`` calls (``bcp.coordination.lanes`` says why that keeps
every rank's collectives in one order). An async save still in flight at exit is
finished by bcp's exit handler before its groups are released.

``overlap=optimizer`` goes further: tensors the optimizer owns (parameters and its
state) do not change until ``optimizer.step()``, so they are staged in the
background during forward and backward, and a step pre-hook waits only for the
part not yet copied. Everything else (buffers, objects) is copied before returning.

Device (CUDA) tensors: copies run on a side stream ordered after the caller's work
at the call (``bcp.io_scheduler.device_copy``). ``async_save`` returns only once the copies it
made have completed (a host wait as long as the device-to-host copy itself), so
nothing the caller does next, on any stream, can reach the checkpoint. The overlap
pre-hook makes ``step()``'s stream wait for the background copies on the device,
without blocking the host. docs/io.md, "Device tensors", is the full contract.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import torch

from bcp.coordination.collectives import Coordinator
from bcp.coordination.lanes import at_exit, coordinator_for, group_destroyed, ready
from bcp.coordination.priority import lower_this_thread
from bcp.gc_pause import gc_paused
from bcp.io_scheduler.chunk_plan import Chunk, layout, plan_packed_chunks, plan_part_chunks
from bcp.io_scheduler.staging import StagingPool, StagingReservation, default_pool
from bcp.io_scheduler.write_pipeline import WriteItem, WritePipeline
from bcp.metadata import DEFAULT_BLOCK_BYTES
from bcp.options import SaveOptions, SaveOptionsKwargs
from bcp.save_phases import SaveInfo, SaveJob, park_staging_error
from bcp.saver import planned_writes, start_save
from bcp.shards import local_pieces
from bcp.state import flatten_state
from bcp.target import Target

log = logging.getLogger(__name__)

_slots_lock = threading.Lock()
_in_flight: dict[int, AsyncSaveHandle] = {}
_save_count = 0
#: per process group (its coordinator's cache key; one process: its own lane): the async save
#: whose commit ran or runs last on the background lane; the next one's commit waits for it
_lane_tail: dict[Any, AsyncSaveHandle] = {}
#: failed saves nobody had waited for when their slot was taken: the exit hook reports those still not waited for
_failed_unwaited: list[AsyncSaveHandle] = []


class AsyncSaveHandle:
    """A save in progress. ``wait()`` returns its SaveInfo or raises its error."""

    def __init__(
        self,
        job: SaveJob | None,
        blocking_seconds: float,
        after: AsyncSaveHandle | None = None,
        *,
        plan: Callable[[], SaveJob | None] | None = None,
        uri: str = "",
    ) -> None:
        self._job = job
        #: a save planned in the background (:func:`async_save_planned_later`): returns its
        #: job, or None when the save is skipped (nothing written)
        self._plan = plan
        self._uri = job.backend.uri if job is not None else uri
        self.skipped = False
        #: the save of the same process group whose commit must come first (collectives in call order)
        self._after = after
        self._done = threading.Event()
        self._result: SaveInfo | None = None
        self._error: BaseException | None = None
        #: seconds ``async_save`` kept the caller waiting
        self.blocking_seconds = blocking_seconds
        self.staged = threading.Event()
        #: whether ``wait`` handed the outcome to the caller (else the exit hook reports it)
        self._reported = False
        #: AfterCommit.run (the local tier's hook point), or None
        self._after_commit: Callable[[SaveJob, SaveInfo], None] | None = None
        #: the deferred pipeline of a save planned in the background (returned if its thread never starts)
        self._deferred: WritePipeline | None = None
        #: whether staging left a part to the save's thread (``overlap``): its queue is not closed yet
        self._rest_unstaged = False

    def _run(self, background_stage: Callable[[], None] | None = None) -> None:
        try:
            if background_stage is not None:
                background_stage()  # training's next step() waits for this: at full priority
            lower_this_thread()  # writing, the commit, a local tier's replication: after training
            if self._job is not None:  # the file opened and the writers started here, not in the caller
                self._job.pipeline.start_writers()
            if self._after is not None:
                self._after._done.wait()  # its commit's collectives come first, on every rank
                self._after = None
            if self._plan is not None:
                self._job = self._plan()
                if self._job is None:
                    self.skipped = True
                    return
            assert self._job is not None, "a job, or a plan that makes it"
            self._result = self._job.complete()
            if self._after_commit is not None:  # the local tier's hook point: see AfterCommit
                self._after_commit(self._job, self._result)
        except BaseException as e:  # noqa: BLE001 - re-raised from wait()
            self._error = e
            if self._job is not None and group_destroyed(self._job.coord):
                note = (
                    f"torch.distributed's process group was destroyed (dist.destroy_process_group()) while the "
                    f"async save to {self.uri} was in flight: {self._outcome()}. Call wait() on the handle (or "
                    f"CheckpointManager.wait() / close()) before destroy_process_group()"
                )
                e.add_note(note)
                log.error("%s (%s: %s)", note, type(e).__name__, e)
        finally:
            self.staged.set()
            self._done.set()

    def _not_started(self, error: BaseException) -> None:
        """Its thread could not be started: the save fails with ``error``, its slabs returned."""
        self._error = error
        if self._job is not None:
            # the rest of an overlapped save is never staged: end marks now, or the writers wait forever
            park_staging_error(self._job.pipeline, error, last=self._rest_unstaged)
            try:
                self._job.pipeline.start_writers()  # writers that only return the staged slabs
            except BaseException as e:  # noqa: BLE001 - no thread can start: the slabs stay taken
                log.error("the async save to %s could not return its staging slabs: %s", self.uri, e)
        elif self._deferred is not None:
            self._deferred.discard()  # nothing planned, nothing written: the staged slabs back
        self.staged.set()
        self._done.set()

    def _outcome(self) -> str:
        """What a failed commit left, as far as this rank knows."""
        job = self._job
        if job is None:
            return "nothing was written (the save was still planning)"
        if job.committed:
            return "the checkpoint IS committed (this rank wrote its manifest), the other ranks could not be told"
        if job.coord.is_coordinator or not job.reported:
            return "the checkpoint was NOT committed"
        return "the coordinator may have committed the checkpoint after this rank lost contact: load it to find out"

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.uri} still running after {timeout} s")
        self._reported = True
        if self._error is not None:
            raise self._error
        assert self._result is not None, "done without an error: complete() returned"
        return self._result

    def wait_or_skipped(self) -> SaveInfo | None:
        """``wait()``; None for a save planned in the background that was skipped."""
        if self._done.wait() and self.skipped and self._error is None:
            self._reported = True
            return None
        return self.wait()

    @property
    def uri(self) -> str:
        return self._uri


def optimizer_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """data_ptr of every storage the optimizer changes in step(): parameters and state."""
    ptrs: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            ptrs.add(local.untyped_storage().data_ptr())

    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return ptrs


# -- overlap: step() waits for every overlapped save of its optimizer --------------------------
#
# One global optimizer step pre-hook, registered once and never removed: torch runs the
# global pre-hooks before each optimizer's own, so user pre-hooks (registered before or
# after any save) see the wait done, and nothing is removed while torch iterates the
# hooks. For an optimizer without pending saves the hook is a dictionary lookup.

_overlap_lock = threading.Lock()
_overlap_pending: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[AsyncSaveHandle, Any]]] = (
    weakref.WeakKeyDictionary()
)
_overlap_hook: Any = None


def _overlapped_before_step(optimizer: torch.optim.Optimizer, handle: AsyncSaveHandle, copies: Any) -> None:
    """Make ``optimizer``'s next ``step()`` wait for ``handle``'s background staging."""
    global _overlap_hook
    with _overlap_lock:
        _overlap_pending.setdefault(optimizer, []).append((handle, copies))
        if _overlap_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _overlap_hook = register_optimizer_step_pre_hook(_wait_for_overlapped)


def _wait_for_overlapped(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """(step pre-hook) Every overlapped save of ``optimizer`` made before this step:
    wait until its copies are queued (host copies done), then order the step's
    kernels after its device copies."""
    with _overlap_lock:
        pending = _overlap_pending.pop(optimizer, [])
    for handle, copies in pending:
        handle.staged.wait()
        copies.order_after()


@gc_paused
def async_save(
    state: Mapping[str, Any],
    uri: Target,
    options: SaveOptions | None = None,
    *,
    overlap: torch.optim.Optimizer | None = None,
    after_commit: AfterCommit | None = None,
    **overrides: Unpack[SaveOptionsKwargs],
) -> AsyncSaveHandle:
    """Start saving ``state``; return once it is safe to change the state.

    Same options as ``bcp.save`` (:class:`SaveOptions`; collective in the same way). When it returns, the
    checkpoint holds exactly the values at the call: every copy of a CPU or CUDA
    tensor has completed, so in-place kernels on any stream, ``optimizer.step()``,
    freeing tensors and reusing their memory cannot change what is written. The
    copies are ordered after the work queued on the calling thread's current stream
    before the call; work on other streams must be ordered before it by the caller
    (``torch.cuda.current_stream().wait_stream(side)``), as for any use of a tensor.

    With ``overlap`` set to the optimizer, returns before its parameters and state
    are copied; its next ``step()`` waits for that copy (on the host for the copy
    to be queued, on the device for it to run), so ``step()`` cannot change a
    tensor before it is copied. Changing optimizer-owned tensors other than through
    ``step()`` before that is the caller's responsibility. docs/io.md has details.

    ``after_commit`` is the local tier's hook point (:class:`AfterCommit`).
    """
    started = time.perf_counter()
    opts = SaveOptions.of(options, overrides)
    slot = claim_slot()
    lanes = ready(opts.process_group, "bcp.async_save")  # every group exists before the first phase
    coord = lanes.caller
    job = start_save(state, uri, coord, opts, stage_all=True)
    job.coord = lanes.background  # the commit runs on the background lane
    if after_commit is not None:  # the local tier's hook point: see AfterCommit
        job.visible_ranks = after_commit.visible_ranks
    handle = AsyncSaveHandle(job, 0.0, lane_tail(coord))
    handle._after_commit = after_commit.run if after_commit is not None else None
    background = _stage_for_caller(handle, job.pipeline, job.stage, overlap)
    handle.blocking_seconds = time.perf_counter() - started
    if job.trace is not None:  # what the caller waited for, on the timeline
        job.trace.add("blocking", int(started * 1e9), time.perf_counter_ns(), 0, threading.current_thread())
    launch(handle, slot, coord, background)
    _raise_interrupt(handle, job.pipeline)
    return handle


def _raise_interrupt(handle: AsyncSaveHandle, pipeline: WritePipeline) -> None:
    """A Ctrl-C (or SystemExit) during the caller's staging fails the save in its thread, as any staging error, and
    reaches the caller now too (so reported): parked only, it surfaced at ``wait()``, and training went on."""
    if pipeline.error is not None and not isinstance(pipeline.error, Exception):
        handle._reported = True
        raise pipeline.error


def _stage_for_caller(
    handle: AsyncSaveHandle, pipeline: WritePipeline, stage: Callable[..., None], overlap: torch.optim.Optimizer | None
) -> Callable[[], None] | None:
    """Stage what the caller must wait for (everything, or with ``overlap`` what
    forward/backward may change); return the background stager of the rest, if any."""
    if overlap is None:
        stage()
        pipeline.copies.wait()  # device copies done: the caller may change or free anything
        handle.staged.set()
        return None
    owned = optimizer_storages(overlap)

    def later(chunk: Chunk) -> bool:
        return all(pipeline.source(s.item).untyped_storage().data_ptr() in owned for s in chunk.segments)

    stage(select=lambda c: not later(c), last=False)  # what forward/backward may change: now
    pipeline.copies.wait()
    _overlapped_before_step(overlap, handle, pipeline.copies)

    def stage_rest() -> None:
        try:
            stage()  # the optimizer-owned rest, while training runs forward/backward
        finally:
            handle.staged.set()

    return stage_rest


def async_save_planned_later(
    pipeline: WritePipeline,
    stage: Callable[..., None],
    plan: Callable[[], SaveJob | None],
    coord: Coordinator,
    uri: str,
    *,
    overlap: torch.optim.Optimizer | None = None,
    after_commit: AfterCommit | None = None,
) -> AsyncSaveHandle:
    """(caller, no collective) The local tier's fast path: stage ``pipeline`` (a
    deferred one: nothing is written) as ``async_save`` would, and return; in the
    save's thread, once the background lane is free (``coord``, the background lane's
    coordinator), ``plan()`` runs the save's collectives and returns its job (writing
    starts then), or None: the save is skipped and its slabs are returned."""
    started = time.perf_counter()
    slot = claim_slot()
    handle = AsyncSaveHandle(None, 0.0, lane_tail(coord), plan=plan, uri=uri)
    handle._deferred = pipeline
    handle._after_commit = after_commit.run if after_commit is not None else None
    background = _stage_for_caller(handle, pipeline, stage, overlap)
    handle.blocking_seconds = time.perf_counter() - started
    launch(handle, slot, coord, background)
    _raise_interrupt(handle, pipeline)
    return handle


def claim_slot() -> int:
    """(caller) One of the two in-flight slots: the save two back finishes first."""
    global _save_count
    with _slots_lock:
        slot = _save_count % 2
        _save_count += 1
        previous = _in_flight.get(slot)
    if previous is not None:
        previous._done.wait()
        if previous._error is not None and not previous._reported:
            _failed_unwaited.append(previous)
    return slot


def lane_tail(coord: Coordinator) -> AsyncSaveHandle | None:
    """The async save of ``coord``'s group (or process) whose commit comes last so far: commits in call order."""
    return _lane_tail.get(coord.cache_key)


def launch(
    handle: AsyncSaveHandle, slot: int, coord: Coordinator, background: Callable[[], None] | None = None
) -> None:
    """Start ``handle``'s thread in ``slot`` (``claim_slot``); its background collectives
    come after those of every save of ``coord``'s group launched before."""
    thread = threading.Thread(target=handle._run, args=(background,), name="bcp-async-save", daemon=True)
    handle._rest_unstaged = background is not None
    with _slots_lock:
        _in_flight[slot] = handle
    _lane_tail[coord.cache_key] = handle
    start_soon(thread, handle._not_started)


# -- starting the save's thread without waiting for it --------------------------------------
#
# ``Thread.start()`` returns only once the new thread runs: on a busy machine the caller
# waits for the scheduler (measured here under load: 5-30 ms a start, once per save).
# The caller instead hands the thread to one long-lived starter thread per process.

_starter_lock = threading.Lock()


def _new_starter_lock_in_child() -> None:
    """A fork while another thread held the lock would leave it held forever in the child
    (whose first async save then hangs); the child starts its own starter anyway. The parent's
    saves in flight are the parent's: their threads are not in the child, which would wait for
    them forever (its third save, its exit)."""
    global _starter_lock, _slots_lock
    _starter_lock, _slots_lock = threading.Lock(), threading.Lock()
    _in_flight.clear()
    _lane_tail.clear()
    _failed_unwaited.clear()


os.register_at_fork(after_in_child=_new_starter_lock_in_child)
#: (the process that started it, its queue of (thread, on_error))
_starter: tuple[int, queue.SimpleQueue] | None = None


def start_soon(thread: threading.Thread, on_error: Callable[[BaseException], None]) -> None:
    """Start ``thread`` from the starter thread, without waiting; ``on_error(e)`` if
    it cannot be started. Nothing may ``join()`` such a thread (it may not have started)."""
    global _starter
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():  # a forked child has no starter thread
            q: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_start_loop, args=(q,), name="bcp-thread-starter", daemon=True).start()
            _starter = (os.getpid(), q)
        q = _starter[1]
    q.put((thread, on_error))


def _start_loop(q: queue.SimpleQueue) -> None:
    while True:
        thread, on_error = q.get()
        try:
            thread.start()
        except BaseException as e:  # noqa: BLE001 - handed to the owner (e.g. no thread at interpreter shutdown)
            on_error(e)


# -- the local tier's hook point (bcp.tiers) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class AfterCommit:
    """What the local tier (``bcp.tiers``, docs/tiers.md) adds to an async save whose
    ranks write to different hosts' local roots.

    ``run(job, info)`` runs in the save's background thread once the save is
    committed, before ``wait()`` returns (spreading the metadata to every host,
    replicating, starting a drain); an error it raises is the save's error. Before the
    commit, the coordinator checks only the data files of ``visible_ranks`` (the ranks
    of its own host): the other hosts' files are not in its backend."""

    run: Callable[[SaveJob, SaveInfo], None]
    visible_ranks: frozenset[int] | None = None


def staging_bytes(
    state: Mapping[str, Any],
    slab_bytes: int,
    *,
    part_size: int | None = None,
    block: int = DEFAULT_BLOCK_BYTES,
    items: Sequence[WriteItem] | None = None,
) -> int:
    """Staging memory an async save of ``state`` takes on this rank: one slab per
    chunk, the chunks laid out as the write pipeline lays them out (fragments
    packed back to back, each slab filled before the next is taken; with an object
    store's ``part_size``, one chunk per part). ``items``: the boxes this rank
    writes (``bcp.saver.planned_writes``); default: every local piece of ``state``."""
    if items is not None:
        pieces = [item.piece for item in items]
    else:
        pieces = [
            piece
            for leaf in flatten_state(state).values()
            if leaf.is_tensor
            for piece in local_pieces(leaf.value, leaf.fqn).pieces
        ]
    placed = layout(pieces, part_size=part_size, block=block)
    spans = [(i, placed.offsets[i], pieces[i].tensor.numel() * pieces[i].tensor.element_size()) for i in placed.unique]
    if part_size:
        chunks = plan_part_chunks(spans, part_size, placed.size)
    else:
        chunks = plan_packed_chunks(spans, slab_bytes, block)
    return len(chunks) * slab_bytes


def reserve_staging(
    state: Mapping[str, Any],
    *,
    pool: StagingPool | None = None,
    background: bool = True,
    part_size: int | None = None,
    collective: bool = False,
    process_group: Any = None,
) -> StagingReservation:
    """Allocate the staging memory an async save of ``state`` needs, now, in a
    background thread.

    Pinned host memory allocates at about 1 GB/s. Without a reservation the first
    ``async_save`` of a run stages through pageable memory while the pool pins in
    the background (slower copies, no wait for pinning); with one, it finds its
    slabs pinned. Call it once the state exists and nothing else is loading
    (``CheckpointManager.load_latest`` does, after the resume load); training may go
    on meanwhile. ``part_size``: the target store's part size (object stores stage
    one slab per part). ``collective=True`` (every rank of ``process_group`` calls
    it; it first waits for this process's async saves in flight): sized from the
    boxes this rank will write after deduplication, not its whole local state (a
    DDP rank writes about 1/N of it); otherwise local. The
    pool stays capped by its budget: a state larger than the budget reserves the
    whole budget, and saves of it block until the rest has been written.
    """
    pool = pool or default_pool()
    items = None
    if collective:
        wait_all()  # a save in flight may still use the group's collectives in its background thread
        items = planned_writes(state, coordinator_for(process_group))
    nbytes = staging_bytes(state, pool.slab_bytes, part_size=part_size, items=items)
    return StagingReservation(pool, nbytes, background=background)


def _finish_at_exit() -> None:
    """At interpreter exit: finish every async save still in flight (a training script
    that ends without ``wait()`` would otherwise lose its last checkpoint with exit
    status 0), and report the failure of any save nobody waited for."""
    handles = list(_in_flight.values())
    for handle in handles:
        if not handle.done():
            log.warning("the process is exiting: waiting for the async save to %s to finish", handle.uri)
    for handle in [*_failed_unwaited, *handles]:
        handle._done.wait()
        if handle._error is not None and not handle._reported:
            log.error("the async save to %s failed and was never waited for: %s", handle.uri, handle._error)


at_exit(_finish_at_exit)  # bcp's exit handler runs it before releasing bcp's groups


def wait_all() -> None:
    """Wait for every async save of this process (errors are not raised here)."""
    for handle in list(_in_flight.values()):
        handle._done.wait()
