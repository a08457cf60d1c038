"""The load path (all ranks call ``load``; one process is a world of one).

1. (coordinator) read manifest.json and fragments.arrow once; every rank gets the bytes. A large
   catalog (v2, over ``reader.WHOLE_CATALOG_BYTES``) is not shared whole: the coordinator reads its
   head and every rank reads only the sections its boxes need (``reader.fetch_metadata``).
2. (all ranks) match the template: each tensor-like leaf gives the boxes this rank
   holds (plain tensor: all of it; DTensor, TensorShard, FlatShard: their shards),
   whatever layout saved the checkpoint. Mismatches are collected into one error.
3. (all ranks) read only the byte runs that overlap those boxes, straight into the
   destination memory where its layout allows, and verify their checksums.
4. (all ranks) objects: job-wide ones are replaced; per-rank ones go to the same rank when the
   world size is unchanged, else through the caller's ``reshard_objects`` (inside a subtree too).
   Members of a template object DCP never records (:func:`keep_unrecorded`) are kept.
5. (all ranks) agree that every rank succeeded.

Every phase ends in a round that agrees whether every rank succeeded (the Stateful objects'
``state_dict`` and the reader's opening share one), so an error is raised on every rank or none.

A template object that is a container where the checkpoint holds a subtree (an
optimizer's empty ``state`` before its first step) is replaced by that subtree,
tensors allocated on CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any, NamedTuple, Unpack

import torch

from bcp import trace
from bcp.backends import Backend, Capability
from bcp.coordination.collectives import Coordinator, GroupCoordinator, decide, run_phase
from bcp.coordination.lanes import coordinator_for
from bcp.errors import StateMismatchError, UnsupportedStateError, listed, prefix_hint
from bcp.gc_pause import gc_paused
from bcp.io_scheduler.read_exec import ReadStats
from bcp.metadata.geometry import Box
from bcp.metadata.ties import first_of_each
from bcp.options import LoadOptions, LoadOptionsKwargs, ReshardObjects
from bcp.reader import CheckpointMetadata, CheckpointReader, fetch_metadata, open_reader
from bcp.references import ParentFactory, parent_factory
from bcp.shards import PerRank, any_dtensor, local_pieces
from bcp.state import KeyPath, Leaf, build_nested, detach_stateful, fit_templates, flatten_state, get_at, replace_at
from bcp.target import Target, resolve_backend
from bcp.torch_dtypes import dtype_name

log = logging.getLogger(__name__)


def _keys(path: KeyPath) -> tuple:
    return tuple(k for _kind, k in path)


@dataclasses.dataclass(frozen=True)
class LoadInfo:
    """What a load did on this rank: the loaded state, its storage traffic and what
    a non-strict load skipped."""

    uri: str
    #: the state, filled (containers replaced by stored subtrees where that rule applied)
    state: Mapping[str, Any]
    bytes_read: int
    requests: int
    #: bytes read only to verify checksum blocks that a partial read touched
    verify_bytes: int
    seconds: float
    #: keys of the state that the checkpoint does not hold (strict=False skipped them)
    missing: tuple[str, ...] = ()
    #: stored keys the state does not ask for
    unexpected: tuple[str, ...] = ()
    #: tensors whose dtype differs (cast while loading)
    cast: tuple[str, ...] = ()
    #: keys where one side holds a tensor and the other an object (strict=False skipped them)
    kind_mismatch: tuple[str, ...] = ()
    #: a suggested fix when the missing keys are stored under another prefix (``module.``, ``_orig_mod.``)
    hint: str | None = None
    #: this rank's stages (seconds active, bytes) when traced (``trace=``), else empty
    stages: Mapping[str, trace.StageTotal] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def skipped(self) -> bool:
        """Whether a non-strict load left anything out or cast anything."""
        return bool(self.missing or self.unexpected or self.cast or self.kind_mismatch)

    def __repr__(self) -> str:
        """Counts and key names, never tensor data (a state can hold gigabytes)."""
        keys = list(flatten_state(self.state))
        fields = [
            f"uri={self.uri!r}",
            f"state=<{len(keys)} leaves: {listed(keys)}>",
            f"bytes_read={self.bytes_read}",
            f"requests={self.requests}",
            f"verify_bytes={self.verify_bytes}",
            f"seconds={self.seconds:.3f}",
        ]
        for name in ("missing", "unexpected", "cast", "kind_mismatch"):
            values = getattr(self, name)
            if values:
                fields.append(f"{name}=<{len(values)}: {listed(values)}>")
        if self.hint:
            fields.append(f"hint={self.hint!r}")
        return f"LoadInfo({', '.join(fields)})"


def _fetch_for_load(backend: Backend) -> CheckpointMetadata:
    """(coordinator) The metadata every rank gets: a large catalog's head only."""
    return fetch_metadata(backend, allow_head_only=True)


