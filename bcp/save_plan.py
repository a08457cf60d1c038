"""The coordinator's save plan (pure; no process group, no I/O).

Every rank sends a :class:`LocalLayout`: its tensors' metadata (encoded once, the same
bytes on ranks holding the same tensors) and the boxes it holds as flat integer
arrays. The coordinator checks that ranks agree on each tensor, that the distinct
boxes tile the tensor exactly (no gap, no partial overlap), writes each distinct box
once, and spreads replicated boxes over their holders so bytes per rank are balanced
(largest box to the least-loaded holder).

Boxes stay in numpy arrays throughout (no per-box Python objects). FSDP layouts (one
box per tensor per rank) take a sort-free pass over the (rank x tensor) matrix,
linear in the boxes; anything else sorts the boxes once (O(F log F)). Tiling is
exact for any layout: intervals on the one cut dimension where there is one,
metadata.catalog.tiling_problem (box corners) otherwise, never a quadratic sweep.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
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
        """16 bytes, equal iff the layouts (meta and boxes) are equal (``build`` picks
        the box dtype from the values, so equal layouts have equal arrays)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.meta_digest)
        for a in (self.counts, self.offsets, self.lengths):
            h.update(f"{a.dtype.str}:{len(a)};".encode())
            h.update(np.ascontiguousarray(a).data)
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
    #: (int32, read-only: ranks' lists may be views of one shared array)
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


def _check_layouts(layouts: Sequence[LocalLayout], metas: Mapping[bytes, LayoutMeta]) -> bool:
    """Check every layout's arrays against its meta; returns whether every rank holds
    one box of each of its tensors. Ranks usually repeat their neighbour's counts:
    those are compared as bytes, not summed again."""
    last: tuple[bytes, bytes, int] | None = None
    one_each = True
    for rank, layout in enumerate(layouts):
        if layout.rank != rank:
            raise ShardingError(f"rank {rank}'s layout says it is rank {layout.rank}")
        counts = layout.counts
        for a in (counts, layout.offsets, layout.lengths):
            if not (type(a) is np.ndarray and a.ndim == 1 and a.dtype in _BOX_DTYPES):
                raise ShardingError(f"rank {rank}: layout arrays must be 1-D int32 or int64")
        key = counts.tobytes()
        if last is not None and last[0] == layout.meta_digest and last[1] == key:
            want = last[2]
        else:
            m = metas[layout.meta_digest]
            if counts.shape != (len(m.fqns),) or (len(counts) and int(counts.min()) < 0):
                raise ShardingError(f"rank {rank}: layout counts do not match its {len(m.fqns)} tensors")
            want = int((counts.astype(np.int64) * m.ndims).sum())
            one_each = one_each and bool((counts == 1).all())
            last = (layout.meta_digest, key, want)
        if len(layout.offsets) != want or len(layout.lengths) != want:
            raise ShardingError(f"rank {rank}: layout has box arrays of the wrong size (want {want} values)")
    return one_each


_BOX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def plan_save(
    layouts: Sequence[LocalLayout], *, meta: Mapping[bytes, bytes | LayoutMeta] | None = None, matrix: bool = True
) -> GlobalPlan:
    """Deduplicate, validate and balance (runs on the coordinator). ``layouts[i]`` is
    rank i's. ``meta`` maps meta digests to meta bytes (or decoded LayoutMeta) for
    layouts sent without their meta. ``matrix=False`` forces the general path (the
    tests compare the two).

    Columnar: boxes stay in numpy arrays. When every rank holds the same tensors, one
    box each and nothing is tied (FSDP), a sort-free pass over the (rank x tensor)
    matrix plans the tensors cut along one dimension in rank order; the rest (and
    every other layout) goes through the general path, which sorts boxes to find the
    distinct ones and their holders. LPT runs only over boxes with several holders.
    """
    world = len(layouts)
    metas = _resolve_meta(layouts, meta)
    one_each = _check_layouts(layouts, metas)
    table, local_gid = _tensor_table(layouts, metas)
    acc = _Assignments(world)
    m = metas[layouts[0].meta_digest] if world else None
    if matrix and m is not None and len(metas) == 1 and not table.has_alias and one_each:
        fallback = _plan_matrix(layouts, m, table, acc)
        if len(fallback):
            _plan_general(*_gather_matrix(layouts, m, table, fallback), table, acc)
    else:
        _plan_general(*_gather_all(layouts, metas, local_gid, table), table, acc, everything=True)
    return acc.finish(table)


