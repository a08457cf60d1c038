"""Shard specs: how a rank says where its local tensor sits in the global tensor.

* a plain ``torch.Tensor``: the whole tensor, replicated on every rank (DDP);
* a ``DTensor``: its box comes from torch's own DTensor chunk metadata (FSDP2, TP,
  2-D meshes, uneven shards);
* :class:`TensorShard`: an explicit box (Megatron-style TP/PP/EP layouts);
* :class:`FlatShard`: a contiguous range of the row-major flattening (FSDP1 flat
  parameters, ZeRO partitions), cut into at most 2*ndim-1 boxes;
* :class:`LowestRankCopy`: a whole tensor every rank holds whose copies may differ
  (BatchNorm statistics): stored from its lowest-ranked holder, never compared.

Objects (non-tensors) wrapped in :class:`PerRank` are saved once per rank; reading
one back without a template (``bcp.open(uri).state()``) gives a :class:`RankValues`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from bcp.errors import UnsupportedStateError
from bcp.metadata.geometry import Box, flat_range_to_boxes


@dataclasses.dataclass
class TensorShard:
    """``local`` is the box ``offsets .. offsets + local.shape`` of a tensor of ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape, self.offsets = tuple(self.global_shape), tuple(self.offsets)
        if not (len(self.global_shape) == len(self.offsets) == self.local.dim()):
            raise ValueError(
                f"TensorShard: local has {self.local.dim()} dims, global_shape {len(self.global_shape)}, "
                f"offsets {len(self.offsets)}"
            )
        for o, n, s in zip(self.offsets, self.local.shape, self.global_shape, strict=True):
            if o < 0 or o + n > s:
                raise ValueError(
                    f"TensorShard: box offsets={list(self.offsets)} shape={list(self.local.shape)} "
                    f"does not fit in {list(self.global_shape)}"
                )


@dataclasses.dataclass
class FlatShard:
    """``local`` (1-D) holds elements ``start .. start + local.numel()`` of the row-major
    flattening of a tensor of ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)
        if self.local.dim() != 1:
            raise ValueError(f"FlatShard: local must be 1-D, got shape {list(self.local.shape)}")
        if self.start < 0 or self.start + self.local.numel() > math.prod(self.global_shape):
            raise ValueError(
                f"FlatShard: range [{self.start}, {self.start + self.local.numel()}) is outside "
                f"{list(self.global_shape)}"
            )


@dataclasses.dataclass
class LowestRankCopy:
    """Save ``local``, a whole tensor that several ranks hold, from the lowest-ranked of
    them (rank 0 under plain data parallelism), without comparing the copies: for values
    each rank updates on its own data, such as BatchNorm's running statistics under DDP
    (which broadcasts rank 0's at the next forward) or FSDP2. A load fills ``local``."""

    local: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor) or is_dtensor(self.local):
            raise TypeError(f"LowestRankCopy takes a plain torch.Tensor, not {type(self.local).__qualname__}")


@dataclasses.dataclass
class PerRank:
    """Save this object once per rank (dataloader position, RNG state). Loading at
    the same world size gives each rank its own; at another world size the caller's
    ``reshard_objects`` hook decides."""

    value: Any


class RankValues(dict[int, Any]):
    """Every saved rank's value of a per-rank object (saving rank -> value), as
    ``bcp.open(uri).state()``, ``read_object`` and ``objects()`` return it: read
    without a template, no rank is the right one, so none is picked. It is not a
    state to save (bcp.save refuses it, naming the key): save one rank's value from
    each rank, wrapped in :class:`PerRank`."""

    def __repr__(self) -> str:
        return f"RankValues({dict.__repr__(self)})"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of the global tensor and the local memory (a view shaped like the box) holding it."""

    box: Box
    tensor: torch.Tensor


def is_dtensor(value: Any) -> bool:
    # A DTensor cannot exist unless its module was imported; importing it just to ask
    # costs 0.7 s, which every single-process save would pay on its first call.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def any_dtensor(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a DTensor: one check per distinct type, none at all
    while DTensor's module is not imported (a load's template of 10,000 tensors)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(issubclass(t, module.DTensor) for t in set(map(type, values)))


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, TensorShard, FlatShard, LowestRankCopy))


class LocalTensor(NamedTuple):
    """What this rank holds of a tensor-like leaf."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    #: a plain tensor: every rank holds all of it
    replicated: bool


def holds_replica(value: Any) -> bool:
    """Whether other ranks hold the same box of this tensor-like leaf, by its own
    description: a plain tensor (every rank holds all of it), or a DTensor with a
    ``Replicate`` placement on a mesh dimension of more than one rank. Such a box is
    stored once (the save checks that the copies agree: ``bcp.replicas``)."""
    if is_dtensor(value):
        mesh, placements = value.device_mesh, value.placements
        kept = _DTENSOR_BOXES.get((type(value), id(mesh), id(placements), tuple(value.shape)))
        return kept[3] if kept is not None else _replicated(mesh, placements)
    return isinstance(value, torch.Tensor)