def load(
    state: Mapping[str, Any], uri: Target, options: LoadOptions | None = None, **overrides: Unpack[LoadOptionsKwargs]
) -> Mapping[str, Any]:
    """Fill ``state`` from the checkpoint at ``uri`` and return it.

    Collective when torch.distributed is initialised. The checkpoint may have been saved by
    any number of ranks in any layout. ``options`` and keyword arguments are the fields of
    :class:`LoadOptions`; :func:`load_with_info` also returns what the load read and skipped.
    """
    return load_with_info(state, uri, options, **overrides).state


@gc_paused
def load_with_info(
    state: Mapping[str, Any], uri: Target, options: LoadOptions | None = None, **overrides: Unpack[LoadOptionsKwargs]
) -> LoadInfo:
    """``bcp.load``, returning a :class:`LoadInfo` (the state is its ``state``)."""
    opts = LoadOptions.of(options, overrides)
    started = time.perf_counter()
    coord = coordinator_for(opts.process_group, "bcp.load")
    session = trace.begin(opts.trace, coord.rank, "load")
    try:
        return _load(state, uri, opts, coord, session, started, None)
    except BaseException:
        if session is not None:
            session.end(failed=True)
        raise


@gc_paused
def load_with_metadata(
    state: Mapping[str, Any],
    uri: Target,
    metadata: CheckpointMetadata,
    options: LoadOptions | None = None,
    *,
    parent: ParentFactory | None = None,
) -> LoadInfo:
    """(all ranks) :func:`load_with_info` of the checkpoint at ``uri`` whose manifest and
    catalog bytes every rank already holds (``metadata``, checked where they were read:
    the local tier's recovery broadcast them, :func:`bcp.tiers.recover`), so that no
    rank reads or broadcasts them again. They are decoded and checked against each
    other and the data files here as :func:`~bcp.reader.open_reader` always does; every
    byte read from ``uri`` is verified as in any load. ``parent``: where an incremental
    checkpoint's references are read (default: ``uri``'s parent; the local tier's
    recovery passes its own when ``uri`` is a Backend object)."""
    opts = options or LoadOptions()
    started = time.perf_counter()
    coord = coordinator_for(opts.process_group, "bcp.load")
    session = trace.begin(opts.trace, coord.rank, "load")
    try:
        return _load(state, uri, opts, coord, session, started, metadata, parent)
    except BaseException:
        if session is not None:
            session.end(failed=True)
        raise