@dataclasses.dataclass
class _Table:
    """The job's tensors, in order of first appearance (rank order, then each rank's)."""

    fqns: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    #: (G,) bytes per element; (G,) element counts
    isz: np.ndarray
    total: np.ndarray
    #: (G, D) shape padded with 1 to the largest ndim D
    spad: np.ndarray
    #: gid -> every alias_of its holders report (only when some tensor is tied)
    alias_seen: dict[int, set[str | None]]
    has_alias: bool


def _tensor_table(
    layouts: Sequence[LocalLayout], metas: Mapping[bytes, LayoutMeta]
) -> tuple[_Table, dict[bytes, np.ndarray]]:
    """Merge each distinct meta once; ranks must agree on every tensor they share."""
    index: dict[str, int] = {}
    info: list[tuple[str, str, tuple[int, ...], int]] = []
    local_gid: dict[bytes, np.ndarray] = {}
    has_alias = any(a is not None for m in metas.values() for a in m.aliases)
    alias_seen: dict[int, set[str | None]] = {}
    for rank, layout in enumerate(layouts):
        d = layout.meta_digest
        if d in local_gid:
            continue
        m = metas[d]
        gids = np.empty(len(m.fqns), dtype=np.int64)
        for i, (fqn, path, dtype, shape) in enumerate(zip(m.fqns, m.key_paths, m.dtypes, m.shapes, strict=True)):
            g = index.get(fqn)
            if g is None:
                g = index[fqn] = len(info)
                info.append((path, dtype, shape, rank))
            else:
                seen = info[g]
                if seen[:3] != (path, dtype, shape):
                    raise ShardingError(
                        f"tensor {fqn!r}: rank {seen[3]} has {seen[1]}{list(seen[2])} but rank {rank} has "
                        f"{dtype}{list(shape)}"
                    )
            gids[i] = g
            if has_alias:
                alias_seen.setdefault(g, set()).add(m.aliases[i])
        local_gid[d] = gids
    shapes = [s for _p, _d, s, _r in info]
    dims = max((len(s) for s in shapes), default=0)
    spad = np.ones((len(shapes), dims), dtype=np.int64)
    for g, s in enumerate(shapes):
        spad[g, : len(s)] = s
    isz = np.array([itemsize(d) for _p, d, _s, _r in info], dtype=np.int64)
    total = np.array([math.prod(s) for s in shapes], dtype=np.int64)
    if sum(t * i for t, i in zip(total.tolist(), isz.tolist(), strict=True)) >= _MAX_EXTENT:
        raise ShardingError("the tensors hold more bytes than a checkpoint can describe")
    table = _Table(list(index), [d for _p, d, _s, _r in info], shapes, isz, total, spad, alias_seen, has_alias)
    return table, local_gid


