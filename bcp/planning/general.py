"""The general save-planning path: any layout.

Boxes arrive as rows (tensor, rank, index in the rank's list, padded box); one sort
finds the distinct boxes and their holders, each tensor's distinct boxes must tile it
exactly (one vectorised pass for tensors cut along one dimension,
:func:`~bcp.metadata.geometry.tiling_problem` for the rest, never a quadratic sweep),
and the boxes are handed to :class:`~.balance.Assignments`: single holders write
their own, replicated boxes are balanced, tied tensors follow their target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from bcp.errors import ShardingError
from bcp.metadata.geometry import Box, overlapping_pair, simple_tilings, tiling_problem
from bcp.planning.balance import Assignments
from bcp.planning.local_layout import LayoutMeta, LocalLayout
from bcp.planning.table import JobTensors, PlanRows


def gather_all(
    layouts: Sequence[LocalLayout],
    metas: Mapping[bytes, LayoutMeta],
    local_gid: Mapping[bytes, np.ndarray],
    table: JobTensors,
) -> PlanRows:
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


def plan_general(
    gid: np.ndarray,
    rank: np.ndarray,
    index: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    table: JobTensors,
    acc: Assignments,
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


def _tiling_failures(g_gid: np.ndarray, g_offs: np.ndarray, g_lens: np.ndarray, table: JobTensors) -> set[int]:
    """Tensors whose distinct boxes (sorted by tensor, then offsets) do not tile them.
    One vectorised pass shows the tensors cut along at most one dimension tiled
    (their live boxes, sorted and distinct, abut exactly or not at all);
    tiling_problem decides the rest."""
    if not len(g_gid) or not table.spad.shape[1]:
        return set()  # 0-d tensors: their one possible box tiles them
    starts = np.flatnonzero(np.append(True, g_gid[1:] != g_gid[:-1]))
    tensors = g_gid[starts]
    counts = np.diff(np.append(starts, len(g_gid)))
    shown = simple_tilings([tuple(s) for s in table.spad[tensors].tolist()], g_offs, g_lens, counts)
    out: set[int] = set()
    for t in np.flatnonzero(~shown & (table.total[tensors] > 0)).tolist():
        g = int(tensors[t])
        lo, hi = starts[t], starts[t] + counts[t]
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
    table: JobTensors,
    acc: Assignments,
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


def _describe(box: Box) -> str:
    return f"offsets={list(box[0])} lengths={list(box[1])}"


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
    pair = overlapping_pair(u_offs[live], u_lens[live]) if nd and live.sum() > 1 else None
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


__all__ = ["gather_all", "plan_general", "tiling_error"]
