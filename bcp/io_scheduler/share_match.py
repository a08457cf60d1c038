"""Matching wanted boxes to stored rows for the share_reads plan (coordinator).

Split from :mod:`.shared_read`, which decides what is shared and by whom: here, which
stored rows each class's wanted boxes meet and how many elements each pair shares.
Tensors stored as disjoint slices along one dimension (FSDP, TP) go through
:class:`CutIndex` (intervals on one line, windows from prefix-count tables, a batch of
boxes at a time); every other box through the general overlap test of
:mod:`.read_plan`. Both give the same pairs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from bcp.io_scheduler.read_plan import overlap_volumes
from bcp.metadata.geometry import (
    BoxArrays,
    ascending,
    row_products,
    rows_positive,
    stable_order,
)
from bcp.metadata.rows import TensorBoxes

#: Wanted boxes matched at once (bounds the memory of the per-box arrays)
BOX_BATCH = 1 << 16


def box_batches(lengths: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive ranges [lo, hi) of ``lengths`` holding about ``limit`` in all (at
    least one item each)."""
    out, lo, acc = [], 0, 0
    for i, n in enumerate(lengths):
        if acc and acc + n > limit:
            out.append((lo, i))
            lo, acc = i, 0
        acc += n
    if lo < len(lengths):
        out.append((lo, len(lengths)))
    return out