class _Assignments:
    """What each rank writes and the bytes it carries, filled in by the paths."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.load = np.zeros(world, dtype=np.int64)
        #: the matrix path's (rank x tensor) "writes its own box" mask and the tensors of its columns
        self.mask: np.ndarray | None = None
        self.mask_tensors: np.ndarray | None = None
        #: (rank, index) pairs written
        self.ranks: list[np.ndarray] = []
        self.indices: list[np.ndarray] = []
        #: boxes with several holders: (nbytes, gid, order, holder ranks, holder indices)
        self.replicated: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []
        #: zero-byte boxes with several holders: any holder is as good, the least loaded wins
        self.zero_ranks: list[np.ndarray] = []
        self.zero_indices: list[np.ndarray] = []
        self.zero_counts: list[np.ndarray] = []
        #: matrix columns whose empty boxes (one box, many holders) go to the least loaded
        self.empty_columns: np.ndarray | None = None
        #: boxes of tied tensors, placed once the rest is: ((holder ranks, indices), the
        #: same for the target's same box)
        self.aliases: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]] = []

    def fixed(self, ranks: np.ndarray, indices: np.ndarray, nbytes: np.ndarray) -> None:
        if len(ranks):
            self.ranks.append(ranks.astype(np.int64, copy=False))
            self.indices.append(indices.astype(np.int64, copy=False))
            np.add.at(self.load, ranks, nbytes)

    def _lpt(self) -> None:
        """Largest first, each to its least-loaded holder (ties by rank)."""
        if not self.replicated:
            return
        self.replicated.sort(key=lambda it: (-it[0], it[1], it[2]))
        load = self.load.tolist()
        world = self.world
        heap: list[tuple[int, int]] | None = None
        out_r, out_i = [], []
        for nbytes, _g, _o, hr, hi in self.replicated:
            if len(hr) == world and world > 1 and hr[0] == 0 and hr[-1] == world - 1 and _distinct(hr):
                if heap is None:
                    heap = [(v, r) for r, v in enumerate(load)]
                    heapq.heapify(heap)
                while True:  # lazy heap: skip entries made stale by later assignments
                    cur, r = heapq.heappop(heap)
                    if cur == load[r]:
                        break
                j = int(np.searchsorted(hr, r))
            else:
                ranks = hr.tolist()
                j = min(range(len(ranks)), key=lambda x: (load[ranks[x]], ranks[x]))
                r = ranks[j]
            load[r] += nbytes
            if heap is not None:
                heapq.heappush(heap, (load[r], r))
            out_r.append(r)
            out_i.append(int(hi[j]))
        self.load = np.array(load, dtype=np.int64)
        self.ranks.append(np.array(out_r, dtype=np.int64))
        self.indices.append(np.array(out_i, dtype=np.int64))

    def _elect_zero_byte(self) -> None:
        """Zero-byte boxes move no load: each goes to its holder with the least final
        load (ties by rank), exactly where LPT, taking them last, would put them."""
        order = np.lexsort((np.arange(self.world), self.load))
        position = np.empty(self.world, dtype=np.int64)
        position[order] = np.arange(self.world)
        if self.zero_ranks:
            hr, hi = np.concatenate(self.zero_ranks), np.concatenate(self.zero_indices)
            counts = np.concatenate(self.zero_counts)
            starts = np.cumsum(counts) - counts
            best = np.minimum.reduceat(position[hr], starts)
            winner = order[best]
            hit = np.flatnonzero(hr == np.repeat(winner, counts))
            seg = np.searchsorted(starts, hit, side="right") - 1
            _u, first = np.unique(seg, return_index=True)
            self.ranks.append(hr[hit[first]])
            self.indices.append(hi[hit[first]])
        if self.empty_columns is not None and len(self.empty_columns):
            assert self.mask is not None and self.mask_tensors is not None
            cols = self.empty_columns
            best = np.full(len(cols), self.world, dtype=np.int64)
            for a in range(0, self.world, _CHUNK):
                pos = position[a : a + _CHUNK, None]
                best = np.minimum(best, np.where(self.mask[a : a + _CHUNK][:, cols], self.world, pos).min(axis=0))
            self.ranks.append(order[best])
            self.indices.append(self.mask_tensors[cols])

    def _place_aliases(self) -> None:
        """A tied tensor's box goes to the rank writing the same box of its target
        (which stores the bytes once) when that rank holds it, else to its first holder."""
        if not self.aliases:
            return
        ranks, indices = np.concatenate(self.ranks), np.concatenate(self.indices)
        # one key per (rank, index): the radix must exceed every index looked up too,
        # or a target row's key could equal another rank's written row
        radix = 1 + max([int(indices.max()) if len(indices) else 0] + [int(ti.max()) for _h, (_tr, ti) in self.aliases])
        written = np.sort(ranks * radix + indices)
        out_r, out_i = [], []
        for (hr, hi), (tr, ti) in self.aliases:
            key = tr * radix + ti
            pos = np.minimum(np.searchsorted(written, key), len(written) - 1)
            owner = tr[written[pos] == key]
            hit = np.flatnonzero(hr == owner[0]) if len(owner) else np.zeros(0, np.int64)
            j = int(hit[0]) if len(hit) else 0
            out_r.append(int(hr[j]))
            out_i.append(int(hi[j]))
        self.ranks.append(np.array(out_r, dtype=np.int64))
        self.indices.append(np.array(out_i, dtype=np.int64))

    def finish(self, table: _Table) -> GlobalPlan:
        self._lpt()
        self._elect_zero_byte()
        self._place_aliases()
        ranks = np.concatenate(self.ranks) if self.ranks else np.zeros(0, np.int64)
        indices = np.concatenate(self.indices) if self.indices else np.zeros(0, np.int64)
        order = np.lexsort((indices, ranks))
        ranks, indices = ranks[order], indices[order].astype(np.int32)
        bounds = np.searchsorted(ranks, np.arange(self.world + 1)).tolist()
        writes: dict[int, np.ndarray] = {}
        if self.mask is not None and self.mask_tensors is not None:
            cols = self.mask_tensors.astype(np.int32)
            for a in range(0, self.world, _CHUNK):
                rows, at = np.nonzero(self.mask[a : a + _CHUNK])
                own = cols[at]  # one array per block; each rank's list is a view of it
                own.flags.writeable = False
                cuts = np.searchsorted(rows, np.arange(min(_CHUNK, self.world - a) + 1)).tolist()
                for i in range(len(cuts) - 1):
                    writes[a + i] = own[cuts[i] : cuts[i + 1]]
        else:
            empty = np.zeros(0, dtype=np.int32)
            empty.flags.writeable = False
            writes = dict.fromkeys(range(self.world), empty)
        for r in np.unique(ranks).tolist():
            extra = indices[bounds[r] : bounds[r + 1]]
            writes[r] = np.sort(np.concatenate([writes[r], extra])) if len(writes[r]) else extra
        load = self.load.tolist()
        return GlobalPlan(
            writes=writes, bytes_per_rank=dict(enumerate(load)), tensors=len(table.fqns), total_bytes=sum(load)
        )


def _distinct(ranks: np.ndarray) -> bool:
    return bool((ranks[1:] > ranks[:-1]).all())


#: General-path rows: tensor id, rank, index in the rank's box list, padded offsets, lengths.
_Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

#: Ranks per block of the matrix path (bounds its temporaries to a few times
#: _CHUNK x tensors values).
_CHUNK = 512


def _plan_matrix(layouts: Sequence[LocalLayout], m: LayoutMeta, table: _Table, acc: _Assignments) -> np.ndarray:
    """Every rank holds every tensor, one box each, nothing tied (meta order = gid order).

    Pass 1 finds, per column (tensor, dim), whether any box is not full there, and
    checks bounds. A tensor full everywhere is one box every rank holds (DDP). A tensor
    cut along one dimension is planned in pass 2 from that column alone: in rank
    order its live intervals must abut from 0 to the end (so each is held by one rank,
    who writes it) and its empty boxes must all be the same box (written once, by its
    least-loaded holder). Returns the tensors left to the general path (cut along
    several dims, replicas, out-of-order shards, errors to report)."""
    world, tensors = len(layouts), len(m.fqns)
    ndims = m.ndims
    col_t = np.repeat(np.arange(tensors), ndims)
    col_s = np.array([s for shape in m.shapes for s in shape], dtype=np.int64)
    cols = len(col_s)
    # int32 ends cannot wrap while offsets and lengths stay within shapes below 2^30
    wide = bool(cols) and int(col_s.max()) >= 1 << 30
    fallback = np.zeros(tensors, dtype=bool)
    # per column: min and max of offsets and lengths, max of ends (reductions, no temporaries)
    big = np.int64(np.iinfo(np.int64).max)
    o_min, l_min = np.full(cols, big), np.full(cols, big)
    o_max, l_max, e_max = np.full(cols, -1), np.full(cols, -1), np.full(cols, -1)
    for a in range(0, world if cols else 0, _CHUNK):
        offs, lens = _block(layouts[a : a + _CHUNK], cols)
        np.minimum(o_min, offs.min(axis=0), out=o_min)
        np.maximum(o_max, offs.max(axis=0), out=o_max)
        np.minimum(l_min, lens.min(axis=0), out=l_min)
        np.maximum(l_max, lens.max(axis=0), out=l_max)
        ends = offs.astype(np.int64) + lens if wide or offs.dtype != lens.dtype else offs + lens
        np.maximum(e_max, ends.max(axis=0), out=e_max)
    inside = (o_min >= 0) & (l_min >= 0) & (o_max <= col_s) & (l_max <= col_s) & (e_max <= col_s)
    fallback[col_t[~inside]] = True
    nonfull = ~((o_min == 0) & (o_max == 0) & (l_min == col_s) & (l_max == col_s))
    cut = np.bincount(col_t, weights=nonfull, minlength=tensors).astype(np.int64)
    total = table.total
    # full everywhere: one box, every rank holds it
    everyone = np.arange(world, dtype=np.int64)
    for t in np.flatnonzero((cut == 0) & ~fallback).tolist():
        nbytes = int(total[t] * table.isz[t])
        idx = np.full(world, t, dtype=np.int64)
        if world == 1:
            acc.fixed(everyone, idx, np.array([nbytes], dtype=np.int64))
        elif nbytes:
            acc.replicated.append((nbytes, t, 0, everyone, idx))
        else:
            acc.zero_ranks.append(everyone)
            acc.zero_indices.append(idx)
            acc.zero_counts.append(np.array([world], dtype=np.int64))
    fast = np.flatnonzero((cut == 1) & ~fallback & (total > 0))
    fallback |= (cut >= 2) | ((cut == 1) & (total == 0))
    if not len(fast):
        return np.flatnonzero(fallback)
    kcol = np.flatnonzero(nonfull & np.isin(col_t, fast))  # one per fast tensor, in tensor order
    size = col_s[kcol]
    weight = (total[fast] // size) * table.isz[fast]  # bytes per unit of length along the cut
    mask = np.zeros((world, len(fast)), dtype=bool)
    # Usually each box starts where the previous rank's box ends (empty ones included):
    # then, telescoping, every live box starts at the sum of the lengths before it, so
    # the live boxes abut in rank order; the offsets never decrease, so the empty boxes
    # are all one box iff the first and the last agree. Columns where this fails get
    # the exact test below.
    prev_end = np.zeros(len(fast), dtype=np.int64)
    shift_ok = np.ones(len(fast), dtype=bool)
    e_min, e_max = np.full(len(fast), big), np.full(len(fast), -1)  # offsets of the empty boxes
    columns = np.arange(len(fast))
    for a in range(0, world, _CHUNK):
        block_o, block_l = _block(layouts[a : a + _CHUNK], cols)
        offs, lens = block_o[:, kcol], block_l[:, kcol]
        del block_o, block_l
        live = lens > 0
        mask[a : a + len(offs)] = live
        acc.load[a : a + len(offs)] += lens @ weight
        ends = offs.astype(np.int64) + lens if wide or offs.dtype != lens.dtype else offs + lens
        shift_ok &= offs[0] == prev_end
        shift_ok &= ~(offs[1:] != ends[:-1]).any(axis=0)
        prev_end = ends[-1].astype(np.int64)
        empty = ~live
        has = empty.any(axis=0)
        first, last = np.argmax(empty, axis=0), len(offs) - 1 - np.argmax(empty[::-1], axis=0)
        e_min = np.where(has, np.minimum(e_min, offs[first, columns]), e_min)
        e_max = np.where(has, np.maximum(e_max, offs[last, columns]), e_max)
    ok = shift_ok & (prev_end == size) & ((e_max < 0) | (e_min == e_max))
    if not shift_ok.all():
        redo = np.flatnonzero(~shift_ok)
        ok[redo], e_max[redo] = _abut_exact(layouts, kcol[redo], size[redo])
    empty_ref = e_max
    if not ok.all():  # left to the general path: take back the bytes pass 2 counted for them
        bad = np.flatnonzero(~ok)
        for a in range(0, world, _CHUNK):
            lens = np.stack([lay.lengths[kcol[bad]] for lay in layouts[a : a + _CHUNK]])
            acc.load[a : a + len(lens)] -= lens @ weight[bad]
        fallback[fast[bad]] = True
        keep = np.flatnonzero(ok)
        fast, mask, empty_ref = fast[keep], mask[:, keep], empty_ref[keep]
    acc.mask, acc.mask_tensors = mask, fast
    acc.empty_columns = np.flatnonzero(empty_ref >= 0)
    return np.flatnonzero(fallback)


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


def _abut_exact(layouts: Sequence[LocalLayout], kcol: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For columns cut along one dimension: whether, in rank order, each live box starts
    at the sum of the lengths before it (empty boxes add 0) and the ends reach ``size``,
    with every empty box the same; and the empty boxes' offset (-1: none)."""
    big = np.int64(np.iinfo(np.int64).max)
    before = np.zeros(len(kcol), dtype=np.int64)
    ok = np.ones(len(kcol), dtype=bool)
    e_min, e_max = np.full(len(kcol), big), np.full(len(kcol), -1)
    for a in range(0, len(layouts), _CHUNK):
        chunk = layouts[a : a + _CHUNK]
        offs = np.stack([lay.offsets[kcol] for lay in chunk]).astype(np.int64)
        lens = np.stack([lay.lengths[kcol] for lay in chunk]).astype(np.int64)
        live = lens > 0
        upto = np.cumsum(lens, axis=0)
        upto += before
        before = upto[-1].copy()
        upto -= lens
        ok &= ~((offs != upto) & live).any(axis=0)
        np.minimum(e_min, np.where(live, big, offs).min(axis=0), out=e_min)
        np.maximum(e_max, np.where(live, -1, offs).max(axis=0), out=e_max)
    return ok & (before == size) & ((e_max < 0) | (e_min == e_max)), e_max


