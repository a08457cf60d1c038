"""The save's named phases, one job each; every save is a walk through them.

``bcp.save`` and ``bcp.async_save`` (``bcp.saver``), the local tier's fast save (``bcp.tiers.fast_save``) and the
drain (``bcp.tiers.drain``) compose these; none of them re-enters another's internals.

1. :func:`prepare_save` (all ranks, local): flatten the state, reuse the kept plans of an unchanged structure, lay the
   tensors out, encode the objects, sum replicas.
2. :func:`hello` (all ranks): the first message, sent to the coordinator.
3. :func:`coordinate_save` (coordinator): refuse an existing checkpoint (:func:`check_target`), settle the objects,
   look the plan up.
4. :func:`open_pipeline` (all ranks): this rank's write pipeline, writing at once or (deferred) once the save's id is
   known (:func:`start_writing`).
5. :func:`stage` (all ranks): hand chunks to the writers; a staging error is parked (:func:`park_staging_error`, the
   one place) for the writing thread to report.
6. :meth:`SaveJob.write` (all ranks, collective): wait for the writers, make the file durable, gather the fragment rows.
7. :func:`commit_generation` (coordinator): the catalog, the generation check (and an incremental save's references),
   the manifest; :func:`keep_or_discard` removes the generation of a save that failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import operator
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from bcp import objcodec, trace
from bcp._version import __version__
from bcp.backends import Backend
from bcp.commit import (
    DEFAULT_GRACE_SECONDS,
    ExistingCheckpoint,
    check_generation_intact,
    check_references_intact,
    commit,
    discard_generation,
    discard_partial,
    find_existing,
    new_save_id,
    remove_leftovers,
    write_catalog,
)
from bcp.coordination.collectives import Coordinator, gather_decide, run_phase
from bcp.errors import CheckpointExistsError, CommitUncertainError, UnsupportedStateError
from bcp.incremental import (
    BaseRef,
    Reuse,
    drop_unused_holds,
    hold_base,
    reference_entries,
    release_replaced,
    with_reuse,
)
from bcp.io_scheduler.kept_pipelines import make_pipeline
from bcp.io_scheduler.write_pipeline import WriteItem, WritePipeline
from bcp.kept_plans import PLAIN_SET, PLAIN_TENSORS, LocalPlans, Prepared, prepare_tensors
from bcp.metadata import FileEntry, Fragment, Manifest, ObjectEntry
from bcp.metadata.keys import catalog_key, data_file_key, generation_name
from bcp.options import SaveOptions
from bcp.pieces import digest_stored
from bcp.planning.cache import PlanCache, PlanSummary, plan_key
from bcp.planning.writer_rows import WriterReport, fragment_table, merge_reports, row_stats
from bcp.references import ParentFactory, parent_factory
from bcp.replicas import ReplicaSummer, ReplicaSums, check_places, check_replicas
from bcp.shards import PerRank
from bcp.state import flatten_state, path_to_json

log = logging.getLogger(__name__)

_VALUE = operator.attrgetter("value")


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


# -- 1. prepare ------------------------------------------------------------------------------


class LocalObject(NamedTuple):
    """A non-tensor leaf as one rank prepared it."""

    key_path: list
    encoded: Any
    #: wrapped in PerRank: saved per rank even when every rank has the same value
    per_rank: bool


def prepare_save(
    state: Mapping[str, Any],
    rank: int,
    allow_pickle: bool,
    *,
    check_replicas: str = "off",
    world_size: int = 1,
    plans: LocalPlans | None = None,
    piece_bytes: int | None = None,
) -> Prepared:
    """(all ranks, local) Everything this rank knows before any message (``plans``:
    where the tensors' plan of an unchanged structure is kept between saves,
    ``bcp.kept_plans``; ``piece_bytes``: an incremental save's pieces, ``bcp.pieces``)."""
    leaves = flatten_state(state)
    objects: dict[str, LocalObject] = {}
    every = leaves.values()
    for leaf in every if not set(map(type, map(_VALUE, every))) <= PLAIN_SET else ():  # none: no loop in Python
        if type(leaf.value) not in PLAIN_TENSORS and not leaf.is_tensor:
            per_rank = isinstance(leaf.value, PerRank)
            value = leaf.value.value if per_rank else leaf.value
            encoded = objcodec.encode(value, fqn=leaf.fqn, allow_pickle=allow_pickle)
            objects[leaf.fqn] = LocalObject(path_to_json(leaf.path), encoded, per_rank)
    summer = ReplicaSummer(check_replicas if world_size > 1 else "off")  # one rank has nothing to compare
    return prepare_tensors(leaves, rank, objects, summer, plans, piece_bytes)


# -- 2. hello --------------------------------------------------------------------------------


class Hello(NamedTuple):
    """What each rank sends the coordinator first, at every save: O(1) about its tensors (its layout's digests,
    and which cached plans it still holds), its objects, and the checksums of the replicated boxes it checks
    (16 bytes each). Box arrays follow only when the plan is not cached."""

    digest: bytes
    meta_digest: bytes
    held: frozenset[bytes]
    objects: dict[str, LocalObject]
    #: None when this rank checks no replica (one rank, or check_replicas="off")
    replicas: ReplicaSums | None = None


def hello(prepared: Prepared, held: Iterable[bytes]) -> Hello:
    """This rank's first message (``held``: the keys of the cached plans whose writes it holds)."""
    layout = prepared.layout
    digest = prepared.local.digest if prepared.local is not None else layout.digest()
    return Hello(digest, layout.meta_digest, frozenset(held), prepared.objects, prepared.replicas)


# -- 3. coordinate ---------------------------------------------------------------------------


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
    #: an incremental save's base, checked and held (None: refer to nothing)
    base: BaseRef | None = None


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


def check_target(
    backend: Backend, *, overwrite: bool, otherwise: str = "pass overwrite=True to replace it"
) -> ExistingCheckpoint | None:
    """(coordinator) The committed checkpoint at ``backend``, refused unless ``overwrite``."""
    existing = find_existing(backend)
    if existing is not None and not overwrite:
        raise CheckpointExistsError(f"a committed checkpoint already exists at {backend.uri}; {otherwise}")
    return existing


def decide_objects(all_objects: list[dict[str, LocalObject]]) -> dict[str, list[ObjectEntry]]:
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


def coordinate_save(
    backend: Backend,
    hellos: list[Hello],
    options: SaveOptions,
    cache: PlanCache,
    target: Any = None,
    reusable: Callable[[BaseRef], bool] | None = None,
) -> SaveDecision:
    """(coordinator) Check the target, settle the objects, look the plan up; with a ``base`` (``target``: the URI
    saved to), check and hold it (``bcp.incremental``; ``reusable``: see :func:`bcp.incremental.hold_base`)."""
    existing = check_target(backend, overwrite=options.overwrite)
    try:
        json.dumps(options.user_metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedStateError(f"metadata must be JSON-serialisable: {e}") from None
    objects = decide_objects([h.objects for h in hellos])
    digests = tuple(h.digest for h in hellos)
    meta_digests = tuple(h.meta_digest for h in hellos)
    key = plan_key(digests)
    plan = cache.plan(key)
    if plan is not None and not all(key in h.held for h in hellos):
        plan = None  # some rank no longer holds its writes of that plan: plan again
    replicas = tuple(h.replicas for h in hellos)
    if plan is not None:
        check_replicas(replicas, meta_digests, plan.metas)  # else once every metadata is here (bcp.saver's planning)
        check_places(objects, meta_digests, plan.metas, tensors_checked=True)  # each save: its objects only
    meta_from: dict[bytes, int] = {}
    if plan is None:
        known = cache.metas()
        for rank, d in enumerate(meta_digests):
            if d not in known:
                meta_from.setdefault(d, rank)
    elif len(hellos) > 1:
        log_plan(plan)
    save_id = new_save_id()
    base = None
    if options.base is not None:
        # a Backend object given as the target (the local tier's step): its URI names the checkpoint
        uri = target if isinstance(target, (str, os.PathLike)) else backend.uri
        base = hold_base(uri, options.base, save_id, options.storage_options, reusable)
    start = SaveStart(save_id, key, plan is not None, meta_from, base)
    return SaveDecision(start, objects, existing, digests, meta_digests, plan, () if plan is not None else replicas)


def log_plan(plan: PlanSummary) -> None:
    share = ", ".join(f"{r}: {b / 2**20:.1f} MiB" for r, b in sorted(plan.bytes_per_rank.items()))
    log.info("save plan: %d tensors, %.1f MiB, bytes per rank {%s}", plan.tensors, plan.total_bytes / 2**20, share)


# -- 4. open the pipeline --------------------------------------------------------------------


def open_pipeline(
    backend: Backend,
    rank: int,
    save_id: str | None,
    items: Sequence[WriteItem],
    options: SaveOptions,
    *,
    stage_all: bool,
    plans: Any = None,
    writes: np.ndarray | None = None,
) -> WritePipeline:
    """This rank's write pipeline for ``items`` into its data file of ``save_id``;
    ``save_id`` None: deferred (staged now, nothing written until :func:`start_writing`)."""
    key = data_file_key(generation_name(save_id), rank) if save_id is not None else ""
    return make_pipeline(
        backend,
        key,
        rank,
        items,
        options.checksum_block_bytes,
        pool=options.pool,
        streams=options.streams,
        stage_all=stage_all,
        deferred=save_id is None,
        plans=plans,
        writes=writes,
    )


def start_writing(pipeline: WritePipeline, save_id: str) -> None:
    """(a deferred pipeline) The save's id is known: open the data file, write what was staged."""
    pipeline.start_writing(data_file_key(generation_name(save_id), pipeline.rank))


# -- 5. stage --------------------------------------------------------------------------------


def park_staging_error(pipeline: WritePipeline, error: BaseException, last: bool) -> None:
    """Keep ``error`` (the first one wins) for the thread that finishes the pipeline
    to report; with ``last``, let the writers end. The only place a staging error is
    parked: every save reports it the same way, collectively, from the write phase."""
    pipeline.error = pipeline.error or error
    if last:
        pipeline.close_queue()


def stage(pipeline: WritePipeline, select: Callable[[Any], bool] | None = None, last: bool = True) -> None:
    """Hand chunks to the writers (those ``select`` accepts; all when None); never raises."""
    try:
        pipeline.stage(select=select, last=last)
    except BaseException as e:  # noqa: BLE001 - reported collectively by the write phase
        park_staging_error(pipeline, e, last)


# -- 6, 7. write, commit ----------------------------------------------------------------------


@contextlib.contextmanager
def keep_or_discard(
    coord: Coordinator, backend: Backend, generation: str, committed: Callable[[], bool], note: str, why: str
) -> Iterator[None]:
    """A failure in the block removes ``generation`` (the coordinator), unless the
    manifest may name it (CommitUncertainError, or read back) or it is committed and only
    telling the other ranks failed (``note`` is added to the error)."""
    try:
        yield
    except CommitUncertainError:
        raise  # the manifest may name this generation: keep it (docs/reliability.md)
    except BaseException as e:
        if committed():
            e.add_note(note)
        elif coord.is_coordinator:
            discard_partial(backend, generation, why=why)
        raise


def commit_generation(
    backend: Backend,
    generation: str,
    catalog_path: str,
    catalog_bytes: bytes,
    data_paths: Iterable[str],
    manifest_for: Callable[[FileEntry], Manifest],
    *,
    overwrite: bool,
    parent: ParentFactory | None = None,
) -> Manifest:
    """(coordinator) Write the catalog, make the manifest for it, check that the generation holds its files (and,
    with references, that the siblings' files it names are there on ``parent``), then commit the manifest."""
    catalog = write_catalog(backend, catalog_path, catalog_bytes)
    manifest = manifest_for(catalog)
    check_generation_intact(backend, generation, [catalog.path, *data_paths])
    if manifest.references and parent is not None:
        check_references_intact(parent(), manifest)
    commit(backend, manifest, overwrite=overwrite)
    return manifest


class SaveJob:
    """One planned save: its pipeline open, the coordinator's decision made.

    ``stage`` (all ranks, local) hands this rank's chunks to the writers (with a ``stage_all`` pipeline the state
    may change once it returns); ``complete`` (all ranks, collective) writes (:meth:`write`), commits
    (:meth:`commit_checkpoint`, the coordinator) and returns SaveInfo. An async save runs ``complete`` in a thread."""

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
        #: an incremental save's: every item of this rank, what it reuses, their digests
        self.reuse: tuple[list[WriteItem], Reuse, np.ndarray] | None = None
        #: called with this rank's report once the checkpoint is committed (never raises)
        self.on_commit: Callable[[WriterReport], None] | None = None

    def stage(self, select: Callable[[Any], bool] | None = None, last: bool = True) -> None:
        """Hand chunks to the writers (those ``select`` accepts; all when None)."""
        stage(self.pipeline, select, last)

    def complete(self) -> SaveInfo:
        try:
            return self._complete()
        except BaseException:
            if self.trace is not None:
                self.trace.end(failed=True)
            raise

    def write(self) -> WriterReport:
        """(all ranks, collective) Wait for the writers and make this rank's file durable
        (any rank's error raises on every rank): this rank's rows, for the commit."""
        return run_phase(self.coord, "writing data", self._finish)

    def _finish(self) -> WriterReport:
        report = self.pipeline.finish()
        if self.reuse is None:
            return report
        items, reuse, digests = self.reuse
        stream = self.pipeline.digests
        if stream is not None:  # the written rows' digests: of the bytes written
            pipeline = self.pipeline
            source = pipeline.file_layout.source
            for j, k in enumerate(reuse.changed):
                u = source[j]
                if u in stream.spilled:  # its parts came too far out of order to keep: read back
                    read = functools.partial(pipeline.backend.read_into, pipeline.data_key)
                    got = digest_stored(read, pipeline.offsets[u], pipeline.item_nbytes[u], pipeline.pool.slab_bytes)
                else:
                    got = stream.result(u)
                digests[k] = np.frombuffer(got, np.uint8)
        return with_reuse(report, items, reuse, digests)

    def _sent(self) -> None:
        """This rank's report reached the coordinator: from here it may commit."""
        self.reported = True

    def _complete(self) -> SaveInfo:
        coord, backend = self.coord, self.backend
        note = f"the checkpoint at {backend.uri} is committed: its manifest was written first"
        with keep_or_discard(coord, backend, self.generation, lambda: self.committed, note, "the partial save"):
            mine = self.write()
            with trace.span("commit"):  # every rank's rows gathered on the coordinator, which commits
                stats = gather_decide(coord, "committing the checkpoint", mine, self.commit_checkpoint, sent=self._sent)
        if self.on_commit is not None:
            self.on_commit(mine)
        existing = self.decision.existing if self.decision is not None else None
        if existing is not None and existing.manifest is not None:
            old = existing.manifest.generation
            if old != self.generation:
                discard_generation(backend, old, why="the replaced generation")
            if coord.is_coordinator and existing.manifest.references:
                release_replaced(backend.uri, existing.manifest, self.options.storage_options)
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

    def commit_checkpoint(self, reports: list[WriterReport]) -> dict[str, int]:
        """(coordinator) Catalog rows in save order, the catalog, then the manifest."""
        decision = self.decision
        assert decision is not None
        plan = decision.plan
        assert plan is not None, "planned before anything is written"
        merged = merge_reports(reports, [plan.metas[d] for d in decision.meta_digests], plan.order)
        visible = [
            r.file.path
            for r in reports
            if r.file is not None and (self.visible_ranks is None or r.rank in self.visible_ranks)
        ]

        references = reference_entries([f for r in reports for f in r.references], merged.rows, merged.file_names)
        base = decision.start.base if self.visible_ranks is None else None  # its parent: where references are checked

        def manifest_for(catalog: FileEntry) -> Manifest:
            files = tuple(r.file for r in reports if r.file is not None) + tuple(references)
            return build_manifest(
                self.save_id,
                catalog,
                (),
                files,
                decision.objects,
                self.coord.world_size,
                self.options,
                counts=merged.stats,
            )  # counts given: no rows are read

        key = catalog_key(self.generation)
        manifest = commit_generation(
            self.backend,
            self.generation,
            key,
            merged.catalog_bytes(),
            visible,
            manifest_for,
            overwrite=self.options.overwrite,
            parent=parent_factory(base.uri, self.options.storage_options) if references and base else None,
        )
        self.committed = True
        if decision.start.base is not None:
            drop_unused_holds(
                self.backend.uri, decision.start.base, self.save_id, manifest, self.options.storage_options
            )
        return manifest.stats


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
            "data_bytes": sum(f.nbytes for f in files if f.checkpoint is None),  # references not counted
            "objects": len(objects),
        },
    )
