"""The persistent save (all ranks call ``save``; one process is a world of one),
composed from the save's phases (``bcp.save_phases``).

1. (all ranks) prepare: flatten the state, find each tensor's local boxes (a
   LocalLayout), encode objects.
2. (coordinator) gather every rank's hello (layout digests, cached plans held,
   objects), refuse an existing checkpoint, settle the objects. Unless the plan of
   this exact job-wide layout is cached (``bcp.planning.cache``): gather the layouts' box
   arrays (metadata once per digest), validate that shards tile every tensor,
   deduplicate replicas, balance bytes over ranks (:func:`_plan`, this module's own
   step), scatter each rank's writes as indices into its own boxes.
3. (all ranks) open the pipeline, stage, write the assigned boxes into one data file
   per rank, checksummed.
4. (coordinator) gather fragment rows (Arrow tables), merge them in columns, write
   fragments.arrow, then commit manifest.json; any rank's failure in any phase
   means no commit and an error on every rank.

The commit protocol itself (generations, create-only manifest, discarding) is
``bcp.commit``; the key layout is ``bcp.metadata.keys``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Unpack

import numpy as np

from bcp import trace
from bcp.coordination.collectives import Coordinator, gather_decide, gather_decide_scatter, run_phase
from bcp.coordination.lanes import ready
from bcp.errors import CheckpointNotFoundError, ShardingError
from bcp.gc_pause import gc_paused
from bcp.incremental import (
    BaseRef,
    Candidates,
    Looked,
    Reuse,
    committed_rows,
    decide,
    find_candidates,
    is_sibling,
    knows_base,
    prefetch_base,
    prefetch_manifest,
    remember_commit,
)
from bcp.io_scheduler import device_copy
from bcp.io_scheduler.write_pipeline import WriteItem
from bcp.kept_plans import LocalPlans, Prepared, prepare_tensors, take
from bcp.metadata.keys import split_parent
from bcp.options import SaveOptions, SaveOptionsKwargs
from bcp.pieces import StreamDigests, background, start_digests
from bcp.planning import GlobalPlan, LayoutMeta, LocalLayout, plan_save
from bcp.planning.cache import PlanCache, PlanSummary, plan_cache_for, save_order
from bcp.planning.writer_rows import WriterReport
from bcp.replicas import check_places, check_replicas
from bcp.save_phases import (
    SaveDecision,
    SaveInfo,
    SaveJob,
    SaveStart,
    coordinate_save,
    hello,
    log_plan,
    open_pipeline,
    prepare_save,
)
from bcp.state import flatten_state
from bcp.target import Target, resolve_backend

log = logging.getLogger(__name__)


def planned_writes(state: Mapping[str, Any], coord: Coordinator) -> list[WriteItem]:
    """(all ranks, collective) The boxes this rank would write if ``state`` were saved
    now with ``coord``'s ranks: after deduplication and balancing (a DDP rank writes
    about 1/N of the state). Sizes staging reservations; writes nothing."""
    phase = "planning the staging reservation"
    prepared: Prepared = run_phase(coord, phase, lambda: prepare_tensors(flatten_state(state), coord.rank, {}))
    _planned, mine = gather_decide_scatter(
        coord, phase, prepared.layout, plan_save, lambda planned: [planned.writes[r] for r in range(coord.world_size)]
    )
    return [prepared.items[i] for i in mine.tolist()]


@gc_paused
def save(
    state: Mapping[str, Any], uri: Target, options: SaveOptions | None = None, **overrides: Unpack[SaveOptionsKwargs]
) -> SaveInfo:
    """Save ``state`` (a nested dict of tensors, shards and plain objects) to ``uri``.

    Collective when torch.distributed is initialised: every rank of the process group
    (default: the whole job) calls it with its own local state. Refuses
    (CheckpointExistsError) when a committed checkpoint is already there, unless
    ``overwrite=True``; an overwrite replaces it atomically. ``options`` and keyword
    arguments are the fields of :class:`SaveOptions` (overwrite, metadata,
    allow_pickle, storage_options, checksum_block_bytes, process_group, streams, pool,
    check_replicas). Refuses (ReplicaMismatchError) when ranks hold different values
    of a tensor stored once (a plain tensor, a replicated DTensor): docs/distributed.md.
    """
    opts = SaveOptions.of(options, overrides)
    job = start_save(state, uri, ready(opts.process_group, "bcp.save").caller, opts, stage_all=False)
    job.stage()
    return job.complete()


def start_save(
    state: Mapping[str, Any], uri: Target, coord: Coordinator, options: SaveOptions, *, stage_all: bool
) -> SaveJob:
    """(all ranks, collective) Prepare, plan, agree on the generation, open this
    rank's pipeline; the job's ``stage`` and ``complete`` finish the save
    (``stage_all``: an async save, whose caller may change the state once staged)."""
    started = time.perf_counter()
    session = trace.begin(options.trace, coord.rank, "save")
    try:
        with trace.span("plan"):
            return _start(state, uri, coord, options, started, session, stage_all=stage_all)
    except BaseException:
        if session is not None:
            session.end(failed=True)
        raise


def _start(
    state: Mapping[str, Any],
    uri: Target,
    coord: Coordinator,
    options: SaveOptions,
    started: float,
    session: trace.Session | None,
    *,
    stage_all: bool,
) -> SaveJob:
    backend = resolve_backend(uri, options.storage_options)
    cache = plan_cache_for(coord.cache_key)
    prepared: Prepared = run_phase(
        coord,
        "preparing the save",
        prepare_save,
        state,
        coord.rank,
        options.allow_pickle,
        check_replicas=options.check_replicas,
        world_size=coord.world_size,
        plans=cache.local(LocalPlans),
        piece_bytes=options.piece_bytes if options.is_incremental else None,
    )
    held = cache.held()
    layout = prepared.layout
    # the digests and first-block checksums read device memory on other threads (their
    # own streams): they wait for the work the caller queued before the call
    at_call = device_copy.caller_done(i.piece.tensor for i in prepared.items) if options.is_incremental else None
    prefetched = None
    first: Future | None = None  # the base's manifest (or reader) as first read
    kept = _lookups(prepared)
    if options.base is not None and is_sibling(uri, options.base):
        if knows_base(kept, str(options.base)):
            # the base is likely the save this structure just committed: its manifest says
            # (several ranks: the coordinator's read, after the holds, says)
            one_rank = coord.world_size == 1
            first = prefetch_manifest(options.base, options.storage_options) if one_rank else None
        else:
            # the base's catalog read while the coordinator holds the base (a durable write)
            fqns = list(dict.fromkeys(i.plan.fqn for i in prepared.items))
            prefetched = first = prefetch_base(options.base, options.storage_options, fqns)
    reusable = None
    early: Future | None = None
    threads = options.streams or backend.hints.concurrency
    if options.is_incremental and coord.world_size == 1 and first is not None:
        # one rank writes every box: find what the base offers (and digest those pieces)
        # while the coordinator checks the target
        every_item = _listed(prepared.items)
        early = _decide_early(every_item, options, first, threads, kept, prefetched is not None, at_call)
        reusable = _reuses_any(every_item, early)
    decision: SaveDecision | SaveStart = gather_decide(
        coord,
        "planning the save",
        hello(prepared, held),
        lambda hellos: coordinate_save(backend, hellos, options, cache, uri, reusable),
        share=lambda d: d.start,
    )
    start = decision.start if isinstance(decision, SaveDecision) else decision
    if session is not None:
        session.label = start.save_id
    if start.cached:
        my_writes = held[start.key]
    else:
        # box arrays from every rank; the metadata only from the rank asked for it
        sent = layout if start.meta_from.get(layout.meta_digest) == coord.rank else layout.without_meta()
        # each rank receives only its own writes, as an index array into its boxes
        planned: tuple[SaveDecision, GlobalPlan] | None
        planned, my_writes = gather_decide_scatter(
            coord,
            "planning the save",
            sent,
            lambda layouts: _plan(decision, layouts, cache),  # type: ignore[arg-type]  # (coordinator) a SaveDecision
            lambda done: [done[1].writes[r] for r in range(coord.world_size)],
        )
        if planned is not None:
            decision = planned[0]
    cache.remember_writes(start.key, my_writes)  # newest last: evicted in the coordinator's order
    items: Sequence[WriteItem] = take(prepared.items, my_writes)  # a kept plan's: no item made per tensor
    reuse = None
    every = False
    if options.is_incremental:
        listed = _listed(items)
        # which pieces the base holds already (digests of the values at the call, for the
        # pieces whose first block is unchanged): only the others are written
        with trace.span("digest"):
            found, digests = run_phase(
                coord,
                "reading the base",
                _decide,
                start.base,
                listed,
                my_writes,
                options,
                prefetched,
                early,
                threads,
                _lookups(prepared),
                at_call,
            )
        reuse = (listed, found, digests)
        every = len(found.changed) == len(listed)
        items = [listed[k] for k in found.changed]
    pipeline = open_pipeline(
        backend,
        coord.rank,
        start.save_id,
        items,
        options,
        stage_all=stage_all,
        plans=prepared.local.pipelines if prepared.local is not None else None,
        writes=my_writes if reuse is None or every else my_writes[reuse[1].changed],
    )
    if reuse is not None:  # the writers digest what they write (the bytes saved)
        pipeline.digests = StreamDigests(pipeline.unique, pipeline.item_nbytes)
    mine = decision if isinstance(decision, SaveDecision) else None
    job = SaveJob(coord, backend, options, mine, start.save_id, pipeline, started, session)
    job.reuse = reuse
    if reuse is not None and kept is not None and isinstance(uri, (str, os.PathLike)):
        one_rank = coord.world_size == 1
        n = len(prepared.items)
        job.on_commit = _remembering(reuse[1], kept, os.fspath(uri), start.save_id, options, n, my_writes, one_rank)
    return job


Early = tuple[BaseRef, Candidates, np.ndarray]


def _listed(items: Sequence[WriteItem]) -> list[WriteItem]:
    """``items`` as a list (an incremental save's: its kept plan's cut items are one already)."""
    return items if isinstance(items, list) else list(items)


def _lookups(prepared: Prepared) -> Any:
    """Where the base-row lookups of ``prepared``'s kept structure are kept (None: not kept)."""
    return prepared.local.lookups if prepared.local is not None else None