def _load(
    state: Mapping[str, Any],
    uri: Target,
    opts: LoadOptions,
    coord: Coordinator,
    session: trace.Session | None,
    started: float,
    metadata: CheckpointMetadata | None,
    parent: ParentFactory | None = None,
) -> LoadInfo:
    """The load; ``metadata``: the manifest and catalog every rank holds already (not read again)."""
    reshard_objects, share_reads = opts.reshard_objects, opts.share_reads
    backend = resolve_backend(uri, opts.storage_options)
    if metadata is None:
        with trace.span("catalog"):
            metadata = decide(coord, "reading the checkpoint metadata", _fetch_for_load, backend)
    if parent is None:  # an incremental checkpoint reads its siblings' files
        parent = parent_factory(uri, opts.storage_options)
    # one round agrees on both: the Stateful objects' state_dict() and the reader (whose
    # backend may differ by host: the local tier's recovery), so every later error is
    # raised on every rank (the recovery needs no round of its own to learn that)
    state, stateful, reader = _open(coord, state, backend, metadata, opts, parent)
    if session is not None:
        session.label = reader.manifest.save_id
    try:
        with trace.span("plan"):
            plan = run_phase(
                coord, "matching the state", match_state, reader, state, opts.strict, coord.world_size, reshard_objects
            )
            if metadata.head_only:
                run_phase(coord, "reading the catalog", _require, reader, plan)
        if share_reads is None:
            share_reads = not (backend.capabilities & Capability.POSIX)
        with trace.span("read") as reading:
            stats = run_phase(coord, "reading tensors", _read, reader, plan, coord, share_reads)
            if reading is not None:
                reading.nbytes = stats.bytes_read
        with trace.span("objects"):
            state = run_phase(coord, "placing objects", _place_objects, reader, state, plan, coord, reshard_objects)
            state = run_phase(coord, "calling load_state_dict", _load_stateful, state, stateful)
    finally:
        reader.close()
    log.info(
        "loaded %s: %d bytes in %d reads (+%d to verify)",
        reader.uri,
        stats.bytes_read,
        stats.requests,
        stats.verify_bytes,
    )
    stages = session.end(stats.bytes_read, uri=reader.uri, save_id=reader.manifest.save_id) if session else {}
    return LoadInfo(
        uri=reader.uri,
        state=state,
        bytes_read=stats.bytes_read,
        requests=stats.requests,
        verify_bytes=stats.verify_bytes,
        seconds=time.perf_counter() - started,
        missing=tuple(plan.missing),
        unexpected=tuple(plan.unexpected),
        cast=tuple(f for f, _w, _g in plan.dtype_mismatch),
        kind_mismatch=tuple(f for f, _w, _g in plan.kind_mismatch),
        hint=plan.hint,
        stages=stages,
    )


def _open(
    coord: Coordinator,
    state: Mapping[str, Any],
    backend: Backend,
    metadata: CheckpointMetadata,
    opts: LoadOptions,
    parent: ParentFactory | None,
) -> tuple[Mapping[str, Any], list[tuple[KeyPath, Any]], CheckpointReader]:
    """(all ranks, one round) The template with its Stateful objects' state_dicts in
    place, and the reader over ``metadata``; raises on every rank if either failed on any
    (a reader opened here is closed then)."""
    opened: tuple[Mapping[str, Any], list[tuple[KeyPath, Any]], CheckpointReader] | None = None
    error: BaseException | None = None
    try:
        detached, stateful = detach_stateful(state)
        reader = open_reader(backend, metadata, allow_pickle=opts.allow_pickle, verify=opts.verify, parent=parent)
        opened = (fit_templates(detached, stateful, reader.catalog.tensors, reader.manifest.objects), stateful, reader)
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        error = e
    try:
        coord.check(error, "asking Stateful objects for their state_dict and opening the checkpoint")
    except BaseException:
        if opened is not None:
            opened[2].close()
        raise
    assert opened is not None  # no rank failed
    return opened


def _load_stateful(state: Mapping[str, Any], stateful: list[tuple[KeyPath, Any]]) -> Mapping[str, Any]:
    """Hand each Stateful object what was loaded for it and put it back in the state."""
    for path, obj in stateful:
        obj.load_state_dict(get_at(state, path))
        state = replace_at(state, path, obj)
    return state


class TensorRequest(NamedTuple):
    """Fill ``dest`` with box ``box`` of the stored tensor ``fqn``."""

    fqn: str
    box: Box
    dest: torch.Tensor


class SubtreeLoad(NamedTuple):
    """A template container replaced by the stored subtree under its path."""

    leaf: Leaf
    #: the stored entries below it
    fqns: tuple[str, ...]


