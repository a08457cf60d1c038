"""The FSDP fast path: every rank holds every tensor, one box each, nothing tied.

A sort-free pass over the (rank x tensor) matrix of boxes, linear in the boxes and
in blocks of :data:`~.balance.CHUNK` ranks: tensors whole everywhere are replicated
boxes; tensors cut along one dimension are planned from that column alone when, in
rank order, the live intervals abut from 0 to the end. The rest goes to the general
path (:mod:`.general`), as rows :func:`gather_matrix` builds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bcp.metadata.geometry import abut_running
from bcp.planning.balance import CHUNK, Assignments
from bcp.planning.local_layout import LayoutMeta, LocalLayout
from bcp.planning.table import JobTensors, PlanRows


def plan_matrix(layouts: Sequence[LocalLayout], m: LayoutMeta, table: JobTensors, acc: Assignments) -> np.ndarray:
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
    for a in range(0, world if cols else 0, CHUNK):
        offs, lens = _block(layouts[a : a + CHUNK], cols)
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
    for a in range(0, world, CHUNK):
        block_o, block_l = _block(layouts[a : a + CHUNK], cols)
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
        for a in range(0, world, CHUNK):
            lens = np.stack([lay.lengths[kcol[bad]] for lay in layouts[a : a + CHUNK]])
            acc.load[a : a + len(lens)] -= lens @ weight[bad]
        fallback[fast[bad]] = True
        keep = np.flatnonzero(ok)
        fast, mask, empty_ref = fast[keep], mask[:, keep], empty_ref[keep]
    acc.mask, acc.mask_tensors = mask, fast
    acc.empty_columns = np.flatnonzero(empty_ref >= 0)
    return np.flatnonzero(fallback)


def _abut_exact(layouts: Sequence[LocalLayout], kcol: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For columns cut along one dimension: whether, in rank order, each live box starts
    at the sum of the lengths before it (empty boxes add 0) and the ends reach ``size``,
    with every empty box the same; and the empty boxes' offset (-1: none)."""
    big = np.int64(np.iinfo(np.int64).max)
    before = np.zeros(len(kcol), dtype=np.int64)
    ok = np.ones(len(kcol), dtype=bool)
    e_min, e_max = np.full(len(kcol), big), np.full(len(kcol), -1)
    for a in range(0, len(layouts), CHUNK):
        chunk = layouts[a : a + CHUNK]
        offs = np.stack([lay.offsets[kcol] for lay in chunk]).astype(np.int64)
        lens = np.stack([lay.lengths[kcol] for lay in chunk]).astype(np.int64)
        live = lens > 0
        abut, before = abut_running(offs, lens, before)
        ok &= abut
        np.minimum(e_min, np.where(live, big, offs).min(axis=0), out=e_min)
        np.maximum(e_max, np.where(live, -1, offs).max(axis=0), out=e_max)
    return ok & (before == size) & ((e_max < 0) | (e_min == e_max)), e_max


def _block(layouts: Sequence[LocalLayout], cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The (ranks x values) offsets and lengths of ranks holding the same number of values."""
    offs = np.concatenate([lay.offsets for lay in layouts]).reshape(len(layouts), cols)
    lens = np.concatenate([lay.lengths for lay in layouts]).reshape(len(layouts), cols)
    return offs, lens


def gather_matrix(layouts: Sequence[LocalLayout], m: LayoutMeta, table: JobTensors, tensors: np.ndarray) -> PlanRows:
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
    for a in range(0, world if cols else 0, CHUNK):
        block_o, block_l = _block(layouts[a : a + CHUNK], cols)
        for d in range(dims):
            sel = np.flatnonzero(ndims[tensors] > d)
            offs[a : a + len(block_o), sel, d] = block_o[:, starts[tensors[sel]] + d]
            lens[a : a + len(block_l), sel, d] = block_l[:, starts[tensors[sel]] + d]
    return gid, rank, gid.copy(), offs.reshape(-1, dims), lens.reshape(-1, dims)


__all__ = ["gather_matrix", "plan_matrix"]