def _block(layouts: Sequence[LocalLayout], cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The (ranks x values) offsets and lengths of ranks holding the same number of values."""
    offs = np.concatenate([lay.offsets for lay in layouts]).reshape(len(layouts), cols)
    lens = np.concatenate([lay.lengths for lay in layouts]).reshape(len(layouts), cols)
    return offs, lens


def _gather_matrix(layouts: Sequence[LocalLayout], m: LayoutMeta, table: _Table, tensors: np.ndarray) -> _Rows:
    """The boxes of the given tensors on every rank (one box each), as general-path rows."""
    ndims = m.ndims
    starts = np.cumsum(ndims) - ndims
    cols = int(ndims.sum())
    dims = table.spad.shape[1]
    world = len(layouts)
    per = len(tensors)
    gid = np.tile(tensors.astype(np.int64), world)
    rank = np.repeat(np.arange(world, dtype=np.int64), per)
    offs = np.zeros((world, per, dims), dtype=np.int64)
    lens = np.ones((world, per, dims), dtype=np.int64)
    for a in range(0, world if cols else 0, _CHUNK):
        block_o, block_l = _block(layouts[a : a + _CHUNK], cols)
        for d in range(dims):
            sel = np.flatnonzero(ndims[tensors] > d)
            offs[a : a + len(block_o), sel, d] = block_o[:, starts[tensors[sel]] + d]
            lens[a : a + len(block_l), sel, d] = block_l[:, starts[tensors[sel]] + d]
    return gid, rank, gid.copy(), offs.reshape(-1, dims), lens.reshape(-1, dims)


def _gather_all(
    layouts: Sequence[LocalLayout],
    metas: Mapping[bytes, LayoutMeta],
    local_gid: Mapping[bytes, np.ndarray],
    table: _Table,
) -> _Rows:
    """Every box of every rank as rows: tensor, rank, index in the rank's list, padded box."""
    dims = table.spad.shape[1]
    gids: list[np.ndarray] = []
    nds: list[np.ndarray] = []
    flats_o: list[np.ndarray] = []
    flats_l: list[np.ndarray] = []
    sizes: list[int] = []
    for layout in layouts:
        m = metas[layout.meta_digest]
        counts = layout.counts.astype(np.int64)
        gids.append(np.repeat(local_gid[layout.meta_digest], counts))
        nds.append(np.repeat(m.ndims, counts))
        sizes.append(int(counts.sum()))
        flats_o.append(layout.offsets)
        flats_l.append(layout.lengths)
    gid = np.concatenate(gids) if gids else np.zeros(0, np.int64)
    nd = np.concatenate(nds) if nds else np.zeros(0, np.int64)
    rank = np.repeat(np.arange(len(layouts), dtype=np.int64), sizes)
    index = np.arange(len(gid), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    flat_o = np.concatenate(flats_o).astype(np.int64) if flats_o else np.zeros(0, np.int64)
    flat_l = np.concatenate(flats_l).astype(np.int64) if flats_l else np.zeros(0, np.int64)
    if len(gid) and (nd == dims).all():
        return gid, rank, index, flat_o.reshape(len(gid), dims), flat_l.reshape(len(gid), dims)
    offs = np.zeros((len(gid), dims), dtype=np.int64)
    lens = np.ones((len(gid), dims), dtype=np.int64)
    start = np.cumsum(nd) - nd
    for d in range(dims):
        sel = np.flatnonzero(nd > d)
        offs[sel, d] = flat_o[start[sel] + d]
        lens[sel, d] = flat_l[start[sel] + d]
    return gid, rank, index, offs, lens


def _plan_general(
    gid: np.ndarray,
    rank: np.ndarray,
    index: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    table: _Table,
    acc: _Assignments,
    *,
    everything: bool = False,
) -> None:
    """Any layout: sort the boxes to find the distinct ones and their holders, check
    each tensor's distinct boxes tile it, then record single-holder boxes and queue
    the replicated ones for LPT. Rows come in rank order (holders ascend);
    ``everything``: they are all the boxes of every tensor (a tensor with none is a gap)."""
    n = len(offs)
    shape = table.spad[gid]
    bad_rows = ((offs < 0) | (lens < 0) | (lens > shape - offs)).any(axis=1)
    failing: set[int] = set(np.unique(gid[bad_rows]).tolist()) if bad_rows.any() else set()
    varying = np.flatnonzero(((offs != 0) | (lens != shape)).any(axis=0)) if n else np.zeros(0, np.int64)
    del shape
    keys = [lens[:, k] for k in varying[::-1]] + [offs[:, k] for k in varying[::-1]] + [gid]
    order = np.lexsort(keys) if n else np.zeros(0, np.int64)
    g_sorted = gid[order]
    new = np.ones(n, dtype=bool)
    if n > 1:
        diff = g_sorted[1:] != g_sorted[:-1]
        for k in varying.tolist():
            col_o, col_l = offs[order, k], lens[order, k]
            diff |= (col_o[1:] != col_o[:-1]) | (col_l[1:] != col_l[:-1])
        new[1:] = diff
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, n))
    rep = order[starts]
    g_gid = gid[rep]
    g_offs, g_lens = offs[rep], lens[rep]
    # tiling, per tensor, over its distinct boxes
    present = np.unique(g_gid)
    missing = np.setdiff1d(np.arange(len(table.fqns)), present) if everything else np.zeros(0, np.int64)
    failing.update(missing[table.total[missing] > 0].tolist())
    failing.update(_tiling_failures(g_gid, g_offs, g_lens, table) - failing)
    if failing:
        g = min(failing)
        sel = g_gid == g
        nd = len(table.shapes[g])
        problem = tiling_error(table.fqns[g], table.shapes[g], g_offs[sel, :nd], g_lens[sel, :nd])
        raise ShardingError(problem or f"tensor {table.fqns[g]!r}: its shards do not tile it")
    nbytes = g_lens.prod(axis=1) * table.isz[g_gid]
    alias_groups = np.zeros(len(starts), dtype=bool)
    if table.has_alias:
        alias_groups = _queue_aliases(g_gid, g_offs, g_lens, starts, counts, order, rank, index, table, acc)
    single = (counts == 1) & ~alias_groups
    acc.fixed(rank[rep[single]], index[rep[single]], nbytes[single])
    multi = np.flatnonzero((counts > 1) & ~alias_groups)
    heavy = multi[nbytes[multi] > 0]
    for j, nb, g in zip(heavy.tolist(), nbytes[heavy].tolist(), g_gid[heavy].tolist(), strict=True):
        rows = order[starts[j] : starts[j] + counts[j]]
        acc.replicated.append((nb, g, j, rank[rows], index[rows]))
    light = multi[nbytes[multi] == 0]
    if len(light):
        seg = np.concatenate([order[starts[j] : starts[j] + counts[j]] for j in light.tolist()])
        acc.zero_ranks.append(rank[seg])
        acc.zero_indices.append(index[seg])
        acc.zero_counts.append(counts[light])


