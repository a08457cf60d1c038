"""A rank's prepared tensors (step 1 of a save), kept between saves of the same structure.

Preparing turns every tensor leaf into its plan (:class:`TensorPlan`), the rank's
:class:`LocalLayout` and one :class:`WriteItem` per local box: about 20 us a tensor,
paid at every save though none of it depends on the tensors' values. A training job
saves the same structure again and again, so the result is kept (:class:`LocalPlans`,
one per coordinator group, in its :class:`bcp.planning.cache.PlanCache`) under a
fingerprint of every tensor leaf, compared as a whole at each save (a kept one with
each tensor's fields as they are read, :meth:`LocalPlans.find`, none of them kept):

* a plain tensor (``torch.Tensor`` or ``nn.Parameter`` exactly): its key path, dtype,
  shape, strides, storage offset, address, device, conjugate/negative bits and whether
  bcp copies it as a device tensor (with the real CUDA seam the device says so; a
  stand-in seam is asked per tensor) (a tensor of another layout has no strides:
  planned, and refused, the usual way).
  The address and offset give the storage's address, so two tensors share memory
  (a tied weight, written once) exactly when they did before;
* any other tensor-like leaf (DTensor, TensorShard, FlatShard, a tensor subclass):
  its type, global shape, dtype and every local piece's box and the piece's
  fingerprint, from :func:`bcp.shards.local_pieces` run at every save.

Any difference (a key added, removed or moved, a new dtype or shape, memory
reallocated, a placement changed) plans again from scratch; the fingerprint holds
no tensor, so the cache keeps no caller memory alive. The write pipeline's plan (the
file layout and its chunks, ``bcp.io_scheduler.chunk_plan.PipelinePlan``) depends
on nothing else but this rank's writes and the backend and pool settings, and is
kept with it; it holds the dense host tensors' addresses (an async save stages raw
copies from them, a sync save writes its batches from views at them; the batches are
kept too), valid because the fingerprint holds them too.
Checksums of replicated boxes are data: taken at every save. An incremental save's
pieces (``bcp.pieces.cut_pieces``) are kept too, apart from the full save's plan of the
same structure (the key holds ``piece_bytes``): per piece, the rows of its leaf's piece it
is (:func:`cut_items`); its kept plan also keeps the base-row lookups
(``bcp.incremental.find_candidates``) by the base's URI and save id.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import torch

from bcp.io_scheduler import device_copy
from bcp.io_scheduler.chunk_plan import PipelinePlan
from bcp.io_scheduler.write_pipeline import WriteItem
from bcp.pieces import cut_pieces
from bcp.planning.local_layout import LocalLayout, TensorPlan
from bcp.replicas import ReplicaSummer, ReplicaSums
from bcp.shards import LocalTensor, LowestRankCopy, Piece, holds_replica, local_pieces
from bcp.state import path_to_str
from bcp.tensor_io import check_saveable, storage_identity
from bcp.torch_dtypes import dtype_name

#: Tensor types whose leaf is its own single piece (checked by exact type: a subclass
#: may describe its memory otherwise, and goes through ``local_pieces``).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
PLAIN_SET = frozenset(PLAIN_TENSORS)

#: Structures kept per coordinator group (a job cycling through a few, e.g. the model
#: alone, with its optimizer, and a benchmark's several states, hits each).
KEEP_LOCAL = 4


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Step 1's result on one rank."""

    layout: LocalLayout
    #: one per box of ``layout``, in its flat order (box i is written from items[i])
    items: Sequence[WriteItem]
    objects: dict[str, Any]
    #: checksums of the replicated boxes, taken now: the values at the call
    replicas: ReplicaSums | None = None
    #: the kept plan this came from or went into (None: not kept)
    local: LocalPlan | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def pieces(self) -> dict[tuple[str, Any], WriteItem]:
        """(fqn, box) -> the item writing it."""
        return {(item.plan.fqn, item.piece.box): item for item in self.items}