def _remembering(
    found: Reuse, kept: Any, uri: str, save_id: str, options: SaveOptions, n: int, writes: np.ndarray, one_rank: bool
) -> Callable[[WriterReport], None]:
    """(``SaveJob.on_commit``) Keep the committed checkpoint's rows of this rank's items
    as the lookups of it as a base (``bcp.incremental.remember_commit``), by the scope
    the next save looks them up by (:func:`_decide_early` for one rank, else :func:`_decide`)."""

    def remember(report: WriterReport) -> None:
        try:
            mine = committed_rows(report, found, len(writes))
            if mine is None:
                return
            every: Looked = [None] * n
            for j, i in enumerate(writes.tolist()):
                every[i] = mine[j]
            # the scope the next save looks it up by: one rank's early match, else its writes
            scopes: dict[object, Looked] = {"every box": every} if one_rank else {writes.tobytes(): mine}
            remember_commit(kept, uri, save_id, options.checksum_block_bytes, scopes)
        except Exception as e:  # noqa: BLE001 - the next save reads the catalog as always
            log.debug("%s: its rows are not kept for the next save (%s)", uri, e)

    return remember


def _decide_early(
    items: list[WriteItem],
    options: SaveOptions,
    prefetched: Future,
    threads: int,
    kept: Any = None,
    is_reader: bool = True,
    at_call: Callable[[], None] | None = None,
) -> Future[Early]:
    """(one rank) In the background, on the base as first read (``prefetched``: its
    reader, or with ``is_reader`` False its manifest alone): the candidates of ``items``
    and the digests that decide them (:func:`_decide`; ``kept``: the base-row lookups
    kept with their structure, ``bcp.incremental.find_candidates``; ``at_call``: waits
    for the caller's device work queued before the call, ``device_copy.caller_done``)."""
    assert options.base is not None  # prefetched: a base was given

    def run() -> Early:
        if at_call is not None:  # before any device read: this thread's stream is not the caller's
            at_call()
        got = prefetched.result()
        if got is None:
            raise CheckpointNotFoundError(f"base {options.base!r} holds no committed checkpoint (no manifest.json)")
        manifest = got.manifest if is_reader else got
        base = BaseRef(str(options.base), split_parent(str(options.base))[1], manifest)
        reader = prefetched if is_reader else None
        found = find_candidates(
            base, items, options.checksum_block_bytes, options.storage_options, reader, kept, "every box"
        )
        return base, found, start_digests(items, threads, found.to_digest())()

    return background(run)


