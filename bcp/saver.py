"""The save path (all ranks call ``save``; one process is a world of one).

1. (all ranks) flatten the state, find each tensor's local boxes, encode objects.
2. (coordinator) gather local plans, refuse an existing checkpoint, validate that
   shards tile every tensor, deduplicate replicas and balance bytes over ranks.
3. (all ranks) write the assigned boxes into one data file per rank, checksummed.
4. (coordinator) gather fragment rows, write fragments.arrow, then commit
   manifest.json; any rank's failure in any phase means no commit and an error on
   every rank.

Commit protocol (FORMAT.md, "Commit"): every object of a save lives under a fresh
generation prefix ``gen-<id>/``; ``manifest.json`` is written last, create-only
unless ``overwrite=True`` (then an atomic replace). A save that fails or is killed
leaves at most an unreferenced generation behind and never touches the previous one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from bcp.backends import Backend, ObjectExistsError
from bcp.metadata import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_KEY,
    Catalog,
    FileEntry,
    Fragment,
    Manifest,
    ObjectEntry,
    crc32c,
)
from bcp.target import resolve_backend

from . import objcodec
from ._version import __version__
from .boxes import Box
from .collectives import Coordinator, coordinator_for, run_phase, share_result
from .torch_dtypes import dtype_name
from .errors import CheckpointExistsError, UnsupportedStateError
from .save_plan import GlobalPlan, LocalPlan, TensorPlan, plan_save
from .shards import PerRank, Piece, local_pieces
from .io_scheduler.staging import StagingPool, default_pool
from .state import flatten_state, path_to_json, path_to_str
from .tensor_io import check_saveable, storage_identity
from .io_scheduler.write_pipeline import WritePipeline

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


@dataclasses.dataclass
class _Prepared:
    """Step 1's result on one rank."""

    plan: LocalPlan
    pieces: dict[tuple[str, Box], tuple[TensorPlan, Piece]]
    #: fqn -> (key path JSON, encoded value, saved per rank?)
    objects: dict[str, tuple[list, Any, bool]]


def _prepare(state: Mapping[str, Any], rank: int, allow_pickle: bool) -> _Prepared:
    leaves = flatten_state(state)
    tensors: list[TensorPlan] = []
    pieces: dict[tuple[str, Box], tuple[TensorPlan, Piece]] = {}
    objects: dict[str, tuple[list, Any, bool]] = {}
    first_fqn_of: dict[tuple, str] = {}
    for leaf in leaves.values():
        if not leaf.is_tensor:
            per_rank = isinstance(leaf.value, PerRank)
            value = leaf.value.value if per_rank else leaf.value
            encoded = objcodec.encode(value, fqn=leaf.fqn, allow_pickle=allow_pickle)
            objects[leaf.fqn] = (path_to_json(leaf.path), encoded, per_rank)
            continue
        shape, dtype, local, _replicated = local_pieces(leaf.value, leaf.fqn)
        for piece in local:
            check_saveable(piece.tensor, leaf.fqn)
        ident = tuple(storage_identity(p.tensor) for p in local)
        alias = first_fqn_of.setdefault(ident, leaf.fqn)
        tensor_plan = TensorPlan(
            fqn=leaf.fqn,
            key_path=path_to_str(leaf.path),
            dtype=dtype_name(dtype, fqn=leaf.fqn),
            global_shape=tuple(shape),
            boxes=tuple(p.box for p in local),
            alias_of=None if alias == leaf.fqn else alias,
        )
        tensors.append(tensor_plan)
        for piece in local:
            pieces[(leaf.fqn, piece.box)] = (tensor_plan, piece)
    return _Prepared(LocalPlan(rank, tuple(tensors)), pieces, objects)


def _decide_objects(all_objects: list[dict[str, tuple[list, Any, bool]]]) -> dict[str, list[ObjectEntry]]:
    """One job-wide entry when every rank saved the same value; else one per rank."""
    out: dict[str, list[ObjectEntry]] = {}
    order: list[str] = []
    for objs in all_objects:
        order += [f for f in objs if f not in order]
    for fqn in order:
        holders = [(r, objs[fqn]) for r, objs in enumerate(all_objects) if fqn in objs]
        encodings = {json.dumps(enc, sort_keys=True) for _r, (_p, enc, _pr) in holders}
        per_rank = any(pr for _r, (_p, _e, pr) in holders) or len(encodings) > 1 or len(holders) < len(all_objects)
        if per_rank and len(all_objects) > 1:
            out[fqn] = [ObjectEntry(path, enc, r) for r, (path, enc, _pr) in holders]
        else:
            path, enc, _pr = holders[0][1]
            out[fqn] = [ObjectEntry(path, enc, None)]
    return out