def _tiling_failures(g_gid: np.ndarray, g_offs: np.ndarray, g_lens: np.ndarray, table: _Table) -> set[int]:
    """Tensors whose distinct boxes (sorted by tensor, then offsets) do not tile them.
    Vectorised for tensors cut along at most one dimension; tiling_problem per tensor
    for the rest."""
    if not len(g_gid):
        return set()
    starts = np.flatnonzero(np.append(True, g_gid[1:] != g_gid[:-1]))
    tensors = g_gid[starts]
    partial = (g_offs != 0) | (g_lens != table.spad[g_gid])
    cut_dims = np.logical_or.reduceat(partial, starts, axis=0)
    cut = cut_dims.sum(axis=1)
    out: set[int] = set()
    # one cut dim: the live intervals, in order, abut from 0 to the end
    one = (cut == 1) & (table.total[tensors] > 0)
    if one.any():
        k_of = np.argmax(cut_dims, axis=1)
        group_t = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(g_gid))))
        sel = np.flatnonzero(one[group_t] & (g_lens > 0).all(axis=1))
        t_of = group_t[sel]
        k = k_of[t_of]
        begin, end = g_offs[sel, k], g_offs[sel, k] + g_lens[sel, k]
        first = np.append(True, t_of[1:] != t_of[:-1])
        last = np.append(t_of[1:] != t_of[:-1], True)
        size = table.spad[tensors[t_of], k]
        wrong = (first & (begin != 0)) | (last & (end != size))
        wrong[1:] |= ~first[1:] & (begin[1:] != end[:-1])
        has_live = np.zeros(len(starts), dtype=bool)
        has_live[t_of] = True
        out.update(tensors[np.unique(t_of[wrong])].tolist())
        out.update(tensors[one & ~has_live].tolist())
    for t in np.flatnonzero(cut >= 2).tolist():
        g = int(tensors[t])
        lo, hi = starts[t], starts[t + 1] if t + 1 < len(starts) else len(g_gid)
        nd = len(table.shapes[g])
        if tiling_problem(table.shapes[g], g_offs[lo:hi, :nd], g_lens[lo:hi, :nd]) is not None:
            out.add(g)
    return out