def _reuses_any(items: list[WriteItem], early: Future[Early]) -> Callable[[BaseRef], bool]:
    """(one rank) Whether any of ``items`` equals a piece of the base as first read, from
    the catalog read early: when none does, the base is not held (no durable write) and
    the save refers to nothing. True when that cannot be told (the base is then held and
    matched as always)."""

    def reusable(first: BaseRef) -> bool:
        try:
            base, found, digests = early.result()
        except Exception:  # noqa: BLE001 - matched again after the holds; that error is reported
            return True
        if base.manifest.save_id != first.manifest.save_id:
            return True
        return bool(decide(found, items, digests).reused)

    return reusable


def _decide(
    base: BaseRef | None,
    items: list[WriteItem],
    writes: np.ndarray,
    options: SaveOptions,
    prefetched: Future | None,
    early: Future[Early] | None,
    threads: int,
    kept: Any = None,
    at_call: Callable[[], None] | None = None,
) -> tuple[Reuse, np.ndarray]:
    """What ``items`` (this rank's ``writes``) reuse of ``base``, and the digests of the
    items whose first block checksum equals a candidate row's (zeros for the others: the
    pipeline digests what it writes). Taken from ``early`` when it read the base held;
    ``at_call`` waits for the caller's device work queued before the call."""
    if base is None:
        return Reuse([], list(range(len(items))), [], {}), np.zeros((len(items), 16), np.uint8)
    if early is not None:
        try:
            seen, found, digests = early.result()
        except Exception as e:  # noqa: BLE001 - read again below; that error is the one to report
            log.debug("base %s: the early match failed (%s): matching again", base.uri, e)
        else:
            if seen.manifest.save_id == base.manifest.save_id:
                found = dataclasses.replace(found.subset(writes.tolist()), base=base)
                return decide(found, items, digests[writes]), digests[writes]
    if at_call is not None:  # the digest threads read device memory on their own streams
        at_call()
    found = find_candidates(
        base, items, options.checksum_block_bytes, options.storage_options, prefetched, kept, writes.tobytes()
    )
    digests = start_digests(items, threads, found.to_digest())()
    return decide(found, items, digests), digests