def save(
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
) -> SaveInfo:
    """Save ``state`` (a nested dict of tensors, shards and plain objects) to ``uri``.

    Collective when torch.distributed is initialised: every rank of ``process_group``
    (default: the whole job) calls it with its own local state. Refuses
    (CheckpointExistsError) when a committed checkpoint is already there, unless
    ``overwrite=True``; an overwrite replaces it atomically. ``metadata`` is stored as
    user metadata (JSON). ``allow_pickle`` lets objects without a safe encoding be
    pickled; loading them then needs ``allow_pickle=True`` too. ``streams``: concurrent
    writes per rank (default: the backend's hint); ``pool``: staging memory (default:
    the process-wide pool, whose capacity is the memory budget).
    """
    job = SaveJob.start(
        state, uri, coordinator_for(process_group), overwrite=overwrite, metadata=metadata, allow_pickle=allow_pickle,
        storage_options=storage_options, block=checksum_block_bytes, streams=streams, pool=pool, stage_all=False,
    )
    job.stage()
    return job.complete()


class SaveJob:
    """One save, in the steps a synchronous and an asynchronous save share.

    1. ``start`` (all ranks, collective): prepare, plan, agree on the generation.
    2. ``stage`` (all ranks, local): hand this rank's chunks to the write pipeline;
       with ``stage_all`` the state may change once it returns.
    3. ``complete`` (all ranks, collective): finish writing, gather fragment rows,
       commit (coordinator), return SaveInfo. An async save runs it in a thread.
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.error: BaseException | None = None

    @classmethod
    def start(
        cls, state, uri, coord: Coordinator, *, overwrite, metadata, allow_pickle, storage_options, block, streams,
        pool, stage_all,
    ) -> SaveJob:
        self = cls()
        self.coord, self.overwrite, self.block = coord, overwrite, block
        self.backend = resolve_backend(uri, storage_options)
        self.user_metadata = dict(metadata or {})
        prepared: _Prepared = run_phase(coord, "preparing the save", _prepare, state, coord.rank, allow_pickle)
        self.gathered = coord.gather((prepared.plan, prepared.objects))
        decision: Any = None
        if coord.is_coordinator:
            try:
                decision = _coordinate(self.backend, self.gathered, overwrite, self.user_metadata)
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
                decision = e
        shared = decision if not isinstance(decision, tuple) else decision[1]  # an exception, the save id, or None
        self.save_id = share_result(coord, shared, "planning the save")
        plan, _id, self.objects, self.old = decision if coord.is_coordinator else (None, self.save_id, {}, None)
        # each rank receives only its own list of boxes to write
        my_writes = coord.scatter([plan.writes[r] for r in range(coord.world_size)] if coord.is_coordinator else None)
        self.generation = f"gen-{self.save_id}"
        self.data_key = f"{self.generation}/data/rank{coord.rank:05d}-0.bin"
        items = [prepared.pieces[w] for w in my_writes]  # (TensorPlan, Piece) pairs
        self.pipeline = make_pipeline(
            self.backend, self.data_key, coord.rank, items, block, pool=pool, streams=streams, stage_all=stage_all
        )
        return self

    def stage(self, select=None, last: bool = True) -> None:
        """Hand chunks to the writers (those ``select`` accepts; all when None)."""
        try:
            self.pipeline.stage(select=select, last=last)
        except BaseException as e:  # noqa: BLE001 - reported collectively by complete()
            self.pipeline.error = self.pipeline.error or e
            if last:
                self.pipeline.close_queue()

    def complete(self) -> SaveInfo:
        coord, backend = self.coord, self.backend
        try:
            fragments, file_entry = run_phase(coord, "writing data", self.pipeline.finish)
            reports = coord.gather((fragments, file_entry))
            outcome: Any = None
            if coord.is_coordinator:
                try:
                    order: dict[str, int] = {}
                    for local_plan, _objs in self.gathered:
                        for t in local_plan.tensors:
                            order.setdefault(t.fqn, len(order))
                    all_fragments = sorted(
                        (f for frags, _e in reports for f in frags), key=lambda f: (order[f.fqn], f.offsets, f.writer_rank)
                    )
                    files = tuple(e for _f, e in reports if e is not None)
                    manifest = _commit(
                        backend, self.save_id, f"{self.generation}/fragments.arrow", all_fragments, files, self.objects,
                        coord.world_size, self.user_metadata, self.block, self.overwrite,
                    )
                    outcome = manifest.stats
                except Exception as e:  # noqa: BLE001
                    outcome = e
            stats = share_result(coord, outcome, "committing the checkpoint")
        except BaseException:
            if coord.is_coordinator:
                _discard(backend, self.generation)
            raise

        if coord.is_coordinator and isinstance(self.old, Manifest) and self.old.generation != self.generation:
            try:
                backend.delete_prefix(self.old.generation + "/")
            except Exception as e:  # noqa: BLE001 - the new checkpoint is committed; leftovers are only space
                log.warning("could not delete the replaced generation %s at %s: %s", self.old.generation, backend.uri, e)

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
            rank_bytes_written=file_entry.nbytes if file_entry is not None else 0,
        )
        log.info("%s", info)
        return info


def make_pipeline(backend, data_key, rank, items, block, *, pool=None, streams=None, stage_all=False) -> WritePipeline:
    pool = pool or default_pool()
    if pool.slab_bytes % block:
        raise ValueError(f"staging slab size {pool.slab_bytes} must be a multiple of the checksum block {block}")
    return WritePipeline(
        backend, data_key, rank, items, block=block, pool=pool, streams=streams or backend.hints.concurrency,
        stage_all=stage_all,
    )


def read_manifest_if_any(backend: Backend) -> Manifest | None | bool:
    """The committed manifest; None when there is none; False when one exists but is unreadable."""
    if not backend.exists(MANIFEST_KEY):
        return None
    try:
        return Manifest.from_json(backend.read(MANIFEST_KEY), where=f"{backend.uri}/{MANIFEST_KEY}")
    except Exception as e:  # noqa: BLE001 - an unreadable old manifest still blocks a non-overwrite save
        log.warning("existing manifest at %s is unreadable: %s", backend.uri, e)
        return False


def _coordinate(backend: Backend, gathered: list, overwrite: bool, user_metadata: dict) -> tuple:
    """(coordinator) Check the target, plan the writes, settle the objects."""
    old = read_manifest_if_any(backend)
    if old is not None and not overwrite:
        raise CheckpointExistsError(f"a committed checkpoint already exists at {backend.uri}; pass overwrite=True to replace it")
    try:
        json.dumps(user_metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedStateError(f"metadata must be JSON-serialisable: {e}") from None
    plans = [p for p, _objs in gathered]
    plan: GlobalPlan = plan_save(plans)
    objects = _decide_objects([objs for _p, objs in gathered])
    if len(plans) > 1:
        share = ", ".join(f"{r}: {b / 2**20:.1f} MiB" for r, b in sorted(plan.bytes_per_rank.items()))
        log.info("save plan: %d tensors, %.1f MiB, bytes per rank {%s}", plan.tensors, plan.total_bytes / 2**20, share)
    return plan, uuid.uuid4().hex[:16], objects, old


def _write_rank_data(
    backend: Backend, data_key: str, rank: int, items: list[tuple[TensorPlan, Piece]], block: int
) -> tuple[list[Fragment], FileEntry | None]:
    """Write this rank's assigned boxes into one data file (synchronously)."""
    pipeline = make_pipeline(backend, data_key, rank, items, block)
    try:
        pipeline.stage()
    except BaseException as e:
        pipeline.error = pipeline.error or e
        pipeline.close_queue()
    return pipeline.finish()


