"""Asynchronous save: training blocks only while the state is copied to host memory.

``async_save`` plans collectively, copies every box this rank writes into staging
slabs from the process-wide pool (reused across saves, so the copy runs at warm-memory
speed), and returns a handle; writing, checksums and the commit run in a background
thread. Two saves may be in flight at once (ping-pong): save k+1 stages while save k
writes when the pool has room for both, and otherwise waits for k's slabs to drain,
so it never corrupts k. A third waits for the first.

``overlap=optimizer`` goes further: tensors the optimizer owns (parameters and its
state) do not change until ``optimizer.step()``, so they are staged in the
background during forward and backward, and a step pre-hook waits only for the
part not yet copied. Everything else (buffers, objects) is copied before returning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from bcp.metadata import DEFAULT_BLOCK_BYTES

from .collectives import coordinator_for
from .saver import SaveInfo, SaveJob
from .staging import StagingPool
from .write_pipeline import Chunk

_slots_lock = threading.Lock()
_in_flight: dict[int, AsyncSaveHandle] = {}
_save_count = 0


class AsyncSaveHandle:
    """A save in progress. ``wait()`` returns its SaveInfo or raises its error."""

    def __init__(self, job: SaveJob, blocking_seconds: float) -> None:
        self._job = job
        self._done = threading.Event()
        self._result: SaveInfo | None = None
        self._error: BaseException | None = None
        #: seconds ``async_save`` kept the caller waiting
        self.blocking_seconds = blocking_seconds
        self.staged = threading.Event()

    def _run(self, background_stage=None) -> None:
        try:
            if background_stage is not None:
                background_stage()
            self._result = self._job.complete()
        except BaseException as e:  # noqa: BLE001 - re-raised from wait()
            self._error = e
        finally:
            self.staged.set()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self._job.backend.uri} still running after {timeout} s")
        if self._error is not None:
            raise self._error
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
    uri: str,
    *,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    checksum_block_bytes: int = DEFAULT_BLOCK_BYTES,
    process_group: Any = None,
    streams: int | None = None,
    pool: StagingPool | None = None,
    overlap: torch.optim.Optimizer | None = None,
) -> AsyncSaveHandle:
    """Start saving ``state``; return once it is safe to change the state.

    Same arguments as ``bcp.save`` (collective in the same way). With ``overlap``
    set to the optimizer, returns before its parameters and state are copied; its
    next ``step()`` waits for that copy (see the module docstring).
    """
    global _save_count
    started = time.perf_counter()
    with _slots_lock:
        slot = _save_count % 2
        _save_count += 1
        previous = _in_flight.get(slot)
    if previous is not None:
        previous._done.wait()  # the save two back used this slot's group: let it finish
    job = SaveJob.start(
        state, uri, coordinator_for(process_group, slot=slot), overwrite=overwrite, metadata=metadata,
        allow_pickle=allow_pickle, storage_options=storage_options, block=checksum_block_bytes, streams=streams,
        pool=pool, stage_all=True,
    )
    background = None
    if overlap is None:
        job.stage()
    else:
        background = True
        owned = _optimizer_storages(overlap)
        pipeline = job.pipeline

        def later(chunk: Chunk) -> bool:
            return all(
                pipeline.items[s.item][1].tensor.untyped_storage().data_ptr() in owned for s in chunk.segments
            )

        job.stage(select=lambda c: not later(c), last=False)  # what forward/backward may change: now
    handle = AsyncSaveHandle(job, 0.0)
    if overlap is None:
        handle.staged.set()
    else:
        hook_box: list = []

        def wait_for_copy(_optimizer, _args, _kwargs):
            handle.staged.wait()
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
    handle.blocking_seconds = time.perf_counter() - started
    thread.start()
    return handle


def wait_all() -> None:
    """Wait for every async save of this process (errors are not raised here)."""
    for handle in list(_in_flight.values()):
        handle._done.wait()