@dataclasses.dataclass
class LoadPlan:
    """What one rank loads, decided before any byte is read, and what did not match."""

    tensor_requests: list[TensorRequest] = dataclasses.field(default_factory=list)
    object_loads: list[Leaf] = dataclasses.field(default_factory=list)
    subtree_loads: list[SubtreeLoad] = dataclasses.field(default_factory=list)
    #: tensors allocated for subtree loads, filled with the other requests
    subtree_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: stored entries some leaf of the state claimed
    consumed: set[str] = dataclasses.field(default_factory=set)
    missing: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    shape_mismatch: list[tuple[str, tuple, tuple]] = dataclasses.field(default_factory=list)
    dtype_mismatch: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    kind_mismatch: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    #: asked for as plain full-size tensors by a template holding DTensors on several ranks (refused)
    full_size: list[str] = dataclasses.field(default_factory=list)
    #: a key prefix that explains the missing keys (a non-strict load), see :func:`prefix_hint`
    hint: str | None = None

    def mismatch_error(self, uri: str, *, shapes_only: bool = False) -> StateMismatchError:
        if shapes_only:
            return StateMismatchError(
                uri, missing=[], unexpected=[], shape_mismatch=self.shape_mismatch, dtype_mismatch=[], kind_mismatch=[]
            )
        return StateMismatchError(
            uri,
            missing=self.missing,
            unexpected=self.unexpected,
            shape_mismatch=self.shape_mismatch,
            dtype_mismatch=self.dtype_mismatch,
            kind_mismatch=self.kind_mismatch,
        )


def match_state(
    reader: CheckpointReader, state: Mapping[str, Any], strict: bool, world_size: int, hook: ReshardObjects | None
) -> LoadPlan:
    """Match every leaf of ``state`` with the checkpoint: the load plan, or one error
    listing every mismatch."""
    plan = LoadPlan()
    stored_paths: dict[str, tuple] = {}
    leaves = list(flatten_state(state).values())
    #: a template holding DTensors (at any world size, one included): an optimizer's
    #: empty ``state`` must not be filled with plain full-size tensors beside them
    guard = any_dtensor(leaf.value for leaf in leaves)
    # no stored tensor's entry is built here (only its shape and dtype are read, for every
    # leaf in one call): the read builds those it plans, together (Catalog.entries), none
    # for the tensors stored whole in one row
    found = reader.catalog.shapes_and_dtypes([leaf.fqn for leaf in leaves])
    names = dict[torch.dtype, str]()  # a dtype_name per dtype
    consumed, requests, new = plan.consumed, plan.tensor_requests, tuple.__new__
    for leaf, stored in zip(leaves, found, strict=True):
        value = leaf.value
        if type(value) in _PLAIN_TENSORS:  # the usual leaf, as _match_tensor takes it, in fewer calls
            fqn = leaf.fqn
            if stored is None or value.shape != stored[0]:  # a torch.Size equals the tuple of its sizes
                _match_tensor(reader, leaf, plan)  # missing, an object or a shape mismatch: named there
                continue
            shape = stored[0]  # the stored shape's tuple: no tuple made a tensor
            consumed.add(fqn)
            name = names.get(value.dtype) or names.setdefault(value.dtype, dtype_name(value.dtype, fqn=fqn))
            if name != stored[1]:
                plan.dtype_mismatch.append((fqn, name, stored[1]))
            requests.append(new(TensorRequest, (fqn, ((0,) * len(shape), shape), value)))
        elif leaf.is_tensor:
            _match_tensor(reader, leaf, plan)
        elif leaf.fqn in reader.manifest.objects:
            plan.consumed.add(leaf.fqn)
            plan.object_loads.append(leaf)
        elif leaf.fqn in reader.catalog.tensors:
            plan.consumed.add(leaf.fqn)
            plan.kind_mismatch.append((leaf.fqn, "an object", "a tensor"))
        elif not _match_subtree(reader, leaf, plan, stored_paths, guard and _is_optimizer_state(state, leaf)):
            plan.missing.append(leaf.fqn)
    if plan.full_size:
        raise _full_size_error(reader, plan.full_size, world_size)
    held = len(reader.catalog.tensors) + len(reader.manifest.objects)  # distinct (check_keys); consumed is a subset
    plan.unexpected = [f for f in reader.keys() if f not in plan.consumed] if len(plan.consumed) < held else []
    if strict and (plan.missing or plan.unexpected or plan.shape_mismatch or plan.dtype_mismatch or plan.kind_mismatch):
        raise plan.mismatch_error(reader.uri)
    if plan.shape_mismatch:
        raise plan.mismatch_error(reader.uri, shapes_only=True)
    if plan.missing or plan.unexpected or plan.dtype_mismatch or plan.kind_mismatch:
        plan.hint = prefix_hint(plan.missing, plan.unexpected)
        log.warning("%s", _skipped_message(reader.uri, plan))
    _check_per_rank_objects(reader, plan, world_size, hook)
    return plan