def by_tag(
    tags: np.ndarray, classes: np.ndarray, k: int, n_classes: int, *, dtype: type | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(tag, class) pairs, each once, put in order of tag then class. Pairs come class
    after class (the classes' batches), so a stable counting sort by tag orders them:
    each pair goes to its tag's first slot (a count per tag, no sort), and only the pairs
    of tags several classes need (at chunk boundaries, usually few) are ordered among
    themselves, by a stable sort. Where tags are not in [0, k) or k is large beside the
    pairs, one stable sort of the tags; otherwise, as they are (:meth:`_RankClasses.labels` sorts them).
    ``dtype``: of both arrays returned (by default, each its own), written as they are placed."""
    if len(tags) < 2 or not ascending(classes) or tag_major(tags, classes, n_classes):
        return tags.astype(dtype or tags.dtype, copy=False), classes.astype(dtype or classes.dtype, copy=False)
    if int(tags.min()) < 0 or int(tags.max()) >= k or k > 8 * len(tags) + (1 << 22):  # no table of every tag
        order = stable_order(tags)
        return tags[order].astype(dtype or tags.dtype, copy=False), classes[order].astype(
            dtype or classes.dtype, copy=False
        )
    counts = np.bincount(tags, minlength=k)
    multi = counts > 1  # a table of flags: one byte a tag
    if not bool((counts > 2).any()):  # one class, or two at a chunk boundary: no sort
        np.cumsum(counts, out=counts)  # in place: each tag's end slot
        at = counts[tags]
        at -= 1  # the last slot of the pair's tag; the earlier class of two goes one slot back
        several = np.flatnonzero(multi[tags])
        if len(several):
            t = tags[several]
            first_cls = np.full(k, np.iinfo(classes.dtype).max, classes.dtype)
            np.minimum.at(first_cls, t, classes[several])
            at[several] -= classes[several] == first_cls[t]
    else:  # the n-th pair of a tag (in class order) goes n slots on from the tag's first
        pos = np.zeros(k, np.int64)
        np.cumsum(counts[:-1], out=pos[1:])
        at = pos[tags]
        several = np.flatnonzero(multi[tags])
        several = several[stable_order(tags[several])]
        t = tags[several]
        step = np.arange(len(several), dtype=np.int64)
        head = np.r_[True, t[1:] != t[:-1]]
        at[several] += step - np.maximum.accumulate(np.where(head, step, 0))
    out_tags, out_cls = np.empty(len(tags), dtype or tags.dtype), np.empty(len(classes), dtype or classes.dtype)
    out_tags[at] = tags  # a scatter, cheaper than np.repeat by counts
    out_cls[at] = classes
    return out_tags, out_cls


def class_major(classes: np.ndarray, tags: np.ndarray) -> bool:
    """Whether (tag, class) pairs are in order of class, then tag (each pair once): as
    the matching yields them when every class names its tensors in catalog order."""
    return lex_ascending(classes, tags, strict=True)


#: pairs compared at once by :func:`lex_ascending` (its temporaries stay small)
_CHECK_BLOCK = 1 << 16


def lex_ascending(major: np.ndarray, minor: np.ndarray, *, strict: bool = False) -> bool:
    """Whether the pairs (major[i], minor[i]) never decrease (``strict``: always increase)
    in lexicographic order. A block at a time: at millions of pairs, temporaries as long
    as the pairs (a packed key, a step per pair) cost more in fresh memory than the
    comparisons themselves."""
    n = len(major)
    for lo in range(0, max(n - 1, 0), _CHECK_BLOCK):
        hi = min(lo + _CHECK_BLOCK, n - 1)
        a0, a1, b0, b1 = major[lo:hi], major[lo + 1 : hi + 1], minor[lo:hi], minor[lo + 1 : hi + 1]
        if not bool(((a1 > a0) | ((a1 == a0) & ((b1 > b0) if strict else (b1 >= b0)))).all()):
            return False
    return True


def tag_major(tags: np.ndarray, classes: np.ndarray, n_classes: int) -> bool:
    """``ascending(tags * n_classes + classes)`` without that key: by pairs where every
    class is in [0, n_classes) (then the key's order is the pairs' order), else the key."""
    if len(tags) < 2:
        return True
    if int(classes.min()) >= 0 and int(classes.max()) < n_classes:
        return lex_ascending(tags, classes)
    return ascending(tags.astype(np.int64) * n_classes + classes)


def pair_columns(
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]], as_float: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The classes and shared elements of every pair ``found`` (batch after batch),
    each one array; ``found`` is emptied (its batches freed before what follows).
    ``as_float``: the elements as float64, converted as they are joined (the weights
    np.bincount takes, without an int64 copy first)."""
    cls = np.concatenate([c for _f, c, _e in found])
    elems = np.concatenate([e for _f, _c, e in found], dtype=np.float64 if as_float else None)
    found.clear()
    return cls, elems


def met_twice(rows: list[np.ndarray], n_frags: int) -> bool:
    """Whether some stored row (of ``n_frags``) is in ``rows`` (arrays of rows) twice: a
    table of flags filled array by array, its count beside theirs."""
    met = np.zeros(n_frags, bool)
    for r in rows:
        met[r] = True
    return int(np.count_nonzero(met)) != sum(len(r) for r in rows)


def rows_at(
    entries: Sequence[TensorBoxes], fstart: np.ndarray, rows: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of stored rows ``rows`` (ascending, numbered as fstart says),
    padded to ``width`` dimensions with (0, 1)."""
    if entries and all(len(e.global_shape) == width for e in entries):
        every_off = _one_view([e.offsets for e in entries])  # every row numbered as fstart says
        every_len = _one_view([e.lengths for e in entries])
        if every_off is not None and every_len is not None:  # one gather each, not one per tensor
            return np.take(every_off, rows, axis=0), np.take(every_len, rows, axis=0)
    off = np.zeros((len(rows), width), np.int64)
    lens = np.ones((len(rows), width), np.int64)
    which = np.searchsorted(fstart, rows, side="right") - 1
    cuts = np.searchsorted(which, np.arange(len(entries) + 1)).tolist()
    for i in np.unique(which).tolist():
        a, b = cuts[i], cuts[i + 1]
        e = entries[i]
        d = len(e.global_shape)
        local = rows[a:b] - fstart[i]
        off[a:b, :d] = np.take(e.offsets, local, axis=0)
        lens[a:b, :d] = np.take(e.lengths, local, axis=0)
    return off, lens


def general_pairs(
    entries: Sequence[TensorBoxes],
    used: list[int],
    slot: np.ndarray,
    fstart: np.ndarray,
    shapes: dict[int, tuple[int, ...]],
    extents: np.ndarray,
    width: int,
    left: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fragment, class, shared elements) of every pair of the ``left`` boxes (tensor,
    offsets, lengths, class) by the general overlap test, against every stored row of
    their tensors; pairs with a replica of a stored box other than its first are
    dropped (one key per distinct stored box)."""
    tids = np.concatenate([t for t, _o, _n, _c in left])
    b_off = np.concatenate([o for _t, o, _n, _c in left])
    b_len = np.concatenate([n for _t, _o, n, _c in left])
    b_cls = np.concatenate([c for _t, _o, _n, c in left])
    picked = np.unique(slot[tids]).tolist()
    counts = [entries[i].num_fragments for i in picked]
    f_tid = np.repeat(np.array([used[i] for i in picked], np.int64), counts)
    glob = np.concatenate([np.arange(fstart[i], fstart[i + 1]) for i in picked]).astype(np.int64)
    f_off, f_len = rows_at(entries, fstart, glob, width)
    bi, fl, elems = overlap_volumes(BoxArrays(f_off, f_len, f_tid), BoxArrays(b_off, b_len, tids), extents=extents)
    if not len(bi):
        return _EMPTY, _EMPTY, _EMPTY
    hit = np.zeros(len(f_tid), bool)
    hit[fl] = True
    box_of = _box_ids(f_tid, f_off, f_len, shapes, np.flatnonzero(hit))
    first_copy = box_of[fl] == fl
    if not first_copy.all():
        bi, fl, elems = bi[first_copy], fl[first_copy], elems[first_copy]
    return glob[fl], b_cls[bi], elems


_EMPTY = np.zeros(0, np.int64)


#: Stored rows examined at once when indexing them (bounds the memory of the pass)
_ROW_BATCH = 1 << 16


def _rank_runs(entries: Sequence[TensorBoxes], limit: int) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of ``entries`` of one number of dimensions each,
    holding about ``limit`` rows (at least one entry)."""
    out, a, acc = [], 0, 0
    for i, e in enumerate(entries):
        if i > a and (acc + e.num_fragments > limit or len(e.global_shape) != len(entries[a].global_shape)):
            out.append((a, i))
            a, acc = i, 0
        acc += e.num_fragments
    if a < len(entries):
        out.append((a, len(entries)))
    return out


def joined(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``np.concatenate(arrays)`` (along the first axis), without the copy where they
    are consecutive slices of one C-contiguous array, as :meth:`Catalog.boxes` returns
    every tensor's boxes (views of one gather): at millions of rows the copy is the
    largest allocation of the cut index."""
    view = _one_view(arrays)
    return np.concatenate(arrays) if view is None else view


def _one_view(arrays: Sequence[np.ndarray]) -> np.ndarray | None:
    """The arrays as one view of their common base where they are consecutive slices
    of it (:func:`joined`), else None."""
    held = [a for a in arrays if len(a)]  # an empty slice adds nothing (and numpy may move its pointer)
    first = held[0] if held else arrays[0]
    base = first.base
    if (
        held
        and isinstance(base, np.ndarray)
        and base.ndim == first.ndim >= 1
        and base.dtype == first.dtype
        and base.shape[1:] == first.shape[1:]
        and base.flags.c_contiguous
    ):
        row = first.itemsize * math.prod(first.shape[1:])
        base_at = base.__array_interface__["data"][0]
        start = at = first.__array_interface__["data"][0]
        n = 0
        for a in held:
            if a.base is not base or a.__array_interface__["data"][0] != at or not a.flags.c_contiguous:
                break
            at += a.nbytes
            n += len(a)
        else:
            if row and (start - base_at) % row == 0:
                lo = (start - base_at) // row
                return base[lo : lo + n]
    return None


def _cut_rows(
    entries: Sequence[TensorBoxes], extents: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray]:
    """For tensors of one rank (``extents``: their shapes, padded with 1): whether each
    is stored as disjoint slices along one dimension (every other dimension whole; empty
    rows ignored), that dimension (the lowest not whole; 0 where every one is), and for
    those that are, the non-empty rows' intervals on it (start, end, sorted by tensor
    and start) with (row, tensor) of each: the row counted from the first entry's first
    row, the tensor as its position in ``entries``. Last, per tensor, whether those
    intervals are shown to tile it exactly (at least one, abutting from 0 to its extent
    on that dimension): the catalog's tiling check, proven here for those tensors."""
    counts = np.array([e.num_fragments for e in entries], np.int64)
    ndim = len(entries[0].global_shape)
    if ndim:
        off = joined([e.offsets for e in entries])
        lens = joined([e.lengths for e in entries])
    else:  # scalars: one dimension of length 1
        off, lens = np.zeros((int(counts.sum()), 1), np.int64), np.ones((int(counts.sum()), 1), np.int64)
    n_t = len(entries)
    local = np.repeat(np.arange(n_t, dtype=np.intp), counts)  # intp: an index (int32 ones are copied at each use)
    live = rows_positive(lens)
    n_partial = np.zeros(n_t, np.int64)
    k = np.zeros(n_t, np.int64)
    for d in reversed(range(off.shape[1])):
        whole = (off[:, d] == 0) & (lens[:, d] == np.repeat(extents[:, d], counts))
        has = np.bincount(local[live & ~whole], minlength=n_t) > 0
        n_partial += has
        k[has] = d
    ok = n_partial <= 1
    if ok.all() and live.all() and (k == k[0]).all():  # the usual layout: columns, no gathers
        rows, tl, s, n = np.arange(len(local)), local, off[:, int(k[0])], lens[:, int(k[0])]
    else:
        rows = np.flatnonzero(live & ok[local])
        tl = local[rows]
        kl = k[tl]
        if (kl == kl[0]).all() if len(kl) else True:
            col = int(kl[0]) if len(kl) else 0
            s, n = off[rows, col], lens[rows, col]
        else:
            s, n = off[rows, kl], lens[rows, kl]
    same = tl[1:] == tl[:-1]
    if (same & (s[1:] < s[:-1])).any():
        order = np.lexsort((s, tl))
        rows, tl, s, n = rows[order], tl[order], s[order], n[order]
        same = tl[1:] == tl[:-1]
    e = s + n
    overlap = same & (s[1:] < e[:-1])  # replicas or overlapping rows: the general test
    if overlap.any():
        ok[tl[1:][overlap]] = False
        keep = ok[tl]
        rows, tl, s, e = rows[keep], tl[keep], s[keep], e[keep]
        same = tl[1:] == tl[:-1]
    return ok, k, s, e, (rows, tl), _tiled(ok, k, s, e, tl, same, extents)


def _tiled(
    ok: np.ndarray, k: np.ndarray, s: np.ndarray, e: np.ndarray, tl: np.ndarray, same: np.ndarray, extents: np.ndarray
) -> np.ndarray:
    """Per tensor: whether its intervals (sorted by tensor and start, disjoint; ``same``:
    whether each follows one of the same tensor) abut from 0 to the extent of its cut
    dimension, at least one of them. With every other dimension whole on its non-empty
    rows (``ok``), those rows tile the tensor exactly."""
    n_t = len(ok)
    if not len(tl):
        return np.zeros(n_t, bool)
    gap = np.zeros(n_t, bool)
    gap[tl[1:][same & (s[1:] != e[:-1])]] = True
    head = np.r_[True, ~same]
    tail = np.r_[~same, True]
    first_s = np.full(n_t, -1, np.int64)
    last_e = np.full(n_t, -1, np.int64)
    first_s[tl[head]] = s[head]
    last_e[tl[tail]] = e[tail]
    return ok & ~gap & (first_s == 0) & (last_e == extents[np.arange(n_t), k])


@dataclasses.dataclass(frozen=True)
class CutIndex:
    """The stored rows of every tensor whose non-empty rows are disjoint slices along
    one dimension (its cut; every other dimension whole), as intervals on one line:
    tensor t's cut coordinate x sits at ``base[t] + x`` (tensors apart by their extent
    plus one). The rows' intervals are disjoint and sorted, so the rows a box meets
    (one whole on every other dimension, inside its tensor) are one window: from the
    first row ending past its start to the last starting before its end. Windows are
    looked up in two prefix-count tables over the line, or binary searches where the
    line is long (flat 1-D tensors)."""

    eligible: np.ndarray  # bool (names,)
    #: bool (names,): tensors whose stored rows are shown to tile them (:func:`_tiled`)
    tiled: np.ndarray
    cut: np.ndarray  # int64 (names,)
    base: np.ndarray  # int64 (names,)
    other: np.ndarray  # int64 (names,): elements per unit of the cut dimension
    extents: np.ndarray  # int64 (names, width)
    starts: np.ndarray  # (N,) sorted, on the line
    ends: np.ndarray  # (N,)
    rows: np.ndarray | None  # (N,) the stored row of each interval; None: interval i is row i
    ends_upto: np.ndarray | None  # (line,) intervals ending at or before x
    #: (line,) intervals starting at or before x; None with ``ends_upto`` where every
    #: tensor indexed is tiled (then inside a tensor it is ``ends_upto`` + 1)
    starts_upto: np.ndarray | None

    @classmethod
    def build(
        cls, entries: Sequence[TensorBoxes], used: list[int], fstart: np.ndarray, extents: np.ndarray, n_names: int
    ) -> CutIndex | None:
        """The index of ``entries`` (tensors ``used``, their rows numbered from
        ``fstart``), None where no tensor qualifies or the line would be too long.
        Vectorised over tensors of equal rank, a bounded number of rows at a time."""
        eligible = np.zeros(n_names, bool)
        tiled = np.zeros(n_names, bool)
        cut = np.zeros(n_names, np.int64)
        base = np.zeros(n_names, np.int64)
        bound = sum(max(e.global_shape, default=1) + 1 for e in entries)  # the line's length at most
        if bound >= 1 << 62:
            return None
        dtype = np.int32 if bound < 1 << 31 and int(fstart[-1]) < 1 << 31 else np.int64
        # every interval written in place (at most one per row; pages past the last never touched);
        # rows only once they are not the stored rows in order (the usual layout: never)
        starts, ends, rows = (np.empty(int(fstart[-1]), dtype) for _ in range(3))
        n = line = 0
        in_order = True
        for a, b in _rank_runs(entries, _ROW_BATCH):
            ts = np.array(used[a:b], np.int64)
            ok, k, s, e, (row, tensor), tiled[ts] = _cut_rows(entries[a:b], extents[ts])
            span = np.where(ok, extents[ts, k] + 1, 0)
            base[ts] = line + np.cumsum(span) - span
            line += int(span.sum())
            eligible[ts], cut[ts] = ok, k
            at, n = n, n + len(row)
            shift = base[ts][tensor]
            np.add(s, shift, out=starts[at:n], casting="unsafe")  # values below ``bound``
            np.add(e, shift, out=ends[at:n], casting="unsafe")
            if in_order and (len(row) != int(fstart[b] - fstart[a]) or not ascending(row)):
                in_order = False  # distinct rows of the run, every one, ascending: rows at..n - 1
                rows[:at] = np.arange(at, dtype=dtype)
            if not in_order:
                np.add(row, fstart[a], out=rows[at:n], casting="unsafe")
        if not eligible.any():
            return None
        ext = extents[np.arange(n_names), cut]
        other = np.where(ext > 0, row_products(extents) // np.maximum(ext, 1), 0)
        starts, ends = starts[:n], ends[:n]
        ends_upto = starts_upto = None
        if line <= 4 * len(starts) + (1 << 22):  # dense tables: a lookup each instead of binary searches
            ends_upto = _upto(ends, line, dtype)
            # where every tensor indexed is tiled, a place inside one lies in exactly one interval:
            # intervals starting at or before it are those ending at or before it, plus one
            starts_upto = None if bool(tiled[eligible].all()) else _upto(starts, line, dtype)
        row_of = None if in_order else rows[:n]
        return cls(eligible, tiled, cut, base, other, extents, starts, ends, row_of, ends_upto, starts_upto)

    def pairs(
        self, tids: np.ndarray, off: np.ndarray, lens: np.ndarray, *, elements: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """For boxes (tensor, (B, width) offsets, lengths): (box, stored row, shared
        elements) of every pair met, for the boxes it can match, and a mask of the
        boxes it cannot (for the general test). ``elements=False``: None for the shared
        elements (not computed)."""
        ok = self.eligible[tids]
        k = self.cut[tids]
        uniform = bool(len(k)) and bool((k == k[0]).all())
        if uniform:
            s, n = off[:, int(k[0])], lens[:, int(k[0])]
        else:
            rows = np.arange(len(tids))
            s, n = off[rows, k], lens[rows, k]
        for d in range(off.shape[1]):
            if uniform and d == int(k[0]):
                continue
            whole = (off[:, d] == 0) & (lens[:, d] == self.extents[:, d][tids])
            ok &= whole if uniform else whole | (k == d)
        ok &= (s >= 0) & (n >= 0) & (s + n <= self.extents[np.arange(len(self.cut)), self.cut][tids])
        live = ok & rows_positive(lens)  # empty boxes meet nothing
        if live.all():
            q = None
            lo = self.base[tids] + s
            hi = lo + n
        else:
            q = np.flatnonzero(live)
            lo = self.base[tids[q]] + s[q]
            hi = lo + n[q]
        if self.ends_upto is not None:
            first = self.ends_upto[lo]
            if self.starts_upto is None:  # every tensor tiled: hi - 1 lies in one interval of its tensor
                width = self.ends_upto[hi - 1] + 1
                width -= first
            else:
                width = self.starts_upto[hi - 1] - first
        else:
            first = np.searchsorted(self.ends, lo, side="right")
            width = np.searchsorted(self.starts, hi, side="left") - first
        span: np.ndarray | None = None
        if bool((width == 1).all()):  # one stored row each (the same layout): no gathers by query
            pos = first
            box = np.arange(len(width)) if q is None else q
            if elements:
                span = np.minimum(hi, self.ends[pos]) - np.maximum(lo, self.starts[pos])
                span *= self.other[tids if q is None else tids[box]]
        else:
            # every (box, row) pair of the windows: positions first, first + 1, ... of each
            # box, one repeat each (no step array summed), box bounds repeated, not gathered
            np.clip(width, 0, None, out=width)
            heads = np.cumsum(width, dtype=np.int64)
            heads -= width
            pos = np.repeat(first - heads, width)
            pos += np.arange(len(pos), dtype=np.int64)
            qi = np.repeat(np.arange(len(width)), width)
            box = qi if q is None else q[qi]
            if elements:
                span = np.minimum(np.repeat(hi, width), np.take(self.ends, pos))
                span -= np.maximum(np.repeat(lo, width), np.take(self.starts, pos))
                span *= self.other[tids[box]]
        rows = pos.astype(self.starts.dtype, copy=False) if self.rows is None else self.rows[pos]
        return box, rows, span, ~ok


def _upto(points: np.ndarray, line: int, dtype: type) -> np.ndarray:
    """For ``points`` in [0, line): how many are at or before each x of the line
    (``np.cumsum(np.bincount(points, minlength=line))``), in one table of ``dtype``: a
    flag at each point, then a running sum in place (the interval ends and starts are
    distinct; no count per point nor a line-long int64 array). Repeated points or
    points off the line (rows outside their tensor, which the catalog refuses next)
    take the counting way."""
    table: np.ndarray = np.zeros(line, dtype)
    if len(points) and int(points.min()) >= 0 and int(points.max()) < line:
        table[points] = 1
        np.cumsum(table, out=table)
        if int(table[-1]) == len(points):  # each point once
            return table
    elif not len(points):
        return table
    return np.cumsum(np.bincount(points, minlength=line), dtype=dtype)


def one_box_per_tensor(tids: np.ndarray, box_class: np.ndarray) -> bool:
    """Whether no class wants two boxes of one tensor (then every (fragment, class)
    pair of the overlaps is distinct). Usually each list names its tensors in
    ascending order, which shows it at once."""
    same_class = box_class[1:] == box_class[:-1]
    if ((tids[1:] > tids[:-1]) | ~same_class).all():
        return True
    keys = box_class * (int(tids.max()) + 1) + tids
    return len(np.unique(keys)) == len(keys)


def padded_boxes(
    tids: np.ndarray, ndim_of: np.ndarray, offs: list[np.ndarray], lens: list[np.ndarray], width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat per-box values (each box ndim_of[tensor] values) as (B, width) arrays,
    padded with offset 0 and length 1."""
    flat_off = np.concatenate(offs) if offs else np.zeros(0, np.int64)
    flat_len = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    nd = ndim_of[tids]
    if int(nd.sum()) != len(flat_off) or len(flat_off) != len(flat_len):
        raise ValueError("wanted boxes do not match their tensors' dimensions")
    if len(tids) and (nd == width).all():  # every tensor of the same rank: a reshape
        return flat_off.reshape(-1, width), flat_len.reshape(-1, width)
    rows = np.repeat(np.arange(len(tids)), nd)
    cols = np.arange(len(flat_off)) - np.repeat(np.cumsum(nd) - nd, nd)
    out_off = np.zeros((len(tids), width), np.int64)
    out_len = np.ones((len(tids), width), np.int64)
    out_off[rows, cols] = flat_off
    out_len[rows, cols] = flat_len
    return out_off, out_len


def _box_ids(
    f_tid: np.ndarray, f_off: np.ndarray, f_len: np.ndarray, shapes: dict[int, tuple[int, ...]], rows: np.ndarray
) -> np.ndarray:
    """Per stored row of ``rows`` (others -1): the first row (in catalog order) holding
    the same box of the same tensor, so replicas of a box share one id. ``f_tid`` is
    grouped by tensor. A tensor whose rows together hold exactly as many elements as
    it has holds no replica (its rows tile it, which the catalog checks for every
    tensor it holds whole); only the others are searched for identical rows."""
    ids = np.full(len(f_tid), -1, np.int64)
    if not len(rows):
        return ids
    seg = np.flatnonzero(np.r_[True, f_tid[1:] != f_tid[:-1]])
    held = np.add.reduceat(row_products(f_len), seg).tolist()
    replicated_tensors = [t for t, n in zip(f_tid[seg].tolist(), held, strict=True) if n != math.prod(shapes[t])]
    replicated = np.isin(f_tid[rows], replicated_tensors) if replicated_tensors else np.zeros(len(rows), bool)
    ids[rows[~replicated]] = rows[~replicated]
    dup = rows[replicated]
    if len(dup):
        keys = np.concatenate([f_tid[dup, None], f_off[dup], f_len[dup]], axis=1)
        _u, first_idx, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        ids[dup] = dup[first_idx][inverse.reshape(-1)]
    return ids
