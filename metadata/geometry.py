"""Box geometry: the only shapes the planners and the catalog see.

A box is (offsets, lengths) per dimension of a global tensor. Fragments are boxes
stored row-major; local shards are boxes of destination memory. Everything here is
pure integer arithmetic, vectorised with numpy where counts can be large, and written
once: the save planner, the read planner and the catalog's tiling checks share it.
It lives in the metadata layer because the catalog, which never imports the engine,
needs it too.

What is here:

* single boxes: :func:`intersect`, :func:`row_major_strides`,
  :func:`flat_range_to_boxes`, :func:`common_runs`;
* many boxes as arrays: :class:`BoxArrays`, :func:`row_products`, :func:`rows_positive`,
  :func:`stable_order`, :func:`packed_keys`;
* the sort-and-sweep overlap window: sorted by start on one dimension, a box can only
  meet the boxes whose running maximum end lies past its start
  (:func:`sweep_windows`, :func:`expand_windows`); on one set of boxes it finds
  self-overlap (:func:`overlapping_pair`, :func:`boxes_disjoint`);
* tiling: :func:`tiling_problem` (exact, any layout), :func:`covers_exactly`,
  :func:`simple_tilings` (many tensors cut along one dimension at once),
  :func:`abut_running` and :func:`regions_abut` (intervals that follow each other).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]

#: The corner test handles at most this many box corners (memory: 8 bytes each per dimension).
MAX_CORNERS = 1 << 22
#: :func:`boxes_disjoint` compares at most this many candidate pairs before giving up.
MAX_PAIRS = 1 << 26
#: Candidate pairs tested at once by the self-overlap sweep (bounds its memory).
_SWEEP_CHUNK = 1 << 20


# -- one box -------------------------------------------------------------------------------


def intersect(a_off: Sequence[int], a_len: Sequence[int], b_off: Sequence[int], b_len: Sequence[int]) -> Box | None:
    """The overlap of two boxes, or None when it is empty (a 0-d box overlaps itself)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len, strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def check_box_inside(fqn: str, shape: tuple[int, ...], box: Box) -> None:
    """ValueError naming ``fqn`` unless ``box`` (offsets, lengths) lies inside ``shape``."""
    ndim = len(shape)
    if len(box[0]) == ndim and tuple(box[1]) == shape and not any(box[0]):
        return  # the whole tensor (the usual request), checked without the loop below
    if (
        len(box[0]) != ndim
        or len(box[1]) != ndim
        or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(box[0], box[1], shape, strict=True))
    ):
        raise ValueError(f"{fqn!r}: box offsets={list(box[0])} lengths={list(box[1])} is outside {list(shape)}")


