"""Which bytes of which files fill which destination boxes (pure; no I/O).

For every destination box and every stored fragment it overlaps, the overlap is cut
into runs contiguous both in the fragment (so one ranged read fetches it) and in the
destination (so it lands in place). Bytes planned equal bytes needed exactly; reads
for checksum verification are planned separately (read_exec).

Planning works on the catalog's columns (``TensorEntry.offsets``/``lengths``, numpy):
the fragments that meet a box are found with a sort and binary searches on one cut
dimension (:func:`overlap_pairs`), and only those become :class:`Fragment` objects.
So a rank's planning grows with the boxes it wants and the fragments they meet, not
with the number of fragments in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from bcp.errors import CorruptCheckpointError
from bcp.metadata import Fragment, TensorEntry, itemsize
from bcp.metadata.geometry import (
    Box,
    BoxArrays,
    ascending,
    common_runs,
    expand_windows,
    regions_abut,
    row_products,
    rows_positive,
    stable_order,
    sweep_windows,
    tiling_problem,
)


@dataclasses.dataclass(frozen=True, slots=True)
class RunSet:
    """Equal-length runs from one fragment into one destination box."""

    fragment: Fragment
    #: index of the destination (in the caller's list of boxes)
    dest: int
    #: run starts in bytes, relative to the fragment's first byte
    src: np.ndarray
    #: run starts in bytes, relative to the destination box's first byte (row-major)
    dst: np.ndarray
    #: bytes per run
    run_bytes: int

    @property
    def nbytes(self) -> int:
        return len(self.src) * self.run_bytes


_EMPTY = np.zeros(0, np.int64)
#: Candidate (box, fragment) pairs tested at once: bounds the memory of a query.
_PAIR_CHUNK = 1 << 21


def overlap_pairs(
    frags: BoxArrays, boxes: BoxArrays, *, extents: np.ndarray | None = None, ordered: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Every (box i, fragment j) whose boxes share at least one element, as two index
    arrays sorted by box, then fragment. Rows are (N, D) int64 boxes; their groups
    (default: all 0) keep boxes of different tensors apart (boxes of one group only
    meet fragments of the same group). Empty boxes meet nothing; with D = 0 (scalars)
    every box meets every fragment of its group.

    Per group, the dimension cut most often is chosen; fragments are sorted by their
    start on it, and a box's candidates are the window of fragments that start before
    it ends and whose running maximum end lies past its start
    (:func:`~bcp.metadata.geometry.sweep_windows`). Candidates are then tested on
    every dimension. Disjoint fragments along one dimension (FSDP's dim 0, TP's dim
    1) give windows of exactly the fragments met. ``extents`` (groups, D): the shape
    of each group's tensor, when known (saves a pass); ``ordered=False`` returns the
    pairs in no particular order.

    Memory: the candidates are tested in chunks of about 2 million pairs."""
    if len(frags) == 0 or len(boxes) == 0:
        return _EMPTY, _EMPTY
    if frags.group is None and boxes.group is None and frags.ndim:
        return _pairs_one_tensor(frags, boxes)
    bi, fi, _v = _pairs_general(frags, boxes, extents=extents, ordered=ordered)
    return bi, fi


