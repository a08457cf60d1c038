"""The local tier's fast path: a local save whose caller only copies the state.

An ordinary async save plans on the caller's thread (a rendezvous, the room check's
``all_gather``, the save's hello and decision: four or five collectives) before it
copies. From the second local save of a manager on, when the previous one was
planned and fitted in the staging pool, a local save instead:

1. (caller, no collective) prepares the state as ``bcp.save`` does and copies the
   boxes this rank wrote at the previous save (its cached writes) into staging slabs,
   nothing else; no byte reaches the local root;
2. (the save's background thread, on the background lane) removes stale copies of
   this step and later ones (the host's first rank), then sends the coordinator, in
   one ``gather``, its room record (:func:`bcp.tiers.room.own_record`), its hello
   (layout digests, cached plans, objects, replica checksums) and whether it staged
   everything; the coordinator answers every rank in one broadcast:

   * a host lacks room: the step is skipped on every rank with the room check's
     WARNING, the slabs are returned, nothing is written;
   * the plan is not the previous one (some rank's layout changed, a plan evicted,
     a rank whose slabs did not fit): the step is skipped with a WARNING, and the
     next local save plans on the caller's thread as before;
   * a rank's state could not be prepared, or the target holds a committed step:
     that error, on every rank, from ``wait()``;
   * otherwise the save's id: each rank opens its data file and writes what it
     staged, and the save goes on as any local save (commit, metadata, holdings,
     replication, drain, retention).

Steps due for draining, and saves with ``trace=``, always take the ordinary path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from bcp.async_save import AfterCommit, AsyncSaveHandle, async_save_planned_later
from bcp.backends import Backend
from bcp.coordination.collectives import Coordinator, SentError, decide, portable
from bcp.io_scheduler.write_pipeline import StagingFull
from bcp.kept_plans import Prepared
from bcp.options import SaveOptions
from bcp.planning.cache import plan_cache_for
from bcp.save_phases import (
    Hello,
    SaveDecision,
    SaveJob,
    coordinate_save,
    hello,
    open_pipeline,
    prepare_save,
    stage,
    start_writing,
)
from bcp.tiers.hosts import HostMap
from bcp.tiers.room import short_hosts

log = logging.getLogger(__name__)

PHASE = "planning the local save"


class Report(NamedTuple):
    """What each rank sends the coordinator from the save's background thread."""

    room: tuple[int, int, int]
    hello: Hello | None
    #: the rank's error preparing or staging its state (None: none)
    error: SentError | None
    #: whether the rank staged its previous writes whole
    staged: bool


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The coordinator's answer: ``go`` with the decision's start, or why the step is skipped."""

    go: bool
    why: str = ""
    #: the hosts that lacked room (the plan still stands)
    short: tuple[str, ...] = ()
    start: Any = None


def _verdict(
    coord: Coordinator,
    reports: list[Report] | None,
    hosts: HostMap,
    backend: Backend,
    opts: SaveOptions,
    key: bytes,
) -> tuple[Verdict, SaveDecision | None]:
    """(coordinator) Room, errors, then the plan: the previous one, or skip."""
    assert reports is not None
    for rank, report in enumerate(reports):
        if report.error is not None:
            error = report.error.restore()
            error.add_note(f"raised on rank {rank} while preparing the local save")
            raise error
    short = short_hosts(coord, hosts, [r.room for r in reports])
    if short:
        return Verdict(False, "; ".join(map(str, short)), short=tuple(r.host for r in short)), None
    if not all(r.staged for r in reports):
        return Verdict(False, "some rank could not stage its previous writes"), None
    hellos = [r.hello for r in reports]
    assert all(h is not None for h in hellos), "a rank without an error prepared its hello"
    decision = coordinate_save(backend, hellos, opts, plan_cache_for(coord.cache_key))  # type: ignore[arg-type]
    if not decision.start.cached or decision.start.key != key:
        return Verdict(False, "the save plan is not the previous one (the state's layout changed)"), None
    return Verdict(True, start=decision.start), decision


def save_fast(
    state: Mapping[str, Any],
    backend: Backend,
    opts: SaveOptions,
    coord: Coordinator,
    hosts: HostMap,
    *,
    key: bytes,
    writes: np.ndarray | None,
    room: Callable[[], tuple[int, int, int]],
    before_plan: Callable[[], None],
    on_skip: Callable[[Verdict], None],
    overlap: torch.optim.Optimizer | None,
    after_commit: AfterCommit,
) -> AsyncSaveHandle:
    """(all ranks, caller: no collective) Stage this rank's previous writes (``writes``
    of plan ``key``) and return; the rest runs in the save's thread on ``coord`` (the
    background lane). ``room()`` is this rank's room record, ``before_plan`` runs there
    first (the stale copies' removal), ``on_skip`` when the step is skipped."""
    started = time.perf_counter()
    prepared: Prepared | None = None
    error: BaseException | None = None
    try:
        prepared = prepare_save(
            state, coord.rank, opts.allow_pickle, check_replicas=opts.check_replicas, world_size=coord.world_size
        )
    except Exception as e:  # noqa: BLE001 - sent to the coordinator: every rank raises it
        error = e
    usable = (
        prepared is not None and writes is not None and (not len(writes) or int(writes.max()) < len(prepared.items))
    )
    items = (
        [prepared.items[i] for i in writes.tolist()] if usable and prepared is not None and writes is not None else []
    )
    pipeline = open_pipeline(backend, coord.rank, None, items, opts, stage_all=True)  # deferred: no save id yet

    def stage_here(select: Any = None, last: bool = True) -> None:
        stage(pipeline, select, last)

    def plan() -> SaveJob | None:
        try:
            before_plan()
            full = isinstance(pipeline.error, StagingFull)
            failure = error or (None if full else pipeline.error)
            first = hello(prepared, plan_cache_for(coord.cache_key).held()) if prepared is not None else None
            report = Report(room(), first, portable(failure) if failure else None, usable and not full)
            reports = coord.gather(report)
            outcome = decide(coord, PHASE, _verdict, coord, reports, hosts, backend, opts, key, share=lambda v: v[0])
            verdict, decision = outcome if coord.is_coordinator else (outcome, None)
        except BaseException:
            pipeline.discard()
            raise
        if not verdict.go:
            pipeline.discard()
            on_skip(verdict)
            return None
        start = verdict.start
        start_writing(pipeline, start.save_id)
        job = SaveJob(coord, backend, opts, decision, start.save_id, pipeline, started)
        job.visible_ranks = after_commit.visible_ranks
        return job

    return async_save_planned_later(
        pipeline, stage_here, plan, coord, backend.uri, overlap=overlap, after_commit=after_commit
    )
