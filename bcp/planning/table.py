"""The coordinator's view of a job's layouts: every distinct metadata decoded once,
every layout checked against it, and one table of the job's tensors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from bcp.errors import ShardingError
from bcp.metadata import itemsize
from bcp.planning.local_layout import MAX_EXTENT, LayoutMeta, LocalLayout, meta_digest

#: Rows of boxes the paths hand over: tensor id, rank, index in the rank's box list,
#: offsets and lengths padded (with 0 and 1) to the largest number of dimensions.
PlanRows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def resolve_meta(
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
        if meta_digest(raw) != d:
            raise ShardingError(f"rank {layout.rank}: layout metadata does not match its digest")
        out[d] = LayoutMeta.decode(raw)
    return out


def check_layouts(layouts: Sequence[LocalLayout], metas: Mapping[bytes, LayoutMeta]) -> bool:
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


@dataclasses.dataclass
class JobTensors:
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
    #: (G,) stored from the lowest-ranked holder (any holder's layout says so: ``LayoutMeta.lowest``)
    lowest: np.ndarray | None = None


def job_tensors(
    layouts: Sequence[LocalLayout], metas: Mapping[bytes, LayoutMeta]
) -> tuple[JobTensors, dict[bytes, np.ndarray]]:
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
    if sum(t * i for t, i in zip(total.tolist(), isz.tolist(), strict=True)) >= MAX_EXTENT:
        raise ShardingError("the tensors hold more bytes than a checkpoint can describe")
    table = JobTensors(list(index), [d for _p, d, _s, _r in info], shapes, isz, total, spad, alias_seen, has_alias)
    named = set().union(*(metas[d].lowest for d in local_gid))
    if named:
        table.lowest = np.zeros(len(info), dtype=bool)
        table.lowest[[index[fqn] for fqn in named]] = True
    return table, local_gid


__all__ = ["JobTensors", "PlanRows", "check_layouts", "job_tensors", "resolve_meta"]
