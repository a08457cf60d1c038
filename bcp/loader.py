"""The load path (all ranks call ``load``; one process is a world of one).

1. (coordinator) read manifest.json and fragments.arrow once; every rank gets the bytes.
2. (all ranks) match the template: each tensor-like leaf gives the boxes this rank
   holds (plain tensor: all of it; DTensor, TensorShard, FlatShard: their shards),
   whatever layout saved the checkpoint. Mismatches are collected into one error.
3. (all ranks) read only the byte runs that overlap those boxes, straight into the
   destination memory where its layout allows, and verify their checksums.
4. (all ranks) objects: job-wide ones are replaced; per-rank ones go to the same rank
   when the world size is unchanged, else through the caller's ``reshard_objects``.
5. (all ranks) agree that every rank succeeded.

A template object that is a container where the checkpoint holds a subtree (an
optimizer's empty ``state`` before its first step) is replaced by that subtree,
tensors allocated on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bcp.backends import Capability
from bcp.target import resolve_backend

from .collectives import Coordinator, coordinator_for, run_phase, share_result
from .torch_dtypes import dtype_name
from .errors import StateMismatchError, UnsupportedStateError
from .io_scheduler.read_exec import ReadStats
from .reader import CheckpointReader, fetch_metadata, reader_from_bytes
from .shards import local_pieces
from .state import KeyPath, Leaf, build_nested, flatten_state, replace_at

log = logging.getLogger(__name__)

#: ``reshard_objects(fqn, values_by_saved_rank, rank, world_size) -> value for this rank``
ReshardObjects = Callable[[str, dict[int, Any], int, int], Any]


def _keys(path: KeyPath) -> tuple:
    return tuple(k for _kind, k in path)


def load(
    state: Mapping[str, Any],
    uri: str,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    reshard_objects: ReshardObjects | None = None,
    verify: bool = True,
    share_reads: bool | None = None,
) -> Mapping[str, Any]:
    """Fill ``state`` from the checkpoint at ``uri`` and return it.

    Collective when torch.distributed is initialised. The checkpoint may have been
    saved by any number of ranks in any layout. strict=True: any missing key,
    unexpected key, shape or dtype mismatch raises one StateMismatchError listing
    them all, before anything is read. strict=False: keys on one side only are
    skipped, dtypes are cast; shapes must still match. Objects saved per rank at a
    different world size are handed to ``reshard_objects`` (see docs/distributed.md).
    ``share_reads``: read a fragment several ranks need once and send it to the
    others (zero-redundant load); default on for object stores, off for POSIX
    filesystems, where measurements favour every rank reading (docs/distributed.md).
    """
    coord = coordinator_for(process_group)
    backend = resolve_backend(uri, storage_options)
    fetched: Any = None
    if coord.is_coordinator:
        try:
            fetched = fetch_metadata(backend)
        except Exception as e:  # noqa: BLE001 - shared with every rank, raised there
            fetched = e
    manifest_bytes, catalog_bytes = share_result(coord, fetched, "reading the checkpoint metadata")
    reader = reader_from_bytes(backend, manifest_bytes, catalog_bytes, allow_pickle=allow_pickle, verify=verify)
    try:
        plan = run_phase(coord, "matching the state", _match, reader, state, strict, coord, reshard_objects)
        if share_reads is None:
            share_reads = not (backend.capabilities & Capability.POSIX)
        stats = run_phase(coord, "reading tensors", _read, reader, plan, coord, share_reads)
        state = run_phase(coord, "placing objects", _place_objects, reader, state, plan, coord, reshard_objects)
    finally:
        reader.close()
    log.info("loaded %s: %d bytes in %d reads (+%d to verify)", reader.uri, stats.bytes_read, stats.requests, stats.verify_bytes)
    last_load_stats.update(bytes_read=stats.bytes_read, requests=stats.requests, verify_bytes=stats.verify_bytes)
    return state


#: This process's storage traffic during its last ``load`` (bytes_read, requests,
#: verify_bytes): for benchmarks and tests.
last_load_stats: dict[str, int] = {}


class _Plan:
    def __init__(self) -> None:
        self.tensor_requests: list[tuple[str, tuple, Any]] = []
        self.object_loads: list[Leaf] = []
        self.subtree_loads: list[tuple[Leaf, list[str]]] = []
        #: tensors allocated for subtree loads, filled with the other requests
        self.subtree_tensors: dict[str, Any] = {}


def _match(
    reader: CheckpointReader, state: Mapping[str, Any], strict: bool, coord: Coordinator, hook: ReshardObjects | None
) -> _Plan:
    leaves = flatten_state(state)
    stored_tensors = reader.catalog.tensors
    stored_objects = reader.manifest.objects
    stored_paths: dict[str, tuple] = {}  # built only if a template object needs the subtree rule:
    # it touches every catalog entry, which a lazy catalog otherwise never materialises
    plan = _Plan()
    consumed: set[str] = set()
    missing: list[str] = []
    shape_mm: list[tuple] = []
    dtype_mm: list[tuple] = []
    kind_mm: list[tuple] = []

    for leaf in leaves.values():
        fqn = leaf.fqn
        if leaf.is_tensor:
            if fqn in stored_tensors:
                consumed.add(fqn)
                entry = stored_tensors[fqn]
                shape, dtype, pieces, _replicated = local_pieces(leaf.value, fqn)
                if tuple(shape) != entry.global_shape:
                    shape_mm.append((fqn, tuple(shape), entry.global_shape))
                    continue
                if dtype_name(dtype, fqn=fqn) != entry.dtype:
                    dtype_mm.append((fqn, dtype_name(dtype, fqn=fqn), entry.dtype))
                plan.tensor_requests += [(fqn, p.box, p.tensor) for p in pieces]
            elif fqn in stored_objects:
                consumed.add(fqn)
                kind_mm.append((fqn, "a tensor", "an object"))
            else:
                missing.append(fqn)
            continue
        if fqn in stored_objects:
            consumed.add(fqn)
            plan.object_loads.append(leaf)
        elif fqn in stored_tensors:
            consumed.add(fqn)
            kind_mm.append((fqn, "an object", "a tensor"))
        else:
            below: list[str] = []
            if isinstance(leaf.value, (Mapping, list, tuple)):
                prefix = _keys(leaf.path)
                if not stored_paths:
                    stored_paths.update((f, _keys(reader.key_path(f))) for f in reader.keys())
                below = [f for f, p in stored_paths.items() if len(p) > len(prefix) and p[: len(prefix)] == prefix]
            if below:
                consumed.update(below)
                plan.subtree_loads.append((leaf, below))
                for f in below:
                    if f in stored_tensors:
                        meta = reader.meta(f)
                        plan.subtree_tensors[f] = torch.empty(meta.shape, dtype=meta.dtype)
                        plan.tensor_requests.append((f, ((0,) * len(meta.shape), tuple(meta.shape)), plan.subtree_tensors[f]))
            else:
                missing.append(fqn)
    unexpected = [f for f in reader.keys() if f not in consumed]

    if strict and (missing or unexpected or shape_mm or dtype_mm or kind_mm):
        raise StateMismatchError(
            reader.uri, missing=missing, unexpected=unexpected,
            shape_mismatch=shape_mm, dtype_mismatch=dtype_mm, kind_mismatch=kind_mm,
        )
    if shape_mm:
        raise StateMismatchError(reader.uri, missing=[], unexpected=[], shape_mismatch=shape_mm, dtype_mismatch=[], kind_mismatch=[])
    if missing or unexpected or dtype_mm or kind_mm:
        log.info(
            "non-strict load from %s: %d missing, %d unexpected, %d cast, %d kind mismatches skipped",
            reader.uri, len(missing), len(unexpected), len(dtype_mm), len(kind_mm),
        )
    resized = reader.manifest.world_size != coord.world_size
    per_rank = [leaf.fqn for leaf in plan.object_loads if reader.is_per_rank(leaf.fqn)]
    if per_rank and resized and hook is None:
        raise UnsupportedStateError(
            f"{reader.uri} was saved by {reader.manifest.world_size} ranks and is loaded by {coord.world_size}; "
            f"these objects were saved per rank and need a reshard_objects hook to decide what each rank gets: "
            f"{', '.join(per_rank)} (see docs/distributed.md)"
        )
    return plan


def _read(reader: CheckpointReader, plan: _Plan, coord: Coordinator, share_reads: bool) -> ReadStats:
    if not share_reads or coord.world_size == 1:
        return reader.fill(plan.tensor_requests, prefer_rank=coord.rank)
    from .io_scheduler.shared_read import fetch_shared

    held, stats = fetch_shared(reader, coord, [(fqn, box) for fqn, box, _t in plan.tensor_requests])
    stats.add(reader.fill(plan.tensor_requests, prefer_rank=coord.rank, in_memory=held))
    return stats


def _place_objects(
    reader: CheckpointReader, state: Mapping[str, Any], plan: _Plan, coord: Coordinator, hook: ReshardObjects | None
) -> Mapping[str, Any]:
    resized = reader.manifest.world_size != coord.world_size
    for leaf in plan.object_loads:
        if not reader.is_per_rank(leaf.fqn):
            value = reader.read_object(leaf.fqn)
        elif not resized:
            value = reader.read_object(leaf.fqn, rank=coord.rank)
        else:
            value = hook(leaf.fqn, reader.per_rank_objects(leaf.fqn), coord.rank, coord.world_size)
        state = replace_at(state, leaf.path, value)
    for leaf, below in plan.subtree_loads:
        depth = len(leaf.path)
        values = ((f, plan.subtree_tensors[f] if f in plan.subtree_tensors else reader.read_object(f)) for f in below)
        subtree = build_nested((reader.key_path(f)[depth:], v) for f, v in values)
        state = replace_at(state, leaf.path, subtree)
    return state