def tensor_signature(t: torch.Tensor) -> tuple:
    """What of a tensor's memory its plan depends on (raises for a tensor without
    strides or storage: such a tensor is planned, and refused, the usual way).
    :func:`fingerprint` has the same fields inline for plain tensors."""
    return (
        t.dtype,
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.data_ptr(),
        t.device,
        t.is_conj(),
        t.is_neg(),
        device_copy.api.is_device(t),  # the copy path bcp takes (tests swap the CUDA seam)
    )


class Fingerprint:
    """A fingerprint's fields with their hash computed once: a kept structure is
    looked up (and moved to the end of the cache) by it, and a tuple of thousands of
    per-tensor tuples would be hashed again at each lookup. ``part``: what the hash is
    taken of, when not every field (equal fingerprints have equal parts; the fields
    are compared whole on a lookup anyway)."""

    __slots__ = ("_hash", "sigs")

    def __init__(self, sigs: tuple, part: Any = None) -> None:
        self.sigs = sigs
        self._hash = hash(sigs if part is None else part)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint) or self._hash != other._hash:
            return False
        if self.sigs is other.sigs:
            return True
        if self.sigs != other.sigs:
            return False
        # Equal: share one tuple, so the next comparison of the two (the cache's
        # move_to_end after its lookup) is an identity check, not thousands of tuples again.
        other.sigs = self.sigs
        return True


def fingerprint(leaves: Mapping[Any, Any], rank: int) -> tuple[Fingerprint | None, list[Any]]:
    """(key, values): ``key`` compares equal between two saves only when their
    tensors' plans are equal (None: not fingerprintable, plan afresh); ``values``
    holds, per tensor leaf in order, the tensor itself (a plain one) or its
    :class:`LocalTensor`. A plain tensor's fields (:func:`tensor_signature`'s) are read
    by C loops (``map`` of each field, zipped: tensor by tensor, while its memory is in
    cache), with no Python call per tensor."""
    read = _read_leaves(leaves, rank)
    if read is None:
        return None, []
    plain_leaves, tensors, values, head = read
    try:
        rows = tuple(zip(*_fields(plain_leaves, tensors), strict=True))
    except Exception:  # noqa: BLE001 - planned the usual way, which names the problem
        return None, []
    k = _HASHED_ROWS
    return Fingerprint((*head[:2], rows, head[2]), _hash_part(head, len(rows), rows[:k], rows[-k:])), values


def _read_leaves(leaves: Mapping[Any, Any], rank: int) -> tuple[list, list, list, tuple] | None:
    """(the plain tensor leaves, their tensors, every tensor leaf's value as
    :func:`fingerprint` gives them, (seam type, rank, the other tensor-like leaves'
    fields)); None: a leaf could not be read (planned the usual way)."""
    plain = PLAIN_TENSORS
    every = leaves.values()
    tensors: list[Any] = list(map(_VALUE, every))
    if set(map(type, tensors)) <= PLAIN_SET:  # every leaf a plain tensor (a model's state dict): no loop in Python
        plain_leaves = list(every)
    else:
        plain_leaves = [leaf for leaf in every if type(leaf.value) in plain]
        tensors = list(map(_VALUE, plain_leaves))
    try:
        values: list[Any] = tensors
        others: tuple[Any, ...] = ()
        if len(plain_leaves) < len(leaves):
            # the tensor leaves in order: the plain ones, and any other tensor-like one where it stands
            ordered = [leaf for leaf in every if type(leaf.value) in plain or leaf.is_tensor]
            if len(ordered) > len(tensors):
                values, found = [], []
                with torch.no_grad():  # once for every DTensor's to_local (local_pieces), not once each
                    for i, leaf in enumerate(ordered):
                        v = leaf.value
                        if type(v) in plain:
                            values.append(v)
                            continue
                        local = local_pieces(v, leaf.fqn)
                        boxes = tuple((p.box, tensor_signature(p.tensor)) for p in local.pieces)
                        found.append((i, leaf.path, type(v), local.global_shape, local.dtype, holds_replica(v), boxes))
                        values.append(local)
                others = tuple(found)
    except Exception:  # noqa: BLE001 - planned the usual way, which names the problem
        return None
    return plain_leaves, tensors, values, (type(device_copy.api), rank, others)