def _skipped_message(uri: str, plan: LoadPlan) -> str:
    """What a non-strict load left out or cast, one kind per line, each list bounded."""
    lines = [
        f"non-strict load from {uri}: {len(plan.missing)} missing, {len(plan.unexpected)} unexpected, "
        f"{len(plan.dtype_mismatch)} cast, {len(plan.kind_mismatch)} kind mismatches skipped"
    ]
    kinds = (
        ("missing (in the state, not in the checkpoint; left as they were)", plan.missing),
        ("unexpected (in the checkpoint, not in the state; not loaded)", plan.unexpected),
        ("cast to the state's dtype", [f"{f} ({got} -> {want})" for f, want, got in plan.dtype_mismatch]),
        ("kind mismatch (tensor vs object; not loaded)", [f for f, _w, _g in plan.kind_mismatch]),
    )
    lines += [f"  {what}: {listed(keys)}" for what, keys in kinds if keys]
    if plan.hint:
        lines.append(f"  hint: {plan.hint}")
    return "\n".join(lines)


def _require_whole(reader: CheckpointReader, fqns: list[str]) -> None:
    """The catalog rows of the whole of each of ``fqns``, in one read (a catalog read in part)."""
    boxes = [(f, ((0,) * len(shape), shape)) for f in fqns for shape in [reader.catalog.tensors[f].global_shape]]
    if boxes:
        reader.catalog.require(boxes)


def _full_size_error(reader: CheckpointReader, fqns: list[str], world_size: int) -> UnsupportedStateError:
    """The FSDP2 ``optimizer.state_dict()`` mistake, refused before anything is allocated."""
    ranks = "one process" if world_size == 1 else f"each of {world_size} ranks"
    return UnsupportedStateError(
        f"{reader.uri}: the state given to load holds DTensors beside an optimizer state_dict() with an empty "
        f"'state'; bcp would fill it with {len(fqns)} plain full-size tensors on {ranks}: {listed(fqns)}. "
        "The next optimizer.step() would then mix torch.Tensor and DTensor. This is what optimizer.state_dict() "
        "gives under FSDP2/TP: build the state with torch.distributed.checkpoint.state_dict.get_state_dict(model, "
        "optimizer) (or get_optimizer_state_dict), or load through bcp.TrainingState, which does"
    )


#: exact types of a plain tensor leaf (a DTensor or other subclass goes through local_pieces)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _match_tensor(reader: CheckpointReader, leaf: Leaf, plan: LoadPlan) -> None:
    """A tensor-like leaf: the boxes this rank holds, if shape and kind match. A plain
    tensor asks for the whole tensor on this rank, whatever layout saved it (the usual
    plain leaf is matched in match_state's loop, the same way in fewer calls)."""
    fqn = leaf.fqn
    stored = reader.catalog.shapes_and_dtypes([fqn])[0]
    if stored is None:
        if fqn in reader.manifest.objects:
            plan.consumed.add(fqn)
            plan.kind_mismatch.append((fqn, "a tensor", "an object"))
        else:
            plan.missing.append(fqn)
        return
    plan.consumed.add(fqn)
    value = leaf.value
    stored_shape, stored_dtype = stored
    shape, dtype, pieces, _replicated = local_pieces(value, fqn)
    if tuple(shape) != stored_shape:
        plan.shape_mismatch.append((fqn, tuple(shape), stored_shape))
        return
    name = dtype_name(dtype, fqn=fqn)
    if name != stored_dtype:
        plan.dtype_mismatch.append((fqn, name, stored_dtype))
    plan.tensor_requests += [TensorRequest(fqn, p.box, p.tensor) for p in pieces]