def row_major_strides(lengths: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(lengths):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def flat_range_to_boxes(shape: Sequence[int], start: int, count: int) -> list[tuple[Box, int]]:
    """Cut the flat (row-major) range [start, start+count) of ``shape`` into boxes.

    Returns (box, position of the box's first element within the range) pairs in
    range order; at most 2*ndim-1 boxes, each one contiguous in the range.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if start < 0 or count < 0 or start + count > total:
        raise ValueError(f"flat range [{start}, {start + count}) is outside a tensor of {total} elements {list(shape)}")
    if count == 0:
        return []
    strides = row_major_strides(shape)
    boxes: list[Box] = []

    def cut(prefix: tuple[int, ...], rest: tuple[int, ...], lo: int, hi: int) -> None:
        # [lo, hi) counts elements of the sub-tensor shape[len(prefix):] at index prefix
        if lo >= hi:
            return
        if not rest:
            boxes.append((prefix, (1,) * len(prefix)))
            return
        inner = math.prod(rest[1:])
        first, last = lo // inner, (hi - 1) // inner
        ones = (1,) * len(prefix)
        if lo % inner == 0 and hi % inner == 0:
            boxes.append(((*prefix, first, *(0,) * (len(rest) - 1)), (*ones, last - first + 1, *rest[1:])))
        elif first == last:
            cut((*prefix, first), rest[1:], lo - first * inner, hi - first * inner)
        else:
            cut((*prefix, first), rest[1:], lo - first * inner, inner)
            if last - first > 1:
                boxes.append(((*prefix, first + 1, *(0,) * (len(rest) - 1)), (*ones, last - first - 1, *rest[1:])))
            cut((*prefix, last), rest[1:], 0, hi - last * inner)

    cut((), shape, start, start + count)
    return [(box, sum(o * st for o, st in zip(box[0], strides, strict=True)) - start) for box in boxes]


def common_runs(
    region_off: Sequence[int],
    region_len: Sequence[int],
    src_off: Sequence[int],
    src_len: Sequence[int],
    dst_off: Sequence[int],
    dst_len: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, int]:
    """Pieces of ``region`` (inside both boxes) contiguous in both row-major layouts.

    Returns (src_starts, dst_starts, run_length), element offsets relative to each
    box's first element; every run has the same length. Trailing dimensions that the
    region spans fully in both boxes merge into one run.
    """
    ndim = len(region_len)
    if math.prod(region_len) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    if ndim == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), 1
    j = ndim - 1
    while j > 0 and region_len[j] == src_len[j] == dst_len[j]:
        j -= 1
    run = math.prod(region_len[j:])
    s_str, d_str = row_major_strides(src_len), row_major_strides(dst_len)
    s_base = sum((r - s) * st for r, s, st in zip(region_off, src_off, s_str, strict=True))
    d_base = sum((r - d) * st for r, d, st in zip(region_off, dst_off, d_str, strict=True))
    if j == 0:
        return np.array([s_base], np.int64), np.array([d_base], np.int64), run
    grids = np.indices(tuple(region_len[:j]), dtype=np.int64).reshape(j, -1)
    src = s_base + (grids * np.array(s_str[:j], np.int64)[:, None]).sum(axis=0)
    dst = d_base + (grids * np.array(d_str[:j], np.int64)[:, None]).sum(axis=0)
    return src, dst, run


# -- many boxes as arrays --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class BoxArrays:
    """Boxes as (N, D) int64 arrays, and optionally the group (tensor) of each: boxes
    of different groups never meet. What the overlap queries take, one per side."""

    offsets: np.ndarray
    lengths: np.ndarray
    #: (N,) int64 group of each box; None: all in one group
    group: np.ndarray | None = None

    @classmethod
    def of(cls, boxes: Sequence[Box], ndim: int) -> BoxArrays:
        """``boxes`` (tuples) as arrays of ``ndim`` columns."""
        flat = np.array([[*o, *n] for o, n in boxes], dtype=np.int64).reshape(len(boxes), 2 * ndim)
        return cls(flat[:, :ndim], flat[:, ndim:])

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def ndim(self) -> int:
        return self.offsets.shape[1] if self.offsets.ndim == 2 else 0

    def groups(self) -> np.ndarray:
        """The group of every box (zeros when there is none)."""
        return np.zeros(len(self.offsets), np.int64) if self.group is None else np.asarray(self.group, np.int64)

    def take(self, rows: np.ndarray) -> BoxArrays:
        """The boxes ``rows``, in that order (``np.take``: faster than indexing for rows)."""
        group = None if self.group is None else self.group[rows]
        return BoxArrays(np.take(self.offsets, rows, axis=0), np.take(self.lengths, rows, axis=0), group)


def row_products(a: np.ndarray) -> np.ndarray:
    """Product of each row of an (N, D) int array (a box's element count), column by
    column: numpy's reductions along a short last axis are about 10x slower."""
    if a.shape[1] == 0:
        return np.ones(len(a), a.dtype)
    out = a[:, 0].copy()
    for d in range(1, a.shape[1]):
        out *= a[:, d]
    return out


def rows_positive(a: np.ndarray) -> np.ndarray:
    """Whether every value of each row of an (N, D) array is positive (column by
    column, as :func:`row_products`)."""
    out = np.ones(len(a), bool)
    for d in range(a.shape[1]):
        out &= a[:, d] > 0
    return out


def ascending(a: np.ndarray) -> bool:
    """Whether the 1-D ``a`` never decreases."""
    return len(a) < 2 or bool((a[1:] >= a[:-1]).all())


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of a 1-D int array, cheaper where it can be:
    keys already in order are not sorted; where (key - min) and the position fit in 63
    bits together, one ``np.sort`` of ``(key - min) << bits | position`` (unique values,
    so any sort is stable; numpy's int64 sort is a vectorised quicksort, about 5x a
    stable argsort at millions) and the positions are the low bits."""
    if ascending(keys):
        return np.arange(len(keys))
    packed = packed_keys(keys, np.arange(len(keys), dtype=np.int64), len(keys))
    if packed is None:
        return np.argsort(keys, kind="stable")
    packed.sort()
    packed &= (1 << max(len(keys) - 1, 1).bit_length()) - 1
    return packed


def packed_keys(high: np.ndarray, low: np.ndarray, bound: int) -> np.ndarray | None:
    """``(high - min(high)) << bits | low`` as a new int64 array, ``bits`` those of
    ``bound - 1`` (``low`` in [0, bound)): sorting it sorts by (high, low). None where
    that does not fit in 63 bits (the caller sorts otherwise)."""
    if high.dtype.kind not in "iub" or low.dtype.kind not in "iub":
        return None
    if not len(high):
        return np.zeros(0, np.int64)
    lo, hi = int(high.min()), int(high.max())
    bits = max(bound - 1, 1).bit_length()
    if (hi - lo).bit_length() + bits > 63 or hi >= 1 << 63:
        return None
    out = high.astype(np.int64)
    if lo:
        out -= lo
    out <<= bits
    out |= low
    return out


# -- the sort-and-sweep window ---------------------------------------------------------------


def sweep_windows(
    starts: np.ndarray, ends: np.ndarray, q_starts: np.ndarray, q_ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For intervals sorted by start (``starts`` ascending, ``ends`` theirs) and query
    intervals [q_start, q_end): (first, width) such that the intervals query i can
    meet are positions first[i] .. first[i] + width[i] - 1. They start before the
    query ends, and the running maximum of the ends lies past the query's start from
    ``first`` on (two binary searches). Intervals in the window are candidates: test
    them (they may be empty or meet only on this dimension)."""
    reach = np.maximum.accumulate(ends)
    first = np.searchsorted(reach, q_starts, side="right")
    width = np.searchsorted(starts, q_ends, side="left") - first
    np.clip(width, 0, None, out=width)
    return first, width


def expand_windows(first: np.ndarray, width: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (query, position) pair of the windows of :func:`sweep_windows`: query i
    with positions first[i], first[i] + 1, ... first[i] + width[i] - 1, in that order."""
    return np.repeat(np.arange(len(width)), width), window_positions(first, width)


def window_positions(first: np.ndarray, width: np.ndarray, heads: np.ndarray | None = None) -> np.ndarray:
    """Positions first[i], first[i] + 1, ... first[i] + width[i] - 1 of every i, in that
    order (``heads``: where each window starts in the result, the running sum of
    ``width`` less it, if at hand): one int64 array of steps summed in place, +1 inside
    a window and a jump at each window's head (no repeat or arange as long as the result)."""
    if heads is None:
        heads = np.cumsum(width) - width
    pos = np.ones(int(width.sum()), np.int64)
    nonempty = width > 0
    if not nonempty.all():
        first, width, heads = first[nonempty], width[nonempty], heads[nonempty]
    if len(first):
        jump = first.astype(np.int64)
        jump[1:] -= first[:-1]
        jump[1:] -= width[:-1]
        jump[1:] += 1
        pos[heads] = jump
        np.cumsum(pos, out=pos)
    return pos


def _self_window(offs: np.ndarray, lens: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(candidate pairs, order, first) on the dimension with the fewest candidate pairs
    (the first such one): sorted by start there, box i can only meet boxes first[i]..i-1."""
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for k in range(offs.shape[1]):
        order = np.argsort(offs[:, k], kind="stable")
        start = offs[order, k]
        reach = np.maximum.accumulate(start + lens[order, k])
        first = np.searchsorted(reach, start, side="right")
        pairs = int(np.clip(np.arange(len(start)) - first, 0, None).sum())
        if best is None or pairs < best[0]:
            best = (pairs, order, first)
    assert best is not None
    return best


def _first_overlap(offs: np.ndarray, lens: np.ndarray, limit: int) -> tuple[bool, tuple[int, int] | None]:
    """(too many candidates, the first overlapping pair in sweep order or None)."""
    if len(offs) < 2:
        return False, None
    if offs.shape[1] == 0:  # 0-d boxes are all the one element
        return False, (0, 1)
    pairs, order, first = _self_window(offs, lens)
    if pairs > limit:
        return True, None
    width = np.clip(np.arange(len(order)) - first, 0, None)
    rows = np.flatnonzero(width)
    if not len(rows):
        return False, None
    o, n = offs[order], lens[order]
    cum = np.cumsum(width[rows])
    done = 0
    for end in np.searchsorted(cum, np.arange(_SWEEP_CHUNK, int(cum[-1]) + _SWEEP_CHUNK, _SWEEP_CHUNK), side="right"):
        end = max(int(end), done + 1) if done < len(rows) else done
        mine = rows[done:end]
        done = end
        if not len(mine):
            continue
        qi, b = expand_windows(first[mine], width[mine])
        a = mine[qi]
        hit = np.flatnonzero((np.maximum(o[a], o[b]) < np.minimum(o[a] + n[a], o[b] + n[b])).all(axis=1))
        if len(hit):
            return False, (int(order[b[hit[0]]]), int(order[a[hit[0]]]))
    return False, None


def overlapping_pair(offs: np.ndarray, lens: np.ndarray, limit: int = 1 << 24) -> tuple[int, int] | None:
    """Two rows of (N, D) int64 arrays whose boxes share an element, or None (also when
    more than ``limit`` candidate pairs would need comparing). Sort-and-sweep on the
    dimension with the fewest candidate pairs, candidates tested in bounded chunks."""
    _too_many, pair = _first_overlap(offs, lens, limit)
    return pair


def boxes_disjoint(offs: np.ndarray, lens: np.ndarray, limit: int = MAX_PAIRS) -> bool | None:
    """Whether the boxes (rows of (N, D) int64 arrays) are pairwise disjoint; None past
    ``limit`` candidate pairs (too irregular to check cheaply)."""
    too_many, pair = _first_overlap(offs, lens, limit)
    return None if too_many else pair is None


# -- tiling ----------------------------------------------------------------------------------


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
        small = len(offs) << len(cut) <= MAX_CORNERS
        ok = _corners_match(dims, offs, lens) if small else boxes_disjoint(offs, lens)
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


def covers_exactly(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
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


def simple_tilings(
    shapes: Sequence[tuple[int, ...]], off: np.ndarray, length: np.ndarray, counts: Sequence[int] | np.ndarray
) -> np.ndarray:
    """Per tensor (all of one number of dimensions, at least 1; its ``counts[i]`` rows
    of ``off`` and ``length``, (rows, ndim), follow the previous tensor's): True where its rows
    certainly tile its shape exactly: empty rows aside, every row is whole on all
    dimensions but at most one, along which the rows, in order, abut from 0 to the
    end (or every row is the whole tensor, replicas counting once). False means "not
    shown here", not "wrong": the caller runs the general check on those."""
    n = len(shapes)
    ok = np.zeros(n, bool)
    if not n or not len(shapes[0]) or not len(off):
        return ok
    ndim = len(shapes[0])
    cnt = np.asarray(counts, np.int64)
    held = np.flatnonzero(cnt)
    live = np.ones(len(length), bool)
    for d in range(ndim):  # column by column: reductions along a short last axis are slow
        live &= length[:, d] > 0
    shape = np.array([shapes[i] for i in held.tolist()], np.int64).reshape(-1, ndim)
    seg = np.r_[0, np.cumsum(cnt[held])[:-1]]
    # empty rows hold nothing: they cut no dimension and are left out of the chain below
    partial = ((off != 0) | (length != np.repeat(shape, cnt[held], axis=0))) & live[:, None]
    cut = np.logical_or.reduceat(partial, seg, axis=0)  # (T, ndim): dimensions some row cuts
    n_cut = cut.sum(axis=1)
    k = cut.argmax(axis=1)  # the cut dimension (where there is one)
    if (k == k[0]).all():  # the usual case: one cut dimension for every tensor
        start, end = off[:, k[0]], off[:, k[0]] + length[:, k[0]]
    else:
        k_rows = np.repeat(k, cnt[held])
        at = np.arange(len(off))
        start = off[at, k_rows]
        end = start + length[at, k_rows]
    tensor = np.repeat(np.arange(len(held)), cnt[held])
    if not live.all():
        start, end, tensor = start[live], end[live], tensor[live]
    live_cnt = np.bincount(tensor, minlength=len(held))
    some = np.flatnonzero(live_cnt)  # tensors with a row that holds something
    if not len(some):
        return ok
    seg = np.r_[0, np.cumsum(live_cnt[some])[:-1]]
    last = np.r_[seg[1:], len(start)] - 1
    abut = np.ones(len(start), bool)  # row i ends where row i + 1 starts, within a tensor
    if len(start) > 1:
        abut[:-1] = end[:-1] == start[1:]
    abut[last] = True
    chain = np.logical_and.reduceat(abut, seg)
    span = (start[seg] == 0) & (end[last] == shape[some, k[some]])
    ok[held[some]] = (n_cut[some] == 0) | ((n_cut[some] == 1) & chain & span)
    return ok


def abut_running(offs: np.ndarray, lens: np.ndarray, before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Intervals in the columns of (rows x columns) int64 arrays, in row order: whether
    each non-empty one starts at ``before`` (per column) plus the lengths above it
    (empty ones add 0), and the running total after the last row. Blocks of rows
    chain through ``before``; the intervals of a column abut from 0 to ``size``
    iff every block says so, starting from zeros, and the final total is ``size``."""
    upto = np.cumsum(lens, axis=0)
    upto += before
    after = upto[-1].copy()
    upto -= lens
    return ~((offs != upto) & (lens > 0)).any(axis=0), after


def regions_abut(
    box_off: Sequence[int], box_len: Sequence[int], offs: Sequence[Sequence[int]], lens: Sequence[Sequence[int]]
) -> bool:
    """Whether regions of a box (inside it, few: plain Python lists) tile it as
    intervals along one dimension that follow each other exactly (the usual reshard);
    False means "not shown", and :func:`tiling_problem` decides."""
    cut = [
        d
        for d in range(len(box_len))
        if any(o[d] != box_off[d] or n[d] != box_len[d] for o, n in zip(offs, lens, strict=True))
    ]
    if len(cut) != 1:
        return False
    (d,) = cut
    spans = sorted((o[d], o[d] + n[d]) for o, n in zip(offs, lens, strict=True))
    at = box_off[d]
    for start, end in spans:
        if start != at:
            return False
        at = end
    return at == box_off[d] + box_len[d]


__all__ = [
    "MAX_CORNERS",
    "MAX_PAIRS",
    "Box",
    "BoxArrays",
    "abut_running",
    "ascending",
    "boxes_disjoint",
    "common_runs",
    "covers_exactly",
    "expand_windows",
    "flat_range_to_boxes",
    "intersect",
    "overlapping_pair",
    "packed_keys",
    "regions_abut",
    "row_major_strides",
    "row_products",
    "rows_positive",
    "simple_tilings",
    "stable_order",
    "sweep_windows",
    "tiling_problem",
]
