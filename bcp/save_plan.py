"""The coordinator's save plan (pure; no process group, no I/O).

Every rank sends a :class:`LocalLayout`: its tensors' metadata (encoded once, the same
bytes on ranks holding the same tensors) and the boxes it holds as flat integer
arrays. The coordinator checks that ranks agree on each tensor, that the distinct
boxes tile the tensor exactly (no gap, no partial overlap), writes each distinct box
once, and spreads replicated boxes over their holders so bytes per rank are balanced
(largest box to the least-loaded holder).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from bcp.metadata import itemsize
from bcp.metadata.catalog import tiling_problem

from .boxes import Box
from .errors import ShardingError

#: Box values are stored as int32 when every offset and offset + length fits.
_INT32_MAX = (1 << 31) - 1
#: Largest dimension or element count a layout may declare (products stay inside int64).
_MAX_EXTENT = 1 << 62


@dataclasses.dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor as one rank holds it."""

    fqn: str
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    #: an earlier FQN whose local memory is this very tensor (tied weights), else None
    alias_of: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LocalPlan:
    """Superseded by :class:`LocalLayout` (kept for callers not yet moved)."""

    rank: int
    tensors: tuple[TensorPlan, ...]


@dataclasses.dataclass(frozen=True)
class LayoutMeta:
    """The decoded ``meta`` of a layout: per tensor, in the rank's order."""

    fqns: tuple[str, ...]
    key_paths: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    aliases: tuple[str | None, ...]

    @classmethod
    def of(cls, tensors: Sequence[TensorPlan]) -> LayoutMeta:
        return cls(
            tuple(t.fqn for t in tensors),
            tuple(t.key_path for t in tensors),
            tuple(t.dtype for t in tensors),
            tuple(tuple(int(s) for s in t.global_shape) for t in tensors),
            tuple(t.alias_of for t in tensors),
        )

    def encode(self) -> bytes:
        rows = [
            [f, k, d, list(s), a]
            for f, k, d, s, a in zip(self.fqns, self.key_paths, self.dtypes, self.shapes, self.aliases, strict=True)
        ]
        return json.dumps(rows, separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> LayoutMeta:
        """Parse and validate (a layout is a message from another process: check it)."""
        try:
            rows = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ShardingError(f"a rank's layout metadata is not valid JSON: {e}") from None
        if not isinstance(rows, list):
            raise ShardingError("a rank's layout metadata is not a list of tensors")
        fqns, paths, dtypes, shapes, aliases = [], [], [], [], []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 5):
                raise ShardingError(f"a rank's layout metadata has a malformed tensor entry {row!r:.200}")
            fqn, path, dtype, shape, alias = row
            if not (isinstance(fqn, str) and isinstance(path, str) and isinstance(dtype, str)):
                raise ShardingError(f"a rank's layout metadata has a malformed tensor entry {row!r:.200}")
            if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < _MAX_EXTENT for s in shape):
                raise ShardingError(f"tensor {fqn!r}: invalid global shape {shape!r:.200} in a rank's layout")
            if math.prod(shape) >= _MAX_EXTENT:
                raise ShardingError(f"tensor {fqn!r}: global shape {shape} is too large")
            if alias is not None and not isinstance(alias, str):
                raise ShardingError(f"tensor {fqn!r}: invalid alias {alias!r:.200} in a rank's layout")
            try:
                itemsize(dtype)
            except ValueError as e:
                raise ShardingError(f"tensor {fqn!r}: {e}") from None
            fqns.append(fqn)
            paths.append(path)
            dtypes.append(dtype)
            shapes.append(tuple(shape))
            aliases.append(alias)
        if len(set(fqns)) != len(fqns):
            raise ShardingError("a rank's layout metadata names a tensor twice")
        return cls(tuple(fqns), tuple(paths), tuple(dtypes), tuple(shapes), tuple(aliases))

    @functools.cached_property
    def ndims(self) -> np.ndarray:
        return np.array([len(s) for s in self.shapes], dtype=np.int64)


def _meta_digest(meta: bytes) -> bytes:
    return hashlib.blake2b(meta, digest_size=16).digest()