def _replicated(mesh: Any, placements: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return any(isinstance(p, Replicate) and mesh.size(d) > 1 for d, p in enumerate(placements))


#: a DTensor's local box (and whether other ranks hold a replica of it) by (type, mesh,
#: placements, global shape), the only inputs of its chunk list for a plain local tensor:
#: computed once, not at every save (16 us a tensor, half of an FSDP2 save's caller time).
#: Each entry holds its mesh and placements, so their ids name them while it is kept;
#: cleared when full. A local tensor of another type may describe its chunks itself: never kept.
_DTENSOR_BOXES: dict[tuple[type, int, int, tuple[int, ...]], tuple[Any, Any, Box, bool]] = {}
_DTENSOR_BOXES_MAX = 1 << 16


def _dtensor_box(value: Any, local: torch.Tensor, fqn: str) -> Box:
    """The box a DTensor's local tensor holds (its one chunk, as DCP asks for it)."""
    mesh, placements, shape = value.device_mesh, value.placements, tuple(value.shape)
    key = (type(value), id(mesh), id(placements), shape)
    plain = type(local) in (torch.Tensor, torch.nn.Parameter)
    kept = _DTENSOR_BOXES.get(key) if plain else None
    if kept is not None:  # the same placements object: checked for Partial when kept
        return kept[2]
    from torch.distributed.tensor import Partial

    if any(isinstance(p, Partial) for p in placements):
        raise UnsupportedStateError(
            f"DTensor at key {fqn!r} has a Partial placement (pending reduction); reduce it before saving"
        )
    _check_strided(mesh, placements, fqn)
    chunks = value.__create_chunk_list__()  # public DTensor hook that DCP uses for the same purpose
    if len(chunks) != 1:
        raise UnsupportedStateError(f"DTensor at key {fqn!r} reports {len(chunks)} local chunks; expected 1")
    box = (tuple(chunks[0].offsets), tuple(chunks[0].sizes))
    if plain:
        if len(_DTENSOR_BOXES) >= _DTENSOR_BOXES_MAX:
            _DTENSOR_BOXES.clear()
        _DTENSOR_BOXES[key] = (mesh, placements, box, _replicated(mesh, placements))
    return box


def _check_strided(mesh: Any, placements: Any, fqn: str) -> None:
    """UnsupportedStateError for a strided shard (``_StridedShard``, matched by name: its
    class is private) other than FSDP2's over tensor parallel: a later ``Shard`` of the same
    dimension over mesh dimensions whose sizes multiply to its ``split_factor``. Any other
    holds rows no one box describes, and DTensor reports one box for it anyway (loads
    filled the wrong rows)."""
    for i, p in enumerate(placements):
        if type(p).__name__ != "_StridedShard":
            continue
        later = [j for j, q in enumerate(placements) if j > i and type(q).__name__ == "Shard" and q.dim == p.dim]
        if not later or getattr(p, "split_factor", None) != math.prod(mesh.size(j) for j in later):
            raise UnsupportedStateError(
                f"DTensor at key {fqn!r} has placements {tuple(placements)}: a strided shard is supported as FSDP2 "
                "makes it over tensor parallel (followed by a Shard of the same dimension over mesh dimensions "
                "whose sizes multiply to its split_factor); its local rows are not one box otherwise"
            )


def local_pieces(value: Any, fqn: str) -> LocalTensor:
    """The global shape, dtype and local pieces of a tensor-like leaf."""
    if isinstance(value, TensorShard):
        t = value.local
        return LocalTensor(value.global_shape, t.dtype, [Piece((value.offsets, tuple(t.shape)), t)], False)
    if isinstance(value, LowestRankCopy):
        t = value.local
        return LocalTensor(tuple(t.shape), t.dtype, [Piece(((0,) * t.dim(), tuple(t.shape)), t)], True)
    if isinstance(value, FlatShard):
        t = value.local
        if not t.is_contiguous():
            raise UnsupportedStateError(f"FlatShard at key {fqn!r}: the local tensor must be contiguous")
        if math.prod(value.global_shape) == 0:  # an empty tensor still needs its (empty) box
            return LocalTensor(
                value.global_shape,
                t.dtype,
                [Piece(((0,) * len(value.global_shape), value.global_shape), t.view(value.global_shape))],
                False,
            )
        pieces = []
        for (off, lens), pos in flat_range_to_boxes(value.global_shape, value.start, t.numel()):
            n = math.prod(lens)
            pieces.append(Piece((off, lens), t[pos : pos + n].view(lens)))
        return LocalTensor(value.global_shape, t.dtype, pieces, False)
    if is_dtensor(value):
        if torch.is_grad_enabled():  # the local tensor itself: no autograd node made (5 us a tensor)
            with torch.no_grad():
                local = value.to_local()
        else:
            local = value.to_local()
        off, sizes = _dtensor_box(value, local, fqn)
        if tuple(local.shape) != sizes:
            raise UnsupportedStateError(
                f"DTensor at key {fqn!r}: local shape {list(local.shape)} != chunk {list(sizes)}"
            )
        return LocalTensor(tuple(value.shape), value.dtype, [Piece((off, sizes), local)], False)
    if isinstance(value, torch.Tensor):
        return LocalTensor(
            tuple(value.shape), value.dtype, [Piece(((0,) * value.dim(), tuple(value.shape)), value)], True
        )
    raise TypeError(f"not a tensor-like value at {fqn!r}: {type(value).__name__}")
