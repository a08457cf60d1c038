"""Whether a tensor's stored boxes tile it exactly: no gap, no overlap (replicas count once).

Used when a catalog read from storage builds an entry, by the save planner and by
the read planner. Kept apart from the catalog's encoding and checks because it is
pure box geometry on numpy arrays, with its own cost limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: The corner test handles at most this many box corners (memory: 8 bytes each per dimension).
_MAX_CORNERS = 1 << 22
#: The sweep fallback compares at most this many candidate pairs before giving up.
_MAX_PAIRS = 1 << 26


def tiling_problem(shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> str | None:
    """Why the boxes (rows of ``offsets`` and ``lengths``, int64, each already inside
    ``shape``) do not tile ``shape`` exactly, or None when they do. Identical boxes
    count once (replicas); empty boxes are ignored.

    Exact and vectorised. The signed corners of a box (+1/-1 by the parity of the
    ends chosen) are its indicator's finite difference; the boxes cover every element
    exactly once iff their corners, summed, equal those of the whole tensor. Cost
    O(F 2^k log) for F boxes cut along k dimensions (1-2 for real layouts); dimensions
    every box spans fully do not count. Past that, a sort-and-sweep on the dimension
    with the fewest candidate pairs checks disjointness (O(F log F + pairs)).
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    total = math.prod(shape)
    if ndim == 0 or total == 0:
        return None  # a 0-d tensor has one possible box; an empty one holds only empty boxes
    offsets, lengths = offsets.reshape(-1, ndim), lengths.reshape(-1, ndim)
    live = (lengths > 0).all(axis=1)
    if not live.all():
        offsets, lengths = offsets[live], lengths[live]
    partial = (offsets != 0) | (lengths != np.array(shape, dtype=np.int64))
    cut = np.flatnonzero(partial.any(axis=0)).tolist()
    if not cut and len(offsets):  # every box is the whole tensor (one fragment, or replicas of it)
        return None
    if len(cut) == 1:  # the usual layout (a shard along one dimension): intervals that must abut
        (k,) = cut
        start, end = offsets[:, k], offsets[:, k] + lengths[:, k]
        if len(start) and start[0] == 0 and end[-1] == shape[k] and (end[:-1] == start[1:]).all():
            return None  # already in order, abutting, no replicas: the catalog's usual order
        if (shape[k] + 1) ** 2 < 1 << 62:
            key = np.unique(start * (shape[k] + 1) + end)
            start, end = key // (shape[k] + 1), key % (shape[k] + 1)
        else:
            pairs = np.unique(np.stack([start, end], axis=1), axis=0)
            start, end = pairs[:, 0], pairs[:, 1]
        if start[0] == 0 and end[-1] == shape[k] and (end[:-1] == start[1:]).all():
            return None
    boxes = np.unique(np.concatenate([offsets, lengths], axis=1), axis=0)  # replicas count once
    offs, lens = boxes[:, :ndim], boxes[:, ndim:]
    covered = sum(np.prod(lens, axis=1).tolist())  # each count fits int64 (rows validated); the sum is exact
    if covered != total:
        what = "some part is missing" if covered < total else "they overlap"
        return f"its fragments hold {covered} elements of its {total} (shape {list(shape)}): {what}"
    if len(cut) <= 1:
        ok: bool | None = len(cut) == 0 and len(offs) == 1  # one interval layout failed above: overlap
    else:
        offs, lens, dims = offs[:, cut], lens[:, cut], tuple(shape[k] for k in cut)
        small = len(offs) << len(cut) <= _MAX_CORNERS
        ok = _corners_match(dims, offs, lens) if small else _sweep_disjoint(offs, lens)
    if ok is None:
        return f"its {len(offs)} fragments are too irregular to check for overlap cheaply"
    return None if ok else "its fragments overlap and leave a hole (they do not tile the tensor)"


def _corners_match(shape: tuple[int, ...], offs: np.ndarray, lens: np.ndarray) -> bool:
    k = len(shape)
    bits = (np.arange(1 << k)[:, None] >> np.arange(k)[None, :]) & 1  # (2^k, k): end chosen?
    signs = np.where(bits.sum(axis=1) % 2 == 0, 1, -1)
    corners = (offs[None, :, :] + bits[:, None, :] * lens[None, :, :]).reshape(-1, k)
    weights = np.repeat(signs, len(offs))
    whole = bits * np.array(shape, dtype=np.int64)  # the tensor's own corners, subtracted
    corners = np.concatenate([corners, whole])
    weights = np.concatenate([weights, -signs])
    radix = 1
    for s in shape:
        radix *= s + 1
    if radix < 1 << 62:  # one int64 key per point
        mult = np.cumprod([1, *[s + 1 for s in shape[:-1]]]).astype(np.int64)
        keys = corners @ mult
        _uniq, inverse = np.unique(keys, return_inverse=True)
    else:
        _uniq, inverse = np.unique(corners, axis=0, return_inverse=True)
    sums = np.bincount(inverse.reshape(-1), weights=weights)
    return not sums.any()


def _sweep_disjoint(offs: np.ndarray, lens: np.ndarray) -> bool | None:
    """Whether the boxes are pairwise disjoint; None past _MAX_PAIRS candidate pairs.
    Sorted by start on one dimension, box i can only meet the boxes before it whose
    running maximum end exceeds its start: a window, found with searchsorted."""
    best: tuple[int, int, np.ndarray, np.ndarray] | None = None
    for k in range(offs.shape[1]):
        order = np.argsort(offs[:, k], kind="stable")
        start = offs[order, k]
        reach = np.maximum.accumulate(start + lens[order, k])
        first = np.searchsorted(reach, start, side="right")
        width = np.arange(len(start)) - first
        pairs = int(np.clip(width, 0, None).sum())
        if best is None or pairs < best[0]:
            best = (pairs, k, order, first)
    assert best is not None
    pairs, _k, order, first = best
    if pairs > _MAX_PAIRS:
        return None
    width = np.clip(np.arange(len(order)) - first, 0, None)
    o, n = offs[order], lens[order]
    rows = np.flatnonzero(width)
    if not len(rows):
        return True
    cum = np.cumsum(width[rows])
    done = 0
    for end in np.searchsorted(cum, np.arange(1 << 20, int(cum[-1]) + (1 << 20), 1 << 20), side="right").tolist():
        end = max(end, done + 1) if done < len(rows) else done
        mine = rows[done:end]
        done = end
        if not len(mine):
            continue
        w = width[mine]
        a = np.repeat(mine, w)
        step = np.arange(len(a)) - np.repeat(np.cumsum(w) - w, w)
        b = np.repeat(first[mine], w) + step
        if (np.maximum(o[a], o[b]) < np.minimum(o[a] + n[a], o[b] + n[b])).all(axis=1).any():
            return False
    return True


def boxes_cover_exactly(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether the (offsets, lengths) boxes tile ``shape`` with no gap and no overlap,
    counting identical boxes once (replicas). Boxes outside ``shape`` do not tile it."""
    shape = tuple(shape)
    ndim = len(shape)
    for o, n in boxes:
        if len(o) != ndim or len(n) != ndim:
            return False
        if any(a < 0 or x < 0 or a + x > s for a, x, s in zip(o, n, shape, strict=True)):
            return False
    if not boxes:
        return math.prod(shape) == 0
    offs = np.array([list(o) for o, _n in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    lens = np.array([list(n) for _o, n in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return tiling_problem(shape, offs, lens) is None
