"""The save path (all ranks call ``save``; one process is a world of one).

1. (all ranks) flatten the state, find each tensor's local boxes (a LocalLayout),
   encode objects.
2. (coordinator) gather every rank's hello (layout digests, cached plans held,
   objects), refuse an existing checkpoint, settle the objects. Unless the plan of
   this exact job-wide layout is cached (``bcp.planning.cache``): gather the layouts' box
   arrays (metadata once per digest), validate that shards tile every tensor,
   deduplicate replicas, balance bytes over ranks, scatter each rank's writes as
   indices into its own boxes.
3. (all ranks) write the assigned boxes into one data file per rank, checksummed.
4. (coordinator) gather fragment rows (Arrow tables), merge them in columns, write
   fragments.arrow, then commit manifest.json; any rank's failure in any phase
   means no commit and an error on every rank.

The commit protocol itself (generations, create-only manifest, discarding) is
``bcp.commit``; the key layout is ``bcp.metadata.keys``.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Unpack

import pyarrow as pa
import torch

from bcp import objcodec, trace
from bcp._version import __version__
from bcp.backends import Backend
from bcp.commit import (
    DEFAULT_GRACE_SECONDS,
    ExistingCheckpoint,
    check_generation_intact,
    commit,
    discard_generation,
    find_existing,
    new_save_id,
    remove_leftovers,
    write_catalog,
)
from bcp.coordination.collectives import Coordinator, decide, run_phase
from bcp.coordination.lanes import coordinator_for
from bcp.errors import CheckpointExistsError, CommitUncertainError, ShardingError, UnsupportedStateError
from bcp.gc_pause import gc_paused
from bcp.io_scheduler.chunk_plan import Chunk
from bcp.io_scheduler.write_pipeline import WriteItem, WritePipeline, make_pipeline
from bcp.kept_plans import PLAIN_TENSORS, LocalPlans, Prepared, prepare_tensors
from bcp.metadata import FileEntry, Fragment, Manifest, ObjectEntry
from bcp.metadata.keys import catalog_key, data_file_key, generation_name
from bcp.options import SaveOptions, SaveOptionsKwargs
from bcp.planning import GlobalPlan, LayoutMeta, LocalLayout, plan_save
from bcp.planning.cache import PlanCache, PlanSummary, plan_cache_for, plan_key, save_order
from bcp.planning.writer_rows import WriterReport, fragment_table, merge_reports, row_stats
from bcp.replicas import ReplicaSummer, ReplicaSums, check_replicas
from bcp.shards import PerRank
from bcp.state import flatten_state, path_to_json
from bcp.target import Target, resolve_backend

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """What a save wrote (job-wide totals, plus this rank's share)."""

    uri: str
    save_id: str
    tensors: int
    fragments: int
    objects: int
    tensor_bytes: int
    bytes_written: int
    seconds: float
    world_size: int = 1
    rank: int = 0
    rank_bytes_written: int = 0
    #: this rank's stages (seconds active, bytes) when traced (``trace=``), else empty
    stages: Mapping[str, trace.StageTotal] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def gbps(self) -> float:
        """Tensor bytes per second, in GB/s (10^9)."""
        return self.tensor_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        ranks = f" from {self.world_size} ranks" if self.world_size > 1 else ""
        return (
            f"saved {self.tensors} tensors ({self.tensor_bytes / 2**20:.1f} MiB) and {self.objects} objects{ranks} "
            f"to {self.uri} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s)"
        )


class LocalObject(NamedTuple):
    """A non-tensor leaf as one rank prepared it."""

    key_path: list
    encoded: Any
    #: wrapped in PerRank: saved per rank even when every rank has the same value
    per_rank: bool


class Hello(NamedTuple):
    """What each rank sends the coordinator first, at every save: O(1) about its
    tensors (its layout's digests, and which cached plans it still holds), its
    objects, and the checksums of the replicated boxes it checks (16 bytes each).
    Box arrays follow only when the plan is not cached."""

    digest: bytes
    meta_digest: bytes
    held: frozenset[bytes]
    objects: dict[str, LocalObject]
    #: None when this rank checks no replica (one rank, or check_replicas="off")
    replicas: ReplicaSums | None = None


def prepare_save(
    state: Mapping[str, Any],
    rank: int,
    allow_pickle: bool,
    *,
    check_replicas: str = "off",
    world_size: int = 1,
    plans: LocalPlans | None = None,
) -> Prepared:
    """Step 1 on this rank (``plans``: where the tensors' plan of an unchanged
    structure is kept between saves, ``bcp.kept_plans``)."""
    leaves = flatten_state(state)
    objects: dict[str, LocalObject] = {}
    for leaf in leaves.values():
        if type(leaf.value) not in PLAIN_TENSORS and not leaf.is_tensor:
            per_rank = isinstance(leaf.value, PerRank)
            value = leaf.value.value if per_rank else leaf.value
            encoded = objcodec.encode(value, fqn=leaf.fqn, allow_pickle=allow_pickle)
            objects[leaf.fqn] = LocalObject(path_to_json(leaf.path), encoded, per_rank)
    summer = ReplicaSummer(check_replicas if world_size > 1 else "off")  # one rank has nothing to compare
    return prepare_tensors(leaves, rank, objects, summer, plans)


def planned_writes(state: Mapping[str, Any], coord: Coordinator) -> list[WriteItem]:
    """(all ranks, collective) The boxes this rank would write if ``state`` were saved
    now with ``coord``'s ranks: after deduplication and balancing (a DDP rank writes
    about 1/N of the state). Sizes staging reservations; writes nothing."""
    phase = "planning the staging reservation"
    prepared: Prepared = run_phase(coord, phase, lambda: prepare_tensors(flatten_state(state), coord.rank, {}))
    layouts = coord.gather(prepared.layout)

    def plan() -> GlobalPlan:
        assert layouts is not None, "the coordinator gathers every layout"
        return plan_save(layouts)

    planned: GlobalPlan | None = decide(coord, phase, plan, share=lambda _plan: None)
    mine = coord.scatter([planned.writes[r] for r in range(coord.world_size)] if planned is not None else None)
    return [prepared.items[i] for i in mine.tolist()]


def _decide_objects(all_objects: list[dict[str, LocalObject]]) -> dict[str, list[ObjectEntry]]:
    """One job-wide entry when every rank saved the same value; else one per rank."""
    out: dict[str, list[ObjectEntry]] = {}
    order: dict[str, None] = {}
    for objs in all_objects:
        order.update(dict.fromkeys(objs))
    for fqn in order:
        holders = [(r, objs[fqn]) for r, objs in enumerate(all_objects) if fqn in objs]
        encodings = {json.dumps(obj.encoded, sort_keys=True) for _r, obj in holders}
        per_rank = any(obj.per_rank for _r, obj in holders) or len(encodings) > 1 or len(holders) < len(all_objects)
        if per_rank and len(all_objects) > 1:
            out[fqn] = [ObjectEntry(obj.key_path, obj.encoded, r) for r, obj in holders]
        else:
            obj = holders[0][1]
            out[fqn] = [ObjectEntry(obj.key_path, obj.encoded, None)]
    return out


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
    job = SaveJob.start(state, uri, coordinator_for(opts.process_group, "bcp.save"), opts, stage_all=False)
    job.stage()
    return job.complete()


@dataclasses.dataclass(frozen=True)
class SaveStart:
    """The coordinator's first answer, sent to every rank."""

    save_id: str
    #: the plan's cache key (every rank's layout digest)
    key: bytes
    #: whether every rank reuses its cached writes for ``key`` (nothing else is sent)
    cached: bool
    #: meta digest -> the one rank that sends that metadata (the coordinator lacks it)
    meta_from: dict[bytes, int]


@dataclasses.dataclass(frozen=True)
class SaveDecision:
    """What the coordinator settles before any byte is written."""

    start: SaveStart
    objects: dict[str, list[ObjectEntry]]
    #: the committed checkpoint this save replaces (overwrite), if any
    existing: ExistingCheckpoint | None
    #: every rank's layout and meta digests, in rank order
    digests: tuple[bytes, ...]
    meta_digests: tuple[bytes, ...]
    #: the plan (known at once when cached, else after the layouts arrive)
    plan: PlanSummary | None = None
    #: every rank's replica checksums, compared once every rank's metadata is known
    replicas: tuple[ReplicaSums | None, ...] = ()

    @property
    def save_id(self) -> str:
        return self.start.save_id

    @property
    def order(self) -> tuple[str, ...]:
        """Every tensor's FQN in save order (the catalog's row order)."""
        assert self.plan is not None, "planned before anything is written"
        return self.plan.order


class SaveJob:
    """One save, in the steps a synchronous and an asynchronous save share.

    1. ``start`` (all ranks, collective): prepare, plan, agree on the generation.
    2. ``stage`` (all ranks, local): hand this rank's chunks to the write pipeline;
       with ``stage_all`` the state may change once it returns.
    3. ``complete`` (all ranks, collective): finish writing, gather fragment rows,
       commit (coordinator), return SaveInfo. An async save runs it in a thread.
    """

    def __init__(
        self,
        coord: Coordinator,
        backend: Backend,
        options: SaveOptions,
        decision: SaveDecision | None,
        save_id: str,
        pipeline: WritePipeline,
        started: float,
        session: trace.Session | None = None,
    ) -> None:
        self.coord = coord
        self.backend = backend
        self.options = options
        #: (coordinator) the plan and the objects; None on other ranks
        self.decision = decision
        self.save_id = save_id
        self.generation = generation_name(save_id)
        self.pipeline = pipeline
        self.started = started
        self.trace = session
        #: (coordinator) the ranks whose data files its own backend holds, which the
        #: commit checks are still there; None: every rank's. Ranks saving to different
        #: backends (the local tier, ``bcp.tiers``: each host's own root) set the ranks of
        #: the coordinator's host: it cannot list the other hosts' files.
        self.visible_ranks: frozenset[int] | None = None
        #: (coordinator) the manifest is written: nothing of this generation may be deleted
        self.committed = False
        #: this rank's fragment rows reached the coordinator: from here it may commit
        self.reported = False

    @classmethod
    def start(
        cls, state: Mapping[str, Any], uri: Target, coord: Coordinator, options: SaveOptions, *, stage_all: bool
    ) -> SaveJob:
        started = time.perf_counter()
        session = trace.begin(options.trace, coord.rank, "save")
        try:
            with trace.span("plan"):
                return cls._start(state, uri, coord, options, started, session, stage_all=stage_all)
        except BaseException:
            if session is not None:
                session.end(failed=True)
            raise

    @classmethod
    def _start(
        cls,
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
        )
        held = cache.held()
        layout = prepared.layout
        digest = prepared.local.digest if prepared.local is not None else layout.digest()
        hello = Hello(digest, layout.meta_digest, frozenset(held), prepared.objects, prepared.replicas)
        hellos = coord.gather(hello)
        decision: SaveDecision | SaveStart = decide(
            coord, "planning the save", coordinate_save, backend, hellos, options, cache, share=lambda d: d.start
        )
        start = decision.start if isinstance(decision, SaveDecision) else decision
        if session is not None:
            session.label = start.save_id
        if start.cached:
            my_writes = held[start.key]
        else:
            # box arrays from every rank; the metadata only from the rank asked for it
            sent = layout if start.meta_from.get(layout.meta_digest) == coord.rank else layout.without_meta()
            layouts = coord.gather(sent)
            planned: tuple[SaveDecision, GlobalPlan] | None = decide(
                coord,
                "planning the save",
                _plan,
                decision,
                layouts,
                cache,
                share=lambda _result: None,
            )
            plan = planned[1] if planned is not None else None
            if planned is not None:
                decision = planned[0]
            # each rank receives only its own writes, as an index array into its boxes
            my_writes = coord.scatter([plan.writes[r] for r in range(coord.world_size)] if plan is not None else None)
        cache.remember_writes(start.key, my_writes)  # newest last: evicted in the coordinator's order
        items = [prepared.items[i] for i in my_writes.tolist()]
        pipeline = make_pipeline(
            backend,
            data_file_key(generation_name(start.save_id), coord.rank),
            coord.rank,
            items,
            options.checksum_block_bytes,
            pool=options.pool,
            streams=options.streams,
            stage_all=stage_all,
            plans=prepared.local.pipelines if prepared.local is not None else None,
            writes=my_writes,
        )
        return cls(
            coord,
            backend,
            options,
            decision if isinstance(decision, SaveDecision) else None,
            start.save_id,
            pipeline,
            started,
            session,
        )

    def stage(self, select: Callable[[Chunk], bool] | None = None, last: bool = True) -> None:
        """Hand chunks to the writers (those ``select`` accepts; all when None)."""
        try:
            self.pipeline.stage(select=select, last=last)
        except BaseException as e:  # noqa: BLE001 - reported collectively by complete()
            self.pipeline.error = self.pipeline.error or e
            if last:
                self.pipeline.close_queue()

    def complete(self) -> SaveInfo:
        try:
            return self._complete()
        except BaseException:
            if self.trace is not None:
                self.trace.end(failed=True)
            raise

    def _complete(self) -> SaveInfo:
        coord, backend = self.coord, self.backend
        try:
            mine: WriterReport = run_phase(coord, "writing data", self.pipeline.finish)
            reports = coord.gather(mine)
            self.reported = True
            with trace.span("commit"):
                stats = decide(coord, "committing the checkpoint", self._commit, reports)
        except CommitUncertainError:
            raise  # the manifest may name this generation: keep it (docs/reliability.md)
        except BaseException as e:
            if self.committed:  # committed, but the other ranks could not be told (a lost group)
                e.add_note(f"the checkpoint at {backend.uri} is committed: its manifest was written first")
                raise
            if coord.is_coordinator:
                discard_generation(backend, self.generation)
            raise
        existing = self.decision.existing if self.decision is not None else None
        if existing is not None and existing.manifest is not None:
            old = existing.manifest.generation
            if old != self.generation:
                discard_generation(backend, old, why="the replaced generation")
        if coord.is_coordinator and self.options.overwrite:  # killed overwrites' generations, once old
            remove_leftovers(backend, self.generation, grace_seconds=DEFAULT_GRACE_SECONDS)
        mine_bytes = mine.file.nbytes if mine.file is not None else 0
        stages = self.trace.end(mine_bytes, uri=backend.uri, save_id=self.save_id) if self.trace is not None else {}
        info = SaveInfo(
            uri=backend.uri,
            save_id=self.save_id,
            tensors=stats["tensors"],
            fragments=stats["fragments"],
            objects=stats["objects"],
            tensor_bytes=stats["tensor_bytes"],
            bytes_written=stats["data_bytes"],
            seconds=time.perf_counter() - self.started,
            world_size=coord.world_size,
            rank=coord.rank,
            rank_bytes_written=mine_bytes,
            stages=stages,
        )
        log.info("%s", info)
        return info

    def _commit(self, reports: list[WriterReport]) -> dict[str, int]:
        """(coordinator) Catalog rows in save order, the catalog, then the manifest."""
        assert self.decision is not None
        plan = self.decision.plan
        assert plan is not None, "planned before anything is written"
        merged = merge_reports(reports, [plan.metas[d] for d in self.decision.meta_digests], plan.order)
        catalog = write_catalog(self.backend, catalog_key(self.generation), merged.catalog_bytes())
        visible = [
            r.file.path
            for r in reports
            if r.file is not None and (self.visible_ranks is None or r.rank in self.visible_ranks)
        ]
        check_generation_intact(self.backend, self.generation, [catalog.path, *visible])
        manifest = build_manifest(
            self.save_id,
            catalog,
            (),  # counts given: no rows are read
            tuple(r.file for r in reports if r.file is not None),
            self.decision.objects,
            self.coord.world_size,
            self.options,
            counts=merged.stats,
        )
        commit(self.backend, manifest, overwrite=self.options.overwrite)
        self.committed = True
        return manifest.stats


def coordinate_save(backend: Backend, hellos: list[Hello], options: SaveOptions, cache: PlanCache) -> SaveDecision:
    """(coordinator) Check the target, settle the objects, look the plan up."""
    existing = find_existing(backend)
    if existing is not None and not options.overwrite:
        raise CheckpointExistsError(
            f"a committed checkpoint already exists at {backend.uri}; pass overwrite=True to replace it"
        )
    try:
        json.dumps(options.user_metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedStateError(f"metadata must be JSON-serialisable: {e}") from None
    objects = _decide_objects([h.objects for h in hellos])
    digests = tuple(h.digest for h in hellos)
    meta_digests = tuple(h.meta_digest for h in hellos)
    key = plan_key(digests)
    plan = cache.plan(key)
    if plan is not None and not all(key in h.held for h in hellos):
        plan = None  # some rank no longer holds its writes of that plan: plan again
    replicas = tuple(h.replicas for h in hellos)
    if plan is not None:
        check_replicas(replicas, meta_digests, plan.metas)  # else in _plan, once every metadata is here
    meta_from: dict[bytes, int] = {}
    if plan is None:
        known = cache.metas()
        for rank, d in enumerate(meta_digests):
            if d not in known:
                meta_from.setdefault(d, rank)
    elif len(hellos) > 1:
        _log_plan(plan)
    start = SaveStart(new_save_id(), key, plan is not None, meta_from)
    return SaveDecision(start, objects, existing, digests, meta_digests, plan, () if plan is not None else replicas)


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
    summary = PlanSummary(
        bytes_per_rank=plan.bytes_per_rank,
        tensors=plan.tensors,
        total_bytes=plan.total_bytes,
        order=save_order(decision.meta_digests, metas),
        metas={d: metas[d] for d in dict.fromkeys(decision.meta_digests)},
    )
    cache.remember_plan(decision.start.key, summary)
    if len(layouts) > 1:
        _log_plan(summary)
    return dataclasses.replace(decision, plan=summary), plan


def _log_plan(plan: PlanSummary) -> None:
    share = ", ".join(f"{r}: {b / 2**20:.1f} MiB" for r, b in sorted(plan.bytes_per_rank.items()))
    log.info("save plan: %d tensors, %.1f MiB, bytes per rank {%s}", plan.tensors, plan.total_bytes / 2**20, share)


def build_manifest(
    save_id: str,
    catalog: FileEntry,
    fragments: pa.Table | Sequence[Fragment],
    files: tuple[FileEntry, ...],
    objects: dict[str, list[ObjectEntry]],
    world_size: int,
    options: SaveOptions,
    *,
    counts: Mapping[str, int] | None = None,
) -> Manifest:
    """The commit record of a save whose data files and catalog are written
    (``fragments``: the catalog's rows, as a table or as Fragment objects, read only
    when ``counts``, their :func:`row_stats`, is not given)."""
    if counts is None:
        counts = row_stats(fragments if isinstance(fragments, pa.Table) else fragment_table(fragments))
    return Manifest(
        save_id=save_id,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        world_size=world_size,
        catalog=catalog,
        data_files=files,
        objects=objects,
        checksum_block_bytes=options.checksum_block_bytes,
        bcp_version=__version__,
        torch_version=torch.__version__,
        user_metadata=options.user_metadata,
        stats={
            "tensors": counts["tensors"],
            "fragments": counts["fragments"],
            "tensor_bytes": counts["tensor_bytes"],
            "data_bytes": sum(f.nbytes for f in files),
            "objects": len(objects),
        },
    )