def _fields(plain_leaves: list, tensors: list) -> list[Iterator[Any]]:
    """Per field of a plain tensor's row, its values in tensor order (lazy C loops)."""
    api = device_copy.api  # the copy path bcp takes (tests swap the CUDA seam)
    t = torch.Tensor
    fields: list[Iterator[Any]] = [
        map(_PATH, plain_leaves),
        map(_DTYPE, tensors),
        map(_SHAPE, tensors),
        map(t.stride, tensors),
        map(t.storage_offset, tensors),
        map(t.data_ptr, tensors),
        map(_DEVICE, tensors),
        map(t.is_conj, tensors),
        map(t.is_neg, tensors),
    ]
    if not getattr(api, "by_device", False):  # the real CUDA seam: the device decides; a stand-in is asked
        fields.append(map(api.is_device, tensors))
    return fields


def _hash_part(head: tuple, n: int, first: tuple, last: tuple) -> tuple:
    """What a fingerprint's hash is taken of: the count of its rows and the rows at its
    ends (``first``, ``last``: the first and last :data:`_HASHED_ROWS`); a lookup
    compares every field of an equal hash's anyway."""
    return (*head[:2], (n, first, last), head[2])


def _end_rows(plain_leaves: list, tensors: list) -> tuple[tuple, tuple]:
    """The rows :func:`_hash_part` takes (``rows[:k]``, ``rows[-k:]``), without the middle."""
    k = _HASHED_ROWS
    first = tuple(zip(*_fields(plain_leaves[:k], tensors[:k]), strict=True))
    return first, tuple(zip(*_fields(plain_leaves[-k:], tensors[-k:]), strict=True))


#: rows of plain tensors at each end of a fingerprint that its hash is taken of
_HASHED_ROWS = 16
#: from this many plain tensors a kept structure is compared with each row as it is read
#: (``LocalPlans.find``): fewer are read whole, then compared (every row is in cache anyway)
_STREAMED_FROM = 1024


#: a leaf's fields and a plain tensor's, read by C calls (``fingerprint``)
_VALUE, _PATH = operator.attrgetter("value"), operator.attrgetter("path")
_DTYPE, _SHAPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("shape"), operator.attrgetter("device")


@dataclasses.dataclass
class LocalPlan:
    """What preparing gives for one structure, without a tensor (see the module docstring)."""

    layout: LocalLayout
    digest: bytes
    #: per box in flat order: its tensor's plan, its box and its tensor index
    plans: list[TensorPlan]
    boxes: list[Any]
    tensor_of: list[int]
    #: per box: the index of its piece in its leaf's pieces (-1: a plain tensor, the leaf itself)
    piece_of: list[int]
    #: per tensor, in order: whether its leaf holds a replica (``holds_replica``)
    replicated: list[bool]
    #: the write pipeline's plans, by ``bcp.io_scheduler.write_pipeline.pipeline_key``
    pipelines: OrderedDict[Any, PipelinePlan] = dataclasses.field(default_factory=OrderedDict)
    #: an incremental save's: per box, the dim-0 rows ``[a, b)`` of its piece's tensor it
    #: writes (None: the whole piece) (:func:`cut_items`)
    cuts: list[tuple[int, int] | None] | None = None
    #: an incremental save's base-row lookups, by base identity (``bcp.incremental``)
    lookups: OrderedDict[Any, Any] = dataclasses.field(default_factory=OrderedDict)
    #: every box a plain tensor's whole, box i of tensor i: a save's tensors are its values
    plain: bool = dataclasses.field(init=False, default=False)

    def __post_init__(self) -> None:
        in_order = self.tensor_of == list(range(len(self.tensor_of)))
        self.plain = self.cuts is None and in_order and not any(k >= 0 for k in self.piece_of)

    def items(self, values: list[Any]) -> KeptItems:
        """The write items of this save's tensors (``fingerprint``'s ``values``)."""
        return KeptItems(self, values)

    def sum_replicas(self, items: Sequence[WriteItem], summer: ReplicaSummer) -> ReplicaSums | None:
        if not summer.enabled:
            return None
        for item in items:
            if self.replicated[item.tensor]:
                summer.add(item.tensor, item.piece.box, item.plan.global_shape, item.piece.tensor)
        return summer.finish()


