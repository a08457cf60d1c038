"""What one rank sends the coordinator to plan a save: its tensors and the boxes it holds.

A :class:`LocalLayout` carries the rank's tensors' metadata (encoded once: the same
bytes on ranks holding the same tensors, so the coordinator needs it once per digest)
and its boxes as flat integer arrays, never one Python object per box.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Sequence

import numpy as np

from bcp.errors import ShardingError
from bcp.metadata import itemsize
from bcp.metadata.geometry import Box

#: Box values are stored as int32 when every offset and offset + length fits.
_INT32_MAX = (1 << 31) - 1
#: Largest dimension or element count a layout may declare (products stay inside int64).
MAX_EXTENT = 1 << 62


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
    #: stored from its lowest-ranked holder (``bcp.LowestRankCopy``), not balanced
    lowest_rank: bool = False


@dataclasses.dataclass(frozen=True)
class LayoutMeta:
    """The decoded ``meta`` of a layout: per tensor, in the rank's order."""

    fqns: tuple[str, ...]
    key_paths: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    aliases: tuple[str | None, ...]
    #: the FQNs stored from their lowest-ranked holder (``TensorPlan.lowest_rank``)
    lowest: frozenset[str] = frozenset()

    @classmethod
    def of(cls, tensors: Sequence[TensorPlan]) -> LayoutMeta:
        return cls(
            tuple(t.fqn for t in tensors),
            tuple(t.key_path for t in tensors),
            tuple(t.dtype for t in tensors),
            tuple(tuple(int(s) for s in t.global_shape) for t in tensors),
            tuple(t.alias_of for t in tensors),
            frozenset(t.fqn for t in tensors if t.lowest_rank),
        )

    def encode(self) -> bytes:
        """One row per tensor; a sixth field, 1, only on a lowest-rank one (the usual row
        stays five fields)."""
        rows = [
            [f, k, d, list(s), a, 1] if f in self.lowest else [f, k, d, list(s), a]
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
        fqns, paths, dtypes, shapes, aliases, lowest = [], [], [], [], [], []
        for row in rows:
            if not (isinstance(row, list) and (len(row) == 5 or (len(row) == 6 and row[5] == 1))):
                raise ShardingError(f"a rank's layout metadata has a malformed tensor entry {row!r:.200}")
            fqn, path, dtype, shape, alias = row[:5]
            if not (isinstance(fqn, str) and isinstance(path, str) and isinstance(dtype, str)):
                raise ShardingError(f"a rank's layout metadata has a malformed tensor entry {row!r:.200}")
            if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < MAX_EXTENT for s in shape):
                raise ShardingError(f"tensor {fqn!r}: invalid global shape {shape!r:.200} in a rank's layout")
            if math.prod(shape) >= MAX_EXTENT:
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
            if len(row) == 6:
                lowest.append(fqn)
        if len(set(fqns)) != len(fqns):
            raise ShardingError("a rank's layout metadata names a tensor twice")
        return cls(tuple(fqns), tuple(paths), tuple(dtypes), tuple(shapes), tuple(aliases), frozenset(lowest))

    @functools.cached_property
    def ndims(self) -> np.ndarray:
        return np.array([len(s) for s in self.shapes], dtype=np.int64)


def meta_digest(meta: bytes) -> bytes:
    """The 16-byte digest a layout names its encoded metadata by."""
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
        return cls(rank, meta, meta_digest(meta), counts, offs, lens)

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


__all__ = ["MAX_EXTENT", "LayoutMeta", "LocalLayout", "TensorPlan", "meta_digest"]