def overlap_volumes(
    frags: BoxArrays, boxes: BoxArrays, *, extents: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`overlap_pairs` (grouped, in no particular order) with the number of
    elements each pair shares, computed alongside the overlap test (along a cut
    dimension only, where every other dimension is whole on both sides)."""
    if len(frags) == 0 or len(boxes) == 0:
        return _EMPTY, _EMPTY, _EMPTY
    bi, fi, vol = _pairs_general(frags, boxes, extents=extents, ordered=False, volume=True)
    assert vol is not None
    return bi, fi, vol


def _pairs_general(
    frags: BoxArrays,
    boxes: BoxArrays,
    *,
    extents: np.ndarray | None = None,
    ordered: bool = True,
    volume: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """overlap_pairs over many tensors at once, in bounded chunks of candidates, with
    each pair's shared element count when ``volume``. ``extents`` (groups, D), when
    known: every box of group g lies inside extents[g]."""
    fg, bg = frags.groups(), boxes.groups()
    if frags.ndim == 0:  # scalars: one dimension of length 1 behaves the same
        frags = BoxArrays(np.zeros((len(frags), 1), np.int64), np.ones((len(frags), 1), np.int64))
        boxes = BoxArrays(np.zeros((len(boxes), 1), np.int64), np.ones((len(boxes), 1), np.int64))
        extents = None if extents is None else np.ones((len(extents), 1), np.int64)
    f_off, f_len, b_off, b_len = frags.offsets, frags.lengths, boxes.offsets, boxes.lengths
    n_dim = f_off.shape[1]
    # empty boxes and fragments meet nothing: their cut-dimension extents are emptied
    # below (cheaper than dropping them from every array)
    f_dead = None if f_len.min() > 0 else ~rows_positive(f_len)
    b_dead = None if b_len.min() > 0 else ~rows_positive(b_len)
    groups = int(max(fg.max(), bg.max())) + 1 if extents is None else len(extents)
    if n_dim == 1:
        cut = np.zeros(groups, np.int64)
    else:
        nonzero = [np.bincount(fg, weights=f_off[:, d] != 0, minlength=groups) for d in range(n_dim)]
        cut = np.stack(nonzero, axis=1).argmax(axis=1)
    if (cut == cut[0]).all():  # one cut dimension for all: plain columns
        k = int(cut[0])
        fs, bs = f_off[:, k], b_off[:, k]
        fe, be = fs + f_len[:, k], bs + b_len[:, k]
    else:
        fk, bk = cut[fg], cut[bg]
        f_rows, b_rows = np.arange(len(f_off)), np.arange(len(b_off))
        fs, bs = f_off[f_rows, fk], b_off[b_rows, bk]
        fe, be = fs + f_len[f_rows, fk], bs + b_len[b_rows, bk]
    if groups > 1:
        if extents is not None:
            extent = extents[np.arange(groups), cut]
        else:
            extent = np.zeros(groups, np.int64)
            np.maximum.at(extent, fg, fe)
            np.maximum.at(extent, bg, be)
        if int(extent.sum()) + groups >= 1 << 62:  # coordinates would overflow: one group at a time
            return _pairs_by_group(BoxArrays(f_off, f_len, fg), BoxArrays(b_off, b_len, bg), volume)
        base = np.zeros(groups, np.int64)
        np.cumsum(extent[:-1] + 1, out=base[1:])
        f_base, b_base = base[fg], base[bg]
        fs, fe, bs, be = fs + f_base, fe + f_base, bs + b_base, be + b_base
    if f_dead is not None:
        fe = np.where(f_dead, fs, fe)
    if b_dead is not None:
        be = np.where(b_dead, bs, be)
    # both sides sorted along the cut coordinate: the searches and the candidate
    # gathers below then walk memory in order (millions of boxes stay cache-friendly)
    # (a catalog's rows usually are already; boxes usually are once grouped by tensor)
    order = None if ascending(fs) else np.argsort(fs)  # ties in any order: a window holds all of them
    border = stable_order(bg) if groups > 1 else None
    if not ascending(bs if border is None else bs[border]):
        border = np.argsort(bs)
    starts, ends = (fs, fe) if order is None else (fs[order], fe[order])
    if border is not None:
        bs, be = bs[border], be[border]
    # dimensions other than the cut one that some box or fragment does not span whole
    # must be tested too; with none (FSDP, TP: one cut dimension) the test is 1-D
    others = _partial_dims(frags, boxes, fg, bg, cut, extents)
    # shared elements = the overlap along the cut dimension x the overlap on ``others``
    # x the extents of the dimensions both sides span whole (per group); with cut
    # dimensions differing by group, ``others`` holds every dimension
    uniform = bool((cut == cut[0]).all())
    rest = None
    if volume and uniform and extents is not None:
        whole = [d for d in range(n_dim) if d != int(cut[0]) and d not in others]
        if whole:
            rest = np.prod(extents[:, whole], axis=1)[fg if order is None else fg[order]]
    if others:
        f_side = frags if order is None else frags.take(order)
        b_side = boxes if border is None else boxes.take(border)
        f_off, f_len = f_side.offsets[:, others], f_side.lengths[:, others]
        b_off, b_len = b_side.offsets[:, others], b_side.lengths[:, others]
    first, width = sweep_windows(starts, ends, bs, be)
    out_b: list[np.ndarray] = []
    out_f: list[np.ndarray] = []
    out_v: list[np.ndarray] = []
    cum = np.cumsum(width)
    lo = 0
    while lo < len(b_off):
        hi = int(np.searchsorted(cum, (cum[lo - 1] if lo else 0) + _PAIR_CHUNK, side="right"))
        hi = max(hi, lo + 1)
        n = int(cum[hi - 1] - (cum[lo - 1] if lo else 0))
        if n:
            bi, fi = expand_windows(first[lo:hi], width[lo:hi])
            bi += lo
            low = np.maximum(bs[bi], starts[fi])
            span = np.minimum(be[bi], ends[fi]) - low
            meet = span > 0
            side = None
            if others:
                fo, fn = np.take(f_off, fi, axis=0), np.take(f_len, fi, axis=0)  # faster than [fi] for rows
                bo, bn = np.take(b_off, bi, axis=0), np.take(b_len, bi, axis=0)
                side = np.minimum(bo + bn, fo + fn) - np.maximum(bo, fo)
                meet &= rows_positive(side)
            bi, fi = bi[meet], fi[meet]
            if volume:
                vol = span[meet] if uniform else np.ones(len(bi), np.int64)
                if side is not None:
                    vol = vol * row_products(side[meet])
                if rest is not None:
                    vol = vol * rest[fi]
                out_v.append(vol)
            out_b.append(bi)
            out_f.append(fi)
        lo = hi
    if not out_b:
        return _EMPTY, _EMPTY, (_EMPTY if volume else None)
    bi, fi = np.concatenate(out_b), np.concatenate(out_f)
    if border is not None:
        bi = border[bi]
    if order is not None:
        fi = order[fi]
    vols = np.concatenate(out_v) if volume else None
    if ordered:
        sort = np.lexsort((fi, bi))
        bi, fi = bi[sort], fi[sort]
        vols = None if vols is None else vols[sort]
    return bi, fi, vols


def _partial_dims(
    frags: BoxArrays, boxes: BoxArrays, fg: np.ndarray, bg: np.ndarray, cut: np.ndarray, extents: np.ndarray | None
) -> list[int]:
    """Dimensions that are not the cut one of every group and that some fragment or box
    does not span whole (every dimension but a single shared cut one, without extents)."""
    n_dim = frags.offsets.shape[1]
    if extents is None or not (cut == cut[0]).all():
        return [d for d in range(n_dim) if not (cut == d).all()]
    out = []
    for d in range(n_dim):
        if d == int(cut[0]):
            continue
        whole_f = (frags.offsets[:, d] == 0).all() and (frags.lengths[:, d] == extents[fg, d]).all()
        whole_b = whole_f and (boxes.offsets[:, d] == 0).all() and (boxes.lengths[:, d] == extents[bg, d]).all()
        if not whole_b:
            out.append(d)
    return out


def _pairs_one_tensor(frags: BoxArrays, boxes: BoxArrays) -> tuple[np.ndarray, np.ndarray]:
    """overlap_pairs for one tensor (the planner's case: a few boxes, many fragments),
    with as few numpy calls as possible: no sort when the fragments are already in
    order along the cut dimension (a catalog's rows usually are). Empty boxes and
    fragments fall out of the final test (an empty extent meets nothing)."""
    f_off, f_len, b_off, b_len = frags.offsets, frags.lengths, boxes.offsets, boxes.lengths
    k = int(np.count_nonzero(f_off, axis=0).argmax()) if f_off.shape[1] > 1 else 0
    fs = f_off[:, k]
    fe = fs + f_len[:, k]
    order = None if ascending(fs) else np.argsort(fs, kind="stable")
    starts, ends = (fs, fe) if order is None else (fs[order], fe[order])
    if len(b_off) == 1:  # one box: scalar searches (the windows of sweep_windows, without arrays)
        reach = np.maximum.accumulate(ends)
        b_start = int(b_off[0, k])
        lo = int(reach.searchsorted(b_start, side="right"))
        hi = int(starts.searchsorted(b_start + int(b_len[0, k]), side="left"))
        if hi <= lo:
            return _EMPTY, _EMPTY
        bi = np.zeros(hi - lo, np.int64)
        pos = np.arange(lo, hi)
    else:
        bs = b_off[:, k]
        first, width = sweep_windows(starts, ends, bs, bs + b_len[:, k])
        if int(width.sum()) > _PAIR_CHUNK:  # many candidates: the general path tests them in bounded chunks
            bi, fi, _v = _pairs_general(frags, boxes)
            return bi, fi
        bi, pos = expand_windows(first, width)
    fi = pos if order is None else order[pos]
    bo, bn = np.take(b_off, bi, axis=0), np.take(b_len, bi, axis=0)  # faster than [bi] for rows
    fo, fn = np.take(f_off, fi, axis=0), np.take(f_len, fi, axis=0)
    meet = (np.maximum(bo, fo) < np.minimum(bo + bn, fo + fn)).all(axis=1)
    bi, fi = bi[meet], fi[meet]
    if order is not None:
        sort = np.lexsort((fi, bi))
        bi, fi = bi[sort], fi[sort]
    return bi, fi


def _pairs_by_group(
    frags: BoxArrays, boxes: BoxArrays, volume: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    fg, bg = frags.groups(), boxes.groups()
    out_b, out_f, out_v = [_EMPTY], [_EMPTY], [_EMPTY]
    for g in np.unique(bg).tolist():
        fr, br = np.flatnonzero(fg == g), np.flatnonzero(bg == g)
        if not len(fr):
            continue
        f_side, b_side = frags.take(fr), boxes.take(br)
        bi, fi, vol = _pairs_general(
            BoxArrays(f_side.offsets, f_side.lengths), BoxArrays(b_side.offsets, b_side.lengths), volume=volume
        )
        out_b.append(br[bi])
        out_f.append(fr[fi])
        if vol is not None:
            out_v.append(vol)
    bi, fi = np.concatenate(out_b), np.concatenate(out_f)
    sort = np.lexsort((fi, bi))
    return bi[sort], fi[sort], (np.concatenate(out_v)[sort] if volume else None)


def choose_among(entry: TensorEntry, rows: np.ndarray, prefer_rank: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One row per distinct stored box among ``rows`` (ascending row indices holding
    every replica of their boxes): (chosen rows, the first row of each one's box).
    Replicas are spread by ``prefer_rank``: the (prefer_rank mod copies)-th copy in
    catalog order."""
    if len(rows) <= 1:
        return rows, rows
    boxes = np.concatenate([entry.offsets[rows], entry.lengths[rows]], axis=1)
    if len(rows) <= 64 and len({tuple(b) for b in boxes.tolist()}) == len(rows):
        return rows, rows  # the usual case, checked without numpy's row-unique machinery
    _uniq, inverse = np.unique(boxes, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if len(_uniq) == len(rows):
        return rows, rows
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse)
    starts = np.cumsum(counts) - counts
    return rows[order[starts + prefer_rank % counts]], rows[order[starts]]


def touched_rows(
    entry: TensorEntry, dest_boxes: Sequence[Box], prefer_rank: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fragment rows reading ``dest_boxes`` uses: (box index, row) of every pair
    that meets, one replica per distinct stored box, sorted by box then by the catalog
    order of each stored box's first copy; plus the boxes as (offsets, lengths) arrays."""
    wanted = BoxArrays.of(dest_boxes, len(entry.global_shape))
    if entry.num_fragments == 1 and not entry.offsets.any() and (entry.lengths == entry.global_shape).all():
        # one fragment holding the whole tensor (a single writer's save): it meets every non-empty box
        bi = np.flatnonzero((wanted.lengths > 0).all(axis=1))
        return bi, np.zeros(len(bi), np.int64), wanted.offsets, wanted.lengths
    bi, fi = overlap_pairs(BoxArrays(entry.offsets, entry.lengths), wanted)
    hit = fi if len(dest_boxes) == 1 else np.unique(fi)  # one box: rows ascending, each once
    chosen, first = choose_among(entry, hit, prefer_rank)
    if len(chosen) != len(hit):
        rank = np.full(entry.num_fragments, -1, np.int64)
        rank[chosen] = first
        key = rank[fi]
        keep = key >= 0
        bi, fi, key = bi[keep], fi[keep], key[keep]
        sort = np.lexsort((key, bi))
        bi, fi = bi[sort], fi[sort]
    return bi, fi, wanted.offsets, wanted.lengths


#: the run offsets of a whole-fragment plan (read-only: shared by every such plan)
_ZERO = np.zeros(1, np.int64)
_ZERO.setflags(write=False)


def _whole_from_one_fragment(
    entry: TensorEntry, dest_boxes: list[Box], size: int, in_memory: frozenset[Box], dest: int
) -> list[RunSet] | None:
    """The plan of the usual load (one writer saved the tensor whole, the whole tensor
    is wanted): one run of all its bytes, found without the general planner's numpy
    calls (they cost 0.1-0.2 ms a tensor, most of a 10,000-tensor load's planning).
    None when the case is any other."""
    if len(dest_boxes) != 1 or entry.num_fragments != 1:
        return None
    shape = entry.global_shape
    d_off, d_len = dest_boxes[0]
    if tuple(d_len) != shape or any(d_off):
        return None
    # the one row is the whole tensor iff it starts at 0 and spans the shape; one
    # comparison of its coordinates as a list (no numpy call per dimension)
    coords = entry.offsets[0].tolist() + entry.lengths[0].tolist() if shape else []
    if coords != [0] * len(shape) + list(shape):
        return None
    numel = math.prod(shape)
    if not numel or (in_memory and ((0,) * len(shape), shape) in in_memory):
        return []
    # the row as entry.fragment(0) gives it, from the coordinates known already
    frag = Fragment(
        entry.fqn,
        entry.key_path,
        entry.dtype,
        shape,
        (0,) * len(shape),
        shape,
        entry.file_names[int(entry.files[0])],
        int(entry.byte_offsets[0]),
        int(entry.sizes[0]),
        entry.checksums(0),
        int(entry.writer_ranks[0]),
    )
    return [RunSet(frag, dest, _ZERO, _ZERO, numel * size)]


def plan_tensor_reads(
    entry: TensorEntry,
    dest_boxes: list[Box],
    *,
    prefer_rank: int = 0,
    in_memory: frozenset[Box] = frozenset(),
    dest: int = 0,
) -> list[RunSet]:
    """Runs filling each of ``dest_boxes`` (boxes of ``entry``'s global tensor).
    Stored boxes listed in ``in_memory`` are already at hand and get no runs. A run's
    ``dest`` is ``dest`` plus its box's index in ``dest_boxes``.

    The fragments read for a box (one replica per distinct stored box) must tile it
    exactly, or CorruptCheckpointError names the tensor and the box: a catalog read
    in part that lacks rows a box needs fails here, never leaving memory unfilled."""
    size = itemsize(entry.dtype)
    whole = _whole_from_one_fragment(entry, dest_boxes, size, in_memory, dest)
    if whole is not None:
        return whole
    bi, fi, _b_off, _b_len = touched_rows(entry, dest_boxes, prefer_rank)
    # few pairs per box: the rest is cheaper in Python than in numpy calls
    boxes, rows = bi.tolist(), fi.tolist()
    f_offs, f_lens = entry.offsets[fi].tolist(), entry.lengths[fi].tolist()
    regions: list[tuple[list[int], list[int]]] = []
    for index, fo, fl in zip(boxes, f_offs, f_lens, strict=True):
        d_off, d_len = dest_boxes[index]
        lo = [max(a, b) for a, b in zip(d_off, fo, strict=True)]
        regions.append((lo, [min(a + m, b + n) - x for a, m, b, n, x in zip(d_off, d_len, fo, fl, lo, strict=True)]))
    at = 0
    for index, (d_off, d_len) in enumerate(dest_boxes):
        end = at
        while end < len(boxes) and boxes[end] == index:
            end += 1
        need = math.prod(d_len)
        mine = regions[at:end]
        covered = sum(math.prod(r_len) for _o, r_len in mine)
        problem = None
        if (
            covered == need
            and end - at > 1
            and not regions_abut(d_off, d_len, [o for o, _n in mine], [n for _o, n in mine])
        ):
            # one fragment holding it all tiles it; more must neither overlap nor leave holes
            rel = np.array([[o - b for o, b in zip(r_off, d_off, strict=True)] for r_off, _n in mine], np.int64)
            problem = tiling_problem(d_len, rel, np.array([n for _o, n in mine], np.int64))
        if covered != need or problem is not None:
            detail = "" if problem is None else f" ({problem})"
            raise CorruptCheckpointError(
                f"tensor {entry.fqn!r}: the stored fragments cover {covered} of the {need} elements of box "
                f"offsets={list(d_off)} lengths={list(d_len)}{detail}",
                fqn=entry.fqn,
            )
        at = end
    frags: dict[int, Fragment] = {}
    plans: list[RunSet] = []
    for index, row, (ro, rl), fo, fl in zip(boxes, rows, regions, f_offs, f_lens, strict=True):
        if in_memory and (tuple(fo), tuple(fl)) in in_memory:
            continue
        frag = frags.get(row)
        if frag is None:
            frag = frags[row] = entry.fragment(row)
        d_off, d_len = dest_boxes[index]
        src, dst, run = common_runs(ro, rl, fo, fl, d_off, d_len)
        if run:
            plans.append(RunSet(frag, dest + index, src * size, dst * size, run * size))
    return plans