class KeptItems(Sequence[WriteItem]):
    """A kept plan's write items of one save (``boxes``: of those boxes, in that order;
    None: every box), each made only when read: the steady path reads no item one by
    one (the tensors as a column, :meth:`tensors`; the boxes' plans and the chunks'
    copies from the kept pipeline plan), so a save of 10,000 tensors makes none."""

    __slots__ = ("_boxes", "_kept", "_values")

    def __init__(self, kept: LocalPlan, values: list[Any], boxes: list[int] | None = None) -> None:
        self._kept, self._values, self._boxes = kept, values, boxes

    def __len__(self) -> int:
        return len(self._kept.plans) if self._boxes is None else len(self._boxes)

    @overload
    def __getitem__(self, i: int) -> WriteItem: ...
    @overload
    def __getitem__(self, i: slice) -> list[WriteItem]: ...
    def __getitem__(self, i: int | slice) -> WriteItem | list[WriteItem]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        kept = self._kept
        b = i if self._boxes is None else self._boxes[i]
        t, k = kept.tensor_of[b], kept.piece_of[b]
        v = self._values[t]
        return WriteItem(kept.plans[b], Piece(kept.boxes[b], v if k < 0 else v.pieces[k].tensor), t)

    def __iter__(self) -> Iterator[WriteItem]:
        return iter([self[j] for j in range(len(self))])

    def take(self, writes: list[int]) -> KeptItems:
        """The items of boxes ``writes`` (indices into these items), in that order."""
        if self._boxes is not None:
            writes = [self._boxes[i] for i in writes]
        return KeptItems(self._kept, self._values, None if writes == list(range(len(self._kept.plans))) else writes)

    def tensors(self) -> list[torch.Tensor]:
        """Per item, the tensor its piece is (``WriteItem.piece.tensor``), without the items."""
        kept, values = self._kept, self._values
        if kept.plain:  # box i is tensor i, the leaf itself
            return values if self._boxes is None else [values[b] for b in self._boxes]
        boxes = range(len(kept.plans)) if self._boxes is None else self._boxes
        of, piece = kept.tensor_of, kept.piece_of
        return [values[of[b]] if piece[b] < 0 else values[of[b]].pieces[piece[b]].tensor for b in boxes]


def take(items: Sequence[WriteItem], writes: np.ndarray) -> Sequence[WriteItem]:
    """``[items[i] for i in writes]``, as :class:`KeptItems` (no item made) when they are."""
    if isinstance(items, KeptItems):
        n = len(items)
        if items._boxes is None and len(writes) == n and np.array_equal(writes, np.arange(n)):
            return items  # every box in order (one rank writes all): no list of every index made and compared
        return items.take(writes.tolist())
    return [items[i] for i in writes.tolist()]


def cut_items(kept: LocalPlan, values: list[Any]) -> list[WriteItem]:
    """:meth:`LocalPlan.items` of an incremental save's kept plan: each piece the rows of
    its leaf's piece that :func:`bcp.pieces.cut_pieces` gave it when planned."""
    assert kept.cuts is not None
    out = []
    for plan, box, t, k, cut in zip(kept.plans, kept.boxes, kept.tensor_of, kept.piece_of, kept.cuts, strict=True):
        tensor = values[t] if k < 0 else values[t].pieces[k].tensor
        out.append(WriteItem(plan, Piece(box, tensor if cut is None else tensor[cut[0] : cut[1]]), t))
    return out