def _box_array(values: np.ndarray) -> np.ndarray:
    return values.astype(np.int64 if values.dtype == np.int64 else np.int32, copy=False)


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """What one rank sends the coordinator: compact, no per-box Python objects.

    ``meta`` encodes the rank's tensors (fqn, key_path, dtype, global_shape, alias_of)
    and is byte-identical on ranks holding the same tensors, so the coordinator needs
    it once per ``meta_digest``. Box ``i`` of the rank is its i-th box in flat order:
    tensor by tensor (meta order), box by box; ``offsets`` and ``lengths`` hold ndim
    values per box.
    """

    rank: int
    meta: bytes
    meta_digest: bytes
    #: int32[T]: boxes per tensor, in meta order
    counts: np.ndarray
    #: int32 when every offset + length fits, else int64; flat, ndim values per box
    offsets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def build(cls, rank: int, tensors: Sequence[TensorPlan]) -> LocalLayout:
        meta = LayoutMeta.of(tensors).encode()
        counts = np.fromiter((len(t.boxes) for t in tensors), dtype=np.int32, count=len(tensors))
        offs = np.array([v for t in tensors for b in t.boxes for v in b[0]], dtype=np.int64)
        lens = np.array([v for t in tensors for b in t.boxes for v in b[1]], dtype=np.int64)
        fits = not len(offs) or (
            int(offs.min()) > -_INT32_MAX and int(lens.min()) > -_INT32_MAX and int((offs + lens).max()) <= _INT32_MAX
        )
        if fits:
            offs, lens = offs.astype(np.int32), lens.astype(np.int32)
        return cls(rank, meta, _meta_digest(meta), counts, offs, lens)

    def without_meta(self) -> LocalLayout:
        """The same layout with ``meta`` left out (the coordinator has it by digest)."""
        return dataclasses.replace(self, meta=b"")

    def digest(self) -> bytes:
        """16 bytes, equal iff the layouts (meta and boxes) are equal."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.meta_digest)
        for a in (self.counts, self.offsets, self.lengths):
            h.update(len(a).to_bytes(8, "little"))
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.digest()

    @functools.cached_property
    def decoded(self) -> LayoutMeta:
        if not self.meta:
            raise ValueError(f"rank {self.rank}'s layout carries no meta (pass it to plan_save by digest)")
        return LayoutMeta.decode(self.meta)

    def boxes(self) -> list[tuple[str, Box]]:
        """(fqn, box) in flat order: index i is box i."""
        meta = self.decoded
        out: list[tuple[str, Box]] = []
        offs, lens = self.offsets.tolist(), self.lengths.tolist()
        at = 0
        for fqn, shape, n in zip(meta.fqns, meta.shapes, self.counts.tolist(), strict=True):
            nd = len(shape)
            for _ in range(n):
                out.append((fqn, (tuple(offs[at : at + nd]), tuple(lens[at : at + nd]))))
                at += nd
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class GlobalPlan:
    #: rank -> indices into that rank's flat box list (LocalLayout.boxes()), ascending
    writes: dict[int, np.ndarray]
    #: rank -> bytes it writes
    bytes_per_rank: dict[int, int]
    tensors: int
    total_bytes: int


def _describe(box: Box) -> str:
    return f"offsets={list(box[0])} lengths={list(box[1])}"


def _resolve_meta(
    layouts: Sequence[LocalLayout], meta: Mapping[bytes, bytes | LayoutMeta] | None
) -> dict[bytes, LayoutMeta]:
    """Decode each distinct meta once (checked against its digest)."""
    out: dict[bytes, LayoutMeta] = {}
    for layout in layouts:
        d = layout.meta_digest
        if d in out:
            continue
        given = meta.get(d) if meta is not None else None
        if isinstance(given, LayoutMeta):
            out[d] = given
            continue
        raw = layout.meta or given
        if not raw:
            raise ShardingError(f"rank {layout.rank}: no layout metadata for digest {d.hex()}")
        if _meta_digest(raw) != d:
            raise ShardingError(f"rank {layout.rank}: layout metadata does not match its digest")
        out[d] = LayoutMeta.decode(raw)
    return out


def _check_layout(layout: LocalLayout, m: LayoutMeta) -> None:
    if layout.counts.shape != (len(m.fqns),) or (len(layout.counts) and int(layout.counts.min()) < 0):
        raise ShardingError(f"rank {layout.rank}: layout counts do not match its {len(m.fqns)} tensors")
    want = int((layout.counts.astype(np.int64) * m.ndims).sum())
    if layout.offsets.shape != (want,) or layout.lengths.shape != (want,):
        raise ShardingError(f"rank {layout.rank}: layout has box arrays of the wrong size (want {want} values)")


def plan_save(layouts: Sequence[LocalLayout], *, meta: Mapping[bytes, bytes | LayoutMeta] | None = None) -> GlobalPlan:
    """Deduplicate, validate and balance (runs on the coordinator). ``layouts[i]`` is
    rank i's. ``meta`` maps meta digests to meta bytes (or decoded LayoutMeta) for
    layouts sent without their meta."""
    world = len(layouts)
    metas = _resolve_meta(layouts, meta)
    info: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
    holders: dict[str, dict[Box, list[tuple[int, int]]]] = {}
    alias_seen: dict[str, set[str | None]] = {}
    for rank, layout in enumerate(layouts):
        m = metas[layout.meta_digest]
        _check_layout(layout, m)
        offs, lens = layout.offsets.tolist(), layout.lengths.tolist()
        at = index = 0
        for fqn, path, dtype, shape, alias, n in zip(
            m.fqns, m.key_paths, m.dtypes, m.shapes, m.aliases, layout.counts.tolist(), strict=True
        ):
            seen = info.get(fqn)
            if seen is None:
                info[fqn] = (path, dtype, shape, rank)
                holders[fqn] = {}
            elif seen[:3] != (path, dtype, shape):
                raise ShardingError(
                    f"tensor {fqn!r}: rank {seen[3]} has {seen[1]}{list(seen[2])} but rank {rank} has "
                    f"{dtype}{list(shape)}"
                )
            alias_seen.setdefault(fqn, set()).add(alias)
            nd = len(shape)
            for _ in range(n):
                box = (tuple(offs[at : at + nd]), tuple(lens[at : at + nd]))
                holders[fqn].setdefault(box, []).append((rank, index))
                at += nd
                index += 1

    for fqn, boxes in holders.items():
        check_tiling(fqn, info[fqn][2], list(boxes))
    aliases = _consistent_aliases(alias_seen, holders)

    load = [0] * world
    chosen: list[list[int]] = [[] for _ in range(world)]
    owner: dict[tuple[str, Box], int] = {}
    replicated: list[tuple[int, int, Box, list[tuple[int, int]]]] = []
    for tid, (fqn, boxes) in enumerate(holders.items()):
        if fqn in aliases:
            continue
        size = itemsize(info[fqn][1])
        for box, where in boxes.items():
            nbytes = math.prod(box[1]) * size
            if len(where) == 1:
                rank, index = where[0]
                load[rank] += nbytes
                chosen[rank].append(index)
                owner[(fqn, box)] = rank
            else:
                replicated.append((nbytes, tid, box, where))
    # Replicated boxes: largest first, each to its least-loaded holder (LPT), ties by rank.
    replicated.sort(key=lambda it: (-it[0], it[1], it[2]))
    names = list(holders)
    for nbytes, tid, box, where in replicated:
        rank, index = min(where, key=lambda ri: (load[ri[0]], ri[0]))
        load[rank] += nbytes
        chosen[rank].append(index)
        owner[(names[tid], box)] = rank
    # Tied tensors go to the rank writing their target, which stores the bytes once.
    for fqn, target in aliases.items():
        for box, where in holders[fqn].items():
            r = owner[(target, box)]
            mine = [i for rr, i in where if rr == r]
            rank, index = (r, mine[0]) if mine else min(where)
            chosen[rank].append(index)
    writes = {r: np.array(sorted(c), dtype=np.int32) for r, c in enumerate(chosen)}
    return GlobalPlan(writes=writes, bytes_per_rank=dict(enumerate(load)), tensors=len(info), total_bytes=sum(load))


def _overlapping_pair(offs: np.ndarray, lens: np.ndarray, limit: int = 1 << 24) -> tuple[int, int] | None:
    """Two rows whose boxes share an element, or None (also when more than ``limit``
    candidate pairs would need comparing). Sort-and-sweep on the dimension with the
    fewest candidate pairs: sorted by start, box i can only meet the boxes before it
    whose running maximum end exceeds its start (a window found with searchsorted)."""
    best = None
    for k in range(offs.shape[1]):
        order = np.argsort(offs[:, k], kind="stable")
        start = offs[order, k]
        reach = np.maximum.accumulate(start + lens[order, k])
        first = np.searchsorted(reach, start, side="right")
        pairs = int(np.clip(np.arange(len(start)) - first, 0, None).sum())
        if best is None or pairs < best[0]:
            best = (pairs, order, first)
    if best is None or best[0] > limit:
        return None
    _pairs, order, first = best
    o, n = offs[order], lens[order]
    width = np.clip(np.arange(len(order)) - first, 0, None)
    rows = np.flatnonzero(width)
    w = width[rows]
    a = np.repeat(rows, w)
    b = np.repeat(first[rows], w) + (np.arange(len(a)) - np.repeat(np.cumsum(w) - w, w))
    hit = np.flatnonzero((np.maximum(o[a], o[b]) < np.minimum(o[a] + n[a], o[b] + n[b])).all(axis=1))
    if not len(hit):
        return None
    return int(order[b[hit[0]]]), int(order[a[hit[0]]])


def tiling_error(fqn: str, shape: tuple[int, ...], offs: np.ndarray, lens: np.ndarray) -> str | None:
    """Why the boxes (rows of 2-D int64 arrays) do not tile ``shape``, or None when they do:
    a box outside the shape, two overlapping boxes, or a part held by nobody."""
    nd = len(shape)
    if nd:
        bad = np.flatnonzero(((offs < 0) | (lens < 0) | (lens > np.array(shape, dtype=np.int64) - offs)).any(axis=1))
        if len(bad):
            box = (tuple(offs[bad[0]].tolist()), tuple(lens[bad[0]].tolist()))
            return f"tensor {fqn!r}: shard {_describe(box)} lies outside the global shape {list(shape)}"
    problem = tiling_problem(shape, offs, lens)
    if (problem is None and len(offs)) or math.prod(shape) == 0:
        return None
    uniq = np.unique(np.concatenate([offs, lens], axis=1), axis=0) if nd else np.zeros((len(offs[:1]), 0), np.int64)
    u_offs, u_lens = uniq[:, :nd], uniq[:, nd:]
    live = (u_lens > 0).all(axis=1)
    pair = _overlapping_pair(u_offs[live], u_lens[live]) if nd and live.sum() > 1 else None
    if pair is not None:
        a, b = (np.flatnonzero(live)[i] for i in pair)
        box_a = (tuple(u_offs[a].tolist()), tuple(u_lens[a].tolist()))
        box_b = (tuple(u_offs[b].tolist()), tuple(u_lens[b].tolist()))
        return (
            f"tensor {fqn!r}: shards {_describe(box_a)} and {_describe(box_b)} overlap but are not identical "
            "(replicas must hold exactly the same box)"
        )
    have, want = sum(np.prod(u_lens[live], axis=1).tolist()) if nd else len(uniq), math.prod(shape)
    if have != want:
        return (
            f"tensor {fqn!r}: shards cover {have} of its {want} elements (global shape {list(shape)}); "
            "some part of the tensor is held by no rank"
        )
    return f"tensor {fqn!r}: {problem}"


def check_tiling(fqn: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    """Raise ShardingError unless the distinct ``boxes`` tile ``shape`` exactly."""
    nd = len(shape)
    offs = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    lens = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    problem = tiling_error(fqn, shape, offs, lens)
    if problem is not None:
        raise ShardingError(problem)


def _consistent_aliases(
    seen: Mapping[str, set[str | None]], boxes: Mapping[str, Mapping[Box, object]]
) -> dict[str, str]:
    """FQN -> target FQN for tensors that every holder reports as the same memory as
    the target, box for box (tied embeddings); anything inconsistent is written normally."""
    out: dict[str, str] = {}
    for fqn, targets in seen.items():
        if len(targets) != 1:
            continue
        target = next(iter(targets))
        if target is not None and target in boxes and target not in out and set(boxes[fqn]) <= set(boxes[target]):
            out[fqn] = target
    return out


__all__ = ["GlobalPlan", "LayoutMeta", "LocalLayout", "LocalPlan", "TensorPlan", "check_tiling", "plan_save"]
