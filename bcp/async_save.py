"""Asynchronous save: training blocks only while the state is copied to host memory.

``async_save`` plans collectively, copies every box this rank writes into staging
slabs from the process-wide pool (reused across saves, so the copy runs at warm-memory
speed), and returns a handle; writing, checksums and the commit run in a background
thread. Two saves may be in flight at once (ping-pong): save k+1 stages while save k
writes when the pool has room for both, and otherwise waits for k's slabs to drain,
so it never corrupts k. A third waits for the first.

Collectives: planning runs on the caller's lane of bcp's gloo groups, the commit
on the background lane; the commits of one process group run one at a time, in
the order of their ``async_save`` calls (``bcp.collectives`` says why that keeps
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

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Unpack

import torch

from .collectives import at_exit, background_coordinator, coordinator_for, group_destroyed
from .io_scheduler.staging import StagingPool, StagingReservation, default_pool
from .io_scheduler.write_pipeline import Chunk, layout, plan_chunks
from .options import SaveOptions, SaveOptionsKwargs
from .saver import SaveInfo, SaveJob
from .shards import local_pieces
from .state import flatten_state
from .target import Target

log = logging.getLogger(__name__)

_slots_lock = threading.Lock()
_in_flight: dict[int, AsyncSaveHandle] = {}
_save_count = 0
#: per process group (its coordinator's cache key): the async save whose commit ran
#: or runs last on the background lane; the next one's commit waits for it
_lane_tail: dict[Any, AsyncSaveHandle] = {}


class AsyncSaveHandle:
    """A save in progress. ``wait()`` returns its SaveInfo or raises its error."""

    def __init__(self, job: SaveJob, blocking_seconds: float, after: AsyncSaveHandle | None = None) -> None:
        self._job = job
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

    def _run(self, background_stage=None) -> None:
        try:
            if background_stage is not None:
                background_stage()
            if self._after is not None:
                self._after._done.wait()  # its commit's collectives come first, on every rank
                self._after = None
            self._result = self._job.complete()
        except BaseException as e:  # noqa: BLE001 - re-raised from wait()
            self._error = e
            if group_destroyed(self._job.coord):
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

    def _outcome(self) -> str:
        """What a failed commit left, as far as this rank knows."""
        job = self._job
        if job.committed:
            return "the checkpoint IS committed (this rank wrote its manifest), the other ranks could not be told"
        if job.coord.is_coordinator or not job.reported:
            return "the checkpoint was NOT committed"
        return "the coordinator may have committed the checkpoint after this rank lost contact: load it to find out"

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self._job.backend.uri} still running after {timeout} s")
        self._reported = True
        if self._error is not None:
            raise self._error
        assert self._result is not None, "done without an error: complete() returned"
        return self._result

    @property
    def uri(self) -> str:
        return self._job.backend.uri


def _optimizer_storages(optimizer: torch.optim.Optimizer) -> set[int]:
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


def async_save(
    state: Mapping[str, Any],
    uri: Target,
    options: SaveOptions | None = None,
    *,
    overlap: torch.optim.Optimizer | None = None,
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
    """
    global _save_count
    started = time.perf_counter()
    opts = SaveOptions.of(options, overrides)
    with _slots_lock:
        slot = _save_count % 2
        _save_count += 1
        previous = _in_flight.get(slot)
    if previous is not None:
        previous._done.wait()  # at most two in flight: the save two back finishes first
    coord = coordinator_for(opts.process_group, "bcp.async_save")
    job = SaveJob.start(state, uri, coord, opts, stage_all=True)
    job.coord = background_coordinator(coord)  # the commit runs on the background lane
    background: Callable[[], None] | None = None
    if overlap is None:
        job.stage()
        job.pipeline.copies.wait()  # device copies done: the caller may change or free anything
    else:
        owned = _optimizer_storages(overlap)
        pipeline = job.pipeline

        def later(chunk: Chunk) -> bool:
            return all(
                pipeline.items[s.item].piece.tensor.untyped_storage().data_ptr() in owned for s in chunk.segments
            )

        job.stage(select=lambda c: not later(c), last=False)  # what forward/backward may change: now
        job.pipeline.copies.wait()
    after = _lane_tail.get(coord.cache_key) if coord.world_size > 1 else None
    handle = AsyncSaveHandle(job, 0.0, after)
    if overlap is None:
        handle.staged.set()
    else:
        hook_box: list = []

        def wait_for_copy(_optimizer, _args, _kwargs):
            handle.staged.wait()  # every copy is queued (host copies are done)
            job.pipeline.copies.order_after()  # step()'s kernels run after the device copies
            hook_box[0].remove()

        hook_box.append(overlap.register_step_pre_hook(wait_for_copy))

        def stage_rest() -> None:
            try:
                job.stage()  # the optimizer-owned rest, while training runs forward/backward
            finally:
                handle.staged.set()

        background = stage_rest
    thread = threading.Thread(target=handle._run, args=(background,), name="bcp-async-save", daemon=True)
    with _slots_lock:
        _in_flight[slot] = handle
    if coord.world_size > 1:
        _lane_tail[coord.cache_key] = handle
    handle.blocking_seconds = time.perf_counter() - started
    thread.start()
    return handle


def staging_bytes(state: Mapping[str, Any], slab_bytes: int) -> int:
    """Staging memory an async save of ``state`` takes on this rank: the slabs its
    chunks occupy (a fragment of 1 MiB or more fills whole slabs of its own, small
    ones share), laid out as the write pipeline lays them out."""
    pieces = [
        piece
        for leaf in flatten_state(state).values()
        if leaf.is_tensor
        for piece in local_pieces(leaf.value, leaf.fqn).pieces
    ]
    placed = layout(pieces)
    spans = [(i, placed.offsets[i], pieces[i].tensor.numel() * pieces[i].tensor.element_size()) for i in placed.unique]
    return len(plan_chunks(spans, slab_bytes)) * slab_bytes


def reserve_staging(
    state: Mapping[str, Any], *, pool: StagingPool | None = None, background: bool = True
) -> StagingReservation:
    """Allocate the staging memory an async save of ``state`` needs, now, in a
    background thread (local; not collective).

    Pinned host memory allocates at about 1 GB/s, so without this the first
    ``async_save`` of a run pays for it while training waits. Call it once the state
    exists (``CheckpointManager.load_latest`` does); training may go on meanwhile.
    The pool stays capped by its budget: a state larger than the budget reserves
    the whole budget, and saves of it block until the rest has been written.
    """
    pool = pool or default_pool()
    return StagingReservation(pool, staging_bytes(state, pool.slab_bytes), background=background)


def _finish_at_exit() -> None:
    """At interpreter exit: finish every async save still in flight (a training script
    that ends without ``wait()`` would otherwise lose its last checkpoint with exit
    status 0), and report the failure of any save nobody waited for."""
    handles = list(_in_flight.values())
    for handle in handles:
        if not handle.done():
            log.warning("the process is exiting: waiting for the async save to %s to finish", handle.uri)
    for handle in handles:
        handle._done.wait()
        if handle._error is not None and not handle._reported:
            log.error("the async save to %s failed and was never waited for: %s", handle.uri, handle._error)


at_exit(_finish_at_exit)  # bcp's exit handler runs it before releasing bcp's groups


def wait_all() -> None:
    """Wait for every async save of this process (errors are not raised here)."""
    for handle in list(_in_flight.values()):
        handle._done.wait()