def _is_optimizer_state(state: Mapping[str, Any], leaf: Leaf) -> bool:
    """Whether ``leaf`` is an ``optimizer.state_dict()`` (``state`` and ``param_groups``;
    with no tensor in its state it is one leaf) or the ``state`` beside its ``param_groups``."""
    if isinstance(leaf.value, Mapping) and "state" in leaf.value and "param_groups" in leaf.value:
        return True
    if len(leaf.path) < 2 or leaf.path[-1] != ("d", "state"):
        return False
    parent = get_at(state, leaf.path[:-1])
    return isinstance(parent, Mapping) and "param_groups" in parent


def _match_subtree(
    reader: CheckpointReader,
    leaf: Leaf,
    plan: LoadPlan,
    stored_paths: dict[str, tuple],
    guarded: bool = False,
) -> bool:
    """A template container with no stored entry of its own (an optimizer's empty
    ``state`` before its first step): replaced by the stored subtree below its path,
    tensors allocated on CPU. False when nothing is stored below it. ``guarded``: the
    container is an optimizer's ``state`` in a template holding DTensors, where
    tensors of one dimension or more are refused (``plan.full_size``), not allocated."""
    if not isinstance(leaf.value, (Mapping, list, tuple)):
        return False
    prefix = _keys(leaf.path)
    if not stored_paths:  # touches every catalog entry, which a lazy catalog otherwise never materialises
        stored_paths.update((f, _keys(reader.key_path(f))) for f in reader.keys())
    below = tuple(f for f, p in stored_paths.items() if len(p) > len(prefix) and p[: len(prefix)] == prefix)
    if not below:
        return False
    plan.consumed.update(below)
    tensors = [f for f in below if f in reader.catalog.tensors]
    if guarded:  # 0-d tensors (an optimizer's step counters) are the same either way
        full_size = [f for f in tensors if len(reader.catalog.tensors[f].global_shape) > 0]
        if full_size:
            plan.full_size += full_size
            return True
    _require_whole(reader, tensors)
    plan.subtree_loads.append(SubtreeLoad(leaf, below))
    # allocated once the files are found at their declared sizes, a tie once: no more than is stored
    made = reader.empty_whole(list(tensors))
    plan.subtree_tensors.update(made)
    for f, t in first_of_each(made).items():
        plan.tensor_requests.append(TensorRequest(f, ((0,) * t.dim(), tuple(t.shape)), t))
    return True


def _check_per_rank_objects(
    reader: CheckpointReader, plan: LoadPlan, world_size: int, hook: ReshardObjects | None
) -> None:
    """Objects saved per rank at another world size need the caller's hook."""
    if reader.manifest.world_size == world_size or hook is not None:
        return
    objects = [leaf.fqn for leaf in plan.object_loads]
    objects += [f for load in plan.subtree_loads for f in load.fqns if f in reader.manifest.objects]
    per_rank = [f for f in objects if reader.is_per_rank(f)]
    alone = reader.manifest.world_size == 1  # one process's PerRank is stored job-wide: still one rank's value
    per_rank += [leaf.fqn for leaf in plan.object_loads if alone and isinstance(leaf.value, PerRank)]
    if per_rank:
        raise UnsupportedStateError(
            f"{reader.uri} was saved by {reader.manifest.world_size} rank(s), is loaded by {world_size}; objects saved "
            f"per rank need a reshard_objects hook to say what each rank gets: {', '.join(per_rank)} (distributed.md)"
        )


def _require(reader: CheckpointReader, plan: LoadPlan) -> None:
    """Read the catalog sections this rank's boxes need (a catalog read in part)."""
    reader.catalog.require((r.fqn, r.box) for r in plan.tensor_requests)