def _queue_aliases(
    g_gid: np.ndarray,
    g_offs: np.ndarray,
    g_lens: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    order: np.ndarray,
    rank: np.ndarray,
    index: np.ndarray,
    table: _Table,
    acc: _Assignments,
) -> np.ndarray:
    """Tensors every holder reports as the same memory as one target, box for box
    (tied embeddings): queue their boxes to follow the target's; anything
    inconsistent is written normally. Returns the groups queued."""
    by_tensor: dict[int, dict[Box, int]] = {}
    for j, g in enumerate(g_gid.tolist()):
        nd = len(table.shapes[g])
        box = (tuple(g_offs[j, :nd].tolist()), tuple(g_lens[j, :nd].tolist()))
        by_tensor.setdefault(g, {})[box] = j
    gid_of = {f: g for g, f in enumerate(table.fqns)}
    targets: dict[int, int] = {}
    for g, seen in table.alias_seen.items():
        if len(seen) != 1 or g not in by_tensor:
            continue
        name = next(iter(seen))
        t = gid_of.get(name) if name is not None else None
        if t is None or t not in by_tensor or t in targets or not set(by_tensor[g]) <= set(by_tensor[t]):
            continue
        targets[g] = t
    queued = np.zeros(len(g_gid), dtype=bool)
    for g, t in targets.items():
        for box, j in by_tensor[g].items():
            k = by_tensor[t][box]
            rows = order[starts[j] : starts[j] + counts[j]]
            target_rows = order[starts[k] : starts[k] + counts[k]]
            acc.aliases.append(((rank[rows], index[rows]), (rank[target_rows], index[target_rows])))
            queued[j] = True
    return queued


__all__ = ["GlobalPlan", "LayoutMeta", "LocalLayout", "LocalPlan", "TensorPlan", "plan_save", "tiling_error"]