def cut_local(local: list[Piece], dtype: torch.dtype, piece_bytes: int) -> tuple[list[Piece], list[int], list]:
    """``local`` cut into pieces (``bcp.pieces.cut_pieces``): the pieces, each one's index
    in ``local`` and its dim-0 rows of that piece's tensor (None: all of it)."""
    pieces: list[Piece] = []
    origin: list[int] = []
    cuts: list[tuple[int, int] | None] = []
    for k, piece in enumerate(local):
        for cut in cut_pieces(piece, dtype, piece_bytes):
            pieces.append(cut)
            origin.append(k)
            if cut is piece:
                cuts.append(None)
            else:
                a = cut.box[0][0] - piece.box[0][0]
                cuts.append((a, a + cut.box[1][0]))
    return pieces, origin, cuts


class LocalPlans:
    """One coordinator group's kept structures, newest last; counts what it did (tests)."""

    def __init__(self, keep: int = KEEP_LOCAL) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._plans: OrderedDict[Fingerprint, LocalPlan] = OrderedDict()
        #: saves planned from scratch / reused a kept plan
        self.built = 0
        self.reused = 0

    def get(self, key: Fingerprint | None) -> LocalPlan | None:
        if key is None:
            return None
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.reused += 1
            return plan

    def find(self, leaves: Mapping[Any, Any], rank: int) -> tuple[Fingerprint | None, LocalPlan | None, list[Any]]:
        """(key, kept plan or None, values): :func:`fingerprint` and :meth:`get` in one,
        without keeping this save's rows: the kept structures whose hash (the rows'
        count and ends) matches are compared with every tensor's fields as they are
        read, row by row at C speed (each row freed at once, while in cache); the full
        key is built only on a miss (``key``: None then for an unfingerprintable state)."""
        read = _read_leaves(leaves, rank)
        if read is None:
            return None, None, []
        plain_leaves, tensors, values, head = read
        try:
            rows: tuple | None = None
            if len(tensors) <= _STREAMED_FROM:  # few: read once, kept until compared (all in cache)
                rows = tuple(zip(*_fields(plain_leaves, tensors), strict=True))
                part = _hash_part(head, len(rows), rows[:_HASHED_ROWS], rows[-_HASHED_ROWS:])
            else:
                part = _hash_part(head, len(tensors), *_end_rows(plain_leaves, tensors))
            wanted = hash(part)
            with self._lock:
                candidates = [(kept, plan) for kept, plan in reversed(self._plans.items()) if kept._hash == wanted]
            for key, plan in candidates:
                sigs = key.sigs  # (seam type, rank, rows, others): compared field by field
                if sigs[0] is not head[0] or sigs[1] != rank or len(sigs[2]) != len(tensors) or sigs[3] != head[2]:
                    continue
                if rows is not None:
                    same = rows == sigs[2]
                else:  # each row made, compared and freed in turn
                    same = all(map(operator.eq, zip(*_fields(plain_leaves, tensors), strict=True), sigs[2]))
                if same:
                    with self._lock:
                        if key in self._plans:
                            self._plans.move_to_end(key)
                        self.reused += 1
                    return key, plan, values
            if rows is None:
                rows = tuple(zip(*_fields(plain_leaves, tensors), strict=True))
        except Exception:  # noqa: BLE001 - planned the usual way, which names the problem
            return None, None, []
        return Fingerprint((*head[:2], rows, head[2]), part), None, values

    def put(self, key: Fingerprint | None, plan: LocalPlan) -> None:
        with self._lock:
            self.built += 1
            if key is None:
                return
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.keep:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def prepare_tensors(
    leaves: Mapping[Any, Any],
    rank: int,
    objects: dict[str, Any],
    summer: ReplicaSummer | None = None,
    plans: LocalPlans | None = None,
    piece_bytes: int | None = None,
) -> Prepared:
    """The tensor part of step 1: each tensor's plan and local pieces (and, with
    ``summer``, the checksums of its replicated ones); from ``plans`` when it keeps
    this structure, else planned and kept there. ``piece_bytes`` (an incremental save):
    every local box cut into pieces of whole rows (``bcp.pieces.cut_pieces``), kept
    apart from the full saves' plans of the structure (the key holds ``piece_bytes``)."""
    summer = summer or ReplicaSummer("off")
    key: Fingerprint | None = None
    kept: LocalPlan | None = None
    values: list[Any] = []
    if plans is not None and piece_bytes is None:
        key, kept, values = plans.find(leaves, rank)
    elif plans is not None:  # an incremental save's pieces: kept apart (the key holds piece_bytes)
        key, values = fingerprint(leaves, rank)
        key = Fingerprint(("pieces", piece_bytes, key)) if key is not None else None
        kept = plans.get(key)
    if kept is not None:
        reused = kept.items(values) if kept.cuts is None else cut_items(kept, values)
        return Prepared(kept.layout, reused, objects, kept.sum_replicas(reused, summer), kept)
    tensors: list[TensorPlan] = []
    items: list[WriteItem] = []
    piece_of: list[int] = []
    replicated: list[bool] = []
    first_fqn_of: dict[tuple, str] = {}
    cuts: list[tuple[int, int] | None] | None = [] if piece_bytes is not None else None
    for leaf in leaves.values():
        if not leaf.is_tensor:
            continue
        plain = type(leaf.value) in PLAIN_TENSORS
        shape, dtype, local, _replicated = local_pieces(leaf.value, leaf.fqn)
        for piece in local:
            check_saveable(piece.tensor, leaf.fqn)
        origin: Sequence[int] = range(len(local))
        if cuts is not None and piece_bytes is not None:
            whole = len(local)
            local, origin, mine = cut_local(local, dtype, piece_bytes)
            cuts.extend(mine)
            origin = [-1] * len(local) if plain and whole == 1 else origin
        ident = tuple(storage_identity(p.tensor) for p in local)
        alias = first_fqn_of.setdefault(ident, leaf.fqn)
        tensor_plan = TensorPlan(
            fqn=leaf.fqn,
            key_path=path_to_str(leaf.path),
            dtype=dtype_name(dtype, fqn=leaf.fqn),
            global_shape=tuple(shape),
            boxes=tuple(p.box for p in local),
            alias_of=None if alias == leaf.fqn else alias,
            lowest_rank=type(leaf.value) is LowestRankCopy,
        )
        items.extend(WriteItem(tensor_plan, piece, len(tensors)) for piece in local)  # LocalLayout's flat order
        piece_of.extend([-1] if cuts is None and plain and len(local) == 1 else origin)
        holds = holds_replica(leaf.value)
        replicated.append(holds)
        if summer.enabled and holds:
            for piece in local:
                summer.add(len(tensors), piece.box, tensor_plan.global_shape, piece.tensor)
        tensors.append(tensor_plan)
    replicas = summer.finish() if summer.enabled else None
    layout = LocalLayout.build(rank, tensors)
    kept = None
    if plans is not None:
        kept = LocalPlan(
            layout,
            layout.digest(),
            [i.plan for i in items],
            [i.piece.box for i in items],
            [i.tensor for i in items],
            piece_of,
            replicated,
            cuts=cuts,
        )
        plans.put(key, kept)
    return Prepared(layout, items, objects, replicas, kept)


__all__ = [
    "Fingerprint",
    "KeptItems",
    "LocalPlan",
    "LocalPlans",
    "LocalTensor",
    "Prepared",
    "cut_items",
    "cut_local",
    "fingerprint",
    "prepare_tensors",
    "take",
]