def _read(reader: CheckpointReader, plan: LoadPlan, coord: Coordinator, share_reads: bool) -> ReadStats:
    requests: list[tuple[str, Box, torch.Tensor]] = list(plan.tensor_requests)
    if not share_reads or coord.world_size == 1:
        return reader.fill(requests, prefer_rank=coord.rank)
    from bcp.shared_read import fetch_shared

    assert isinstance(coord, GroupCoordinator), "coordinator_for gives more than one rank a GroupCoordinator"
    with trace.span("shared"):
        held, stats = fetch_shared(reader, coord, [(r.fqn, r.box) for r in plan.tensor_requests])
    stats.add(reader.fill(requests, prefer_rank=coord.rank, in_memory=held))
    return stats


def _place_objects(
    reader: CheckpointReader, state: Mapping[str, Any], plan: LoadPlan, coord: Coordinator, hook: ReshardObjects | None
) -> Mapping[str, Any]:
    resized = reader.manifest.world_size != coord.world_size

    def object_value(fqn: str, marked: bool = False) -> Any:
        """This rank's value: its own of a per-rank object (the hook's at another world size; a
        ``PerRank`` one process saved is stored job-wide: dealt the same way)."""
        if not reader.is_per_rank(fqn):
            value = reader.read_object(fqn)
            if hook is None or not (marked and resized and reader.manifest.world_size == 1):
                return value
            return hook(fqn, {0: value}, coord.rank, coord.world_size)
        if not resized:
            return reader.read_object(fqn, rank=coord.rank)
        assert hook is not None  # checked by match_state
        return hook(fqn, reader.per_rank_objects(fqn), coord.rank, coord.world_size)

    for leaf in plan.object_loads:
        marked = isinstance(leaf.value, PerRank)
        template = leaf.value.value if marked else leaf.value
        state = replace_at(state, leaf.path, keep_unrecorded(template, object_value(leaf.fqn, marked), fqn=leaf.fqn))
    for leaf, below in plan.subtree_loads:
        depth = len(leaf.path)
        values = ((f, plan.subtree_tensors[f] if f in plan.subtree_tensors else object_value(f)) for f in below)
        subtree = build_nested((reader.key_path(f)[depth:], v) for f, v in values)
        state = replace_at(state, leaf.path, subtree)
    return state


def holds_nothing(value: Any) -> bool:
    """Whether a DCP save records nothing for ``value``: an empty dict, or a dict or
    list holding only such (DCP walks into dicts, and into lists holding a dict, and
    records their leaves; it records an empty list, a tuple or a scalar whole)."""
    if isinstance(value, Mapping):
        return all(holds_nothing(v) for v in value.values())
    return isinstance(value, list) and bool(value) and all(holds_nothing(v) for v in value)


def keep_unrecorded(template: Any, stored: Any, *, fqn: str) -> Any:
    """``stored`` (a freshly decoded object, changed in place) with the members the
    template has, the stored value lacks, and DCP records nothing for
    (:func:`holds_nothing`) put back from the template: a checkpoint converted from DCP
    cannot hold them (``LambdaLR``'s ``lr_lambdas: [{}]``), and DCP's own load leaves
    them as the template has them. Only what the stored value lacks is added, never a
    stored value replaced: a checkpoint saved by bcp holds its empty dicts already, so
    nothing changes for it unless its template has members it never saved."""
    if isinstance(template, Mapping) and isinstance(stored, dict):
        for key, value in template.items():
            here = key if key in stored else str(key) if str(key) in stored else None  # DCP writes keys as str
            if here is not None:
                stored[here] = keep_unrecorded(value, stored[here], fqn=f"{fqn}.{key}")
            elif holds_nothing(value):
                log.info("%s: %r is not in the checkpoint (DCP records no empty dict): kept from the state", fqn, key)
                stored[key] = copy.deepcopy(value)
    elif isinstance(template, list) and isinstance(stored, list):
        for i, value in enumerate(template[: len(stored)]):
            stored[i] = keep_unrecorded(value, stored[i], fqn=f"{fqn}.{i}")
        rest = template[len(stored) :]
        if rest and all(holds_nothing(v) for v in rest):
            log.info(
                "%s: items %d.. are not in the checkpoint (DCP records no empty dict): kept from the state",
                fqn,
                len(stored),
            )
            stored.extend(copy.deepcopy(rest))
    return stored