def _plan(decision: SaveDecision, layouts: list[LocalLayout], cache: PlanCache) -> tuple[SaveDecision, GlobalPlan]:
    """(coordinator) Plan the writes from every rank's layout; remember the plan."""
    metas = cache.metas()
    for rank, layout in enumerate(layouts):
        d = decision.meta_digests[rank]
        if layout.meta_digest != d:
            raise ShardingError(f"rank {rank} sent a layout other than the one it announced")
        if d not in metas:
            if not layout.meta:
                raise ShardingError(f"rank {rank}: no layout metadata for digest {d.hex()}")
            if hashlib.blake2b(layout.meta, digest_size=16).digest() != d:
                raise ShardingError(f"rank {rank}: layout metadata does not match its digest")
            metas[d] = LayoutMeta.decode(layout.meta)
    plan = plan_save(layouts, meta=metas)
    check_replicas(decision.replicas, decision.meta_digests, metas)
    check_places(decision.objects, decision.meta_digests, metas)
    summary = PlanSummary(
        bytes_per_rank=plan.bytes_per_rank,
        tensors=plan.tensors,
        total_bytes=plan.total_bytes,
        order=save_order(decision.meta_digests, metas),
        metas={d: metas[d] for d in dict.fromkeys(decision.meta_digests)},
    )
    cache.remember_plan(decision.start.key, summary)
    if len(layouts) > 1:
        log_plan(summary)
    return dataclasses.replace(decision, plan=summary), plan