def _commit(
    backend: Backend,
    save_id: str,
    catalog_key: str,
    fragments: list[Fragment],
    files: tuple[FileEntry, ...],
    objects: dict[str, list[ObjectEntry]],
    world_size: int,
    user_metadata: dict,
    block: int,
    overwrite: bool,
) -> Manifest:
    """(coordinator) Write the catalog, then the manifest: the commit."""
    catalog_bytes = Catalog(fragments).to_arrow()
    backend.write(catalog_key, catalog_bytes)
    unique = {(f.file, f.byte_offset, f.offsets, f.lengths) for f in fragments}
    logical = {(f.fqn, f.offsets, f.lengths): f.nbytes for f in fragments}
    manifest = Manifest(
        save_id=save_id,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        world_size=world_size,
        catalog=FileEntry(catalog_key, len(catalog_bytes), crc32c(catalog_bytes)),
        data_files=files,
        objects=objects,
        checksum_block_bytes=block,
        bcp_version=__version__,
        torch_version=torch.__version__,
        user_metadata=user_metadata,
        stats={
            "tensors": len({f.fqn for f in fragments}),
            "fragments": len(unique),
            "tensor_bytes": sum(logical.values()),
            "data_bytes": sum(f.nbytes for f in files),
            "objects": len(objects),
        },
    )
    data = manifest.to_json()
    if overwrite:
        backend.write(MANIFEST_KEY, data)
    else:
        try:
            backend.write_if_absent(MANIFEST_KEY, data)
        except ObjectExistsError as e:
            raise CheckpointExistsError(
                f"another save committed a checkpoint at {backend.uri} while this one was writing; this save was discarded"
            ) from e
    return manifest


def _discard(backend: Backend, generation: str) -> None:
    try:
        backend.delete_prefix(generation + "/")
    except Exception as e:  # noqa: BLE001 - the original error matters more
        log.warning("could not remove the partial save %s at %s: %s", generation, backend.uri, e)
