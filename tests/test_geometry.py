"""bcp.metadata.geometry against brute force: overlap pairs against an O(n^2) check,
tiling against counting every cell of small shapes, stable order against numpy's
stable argsort, common runs against walking every element; 0-d to 3-d boxes, empty
boxes and empty shapes included."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.metadata.geometry import (
    BoxArrays,
    abut_running,
    boxes_disjoint,
    common_runs,
    covers_exactly,
    expand_windows,
    intersect,
    overlapping_pair,
    packed_keys,
    regions_abut,
    row_major_strides,
    simple_tilings,
    stable_order,
    sweep_windows,
    tiling_problem,
)
from helpers import examples

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def boxes_in(draw, shape, max_boxes=8, allow_empty=True):
    """Boxes inside ``shape`` (offsets + lengths <= shape)."""
    out = []
    for _ in range(draw(st.integers(0, max_boxes))):
        off, ln = [], []
        for s in shape:
            o = draw(st.integers(0, s))
            ln.append(draw(st.integers(0 if allow_empty else min(1, s - o), s - o)))
            off.append(o)
        out.append((tuple(off), tuple(ln)))
    return out


@st.composite
def grid_tiling(draw, shape):
    """A tiling of ``shape`` by a grid of cuts per dimension, sometimes with a replica,
    an empty box, a box dropped or a box grown (so both answers come up often)."""
    cuts = []
    for s in shape:
        inner = sorted(draw(st.sets(st.integers(1, max(1, s - 1)), max_size=2))) if s > 1 else []
        cuts.append([0, *[c for c in inner if 0 < c < s], s])
    boxes = []
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        off = tuple(cuts[d][i] for d, i in enumerate(cell))
        boxes.append((off, tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))))
    boxes = draw(st.permutations(boxes))
    change = draw(st.sampled_from(["none", "replica", "empty", "drop", "grow"]))
    if boxes and change == "replica":
        boxes.append(boxes[0])
    elif change == "empty" and shape:
        boxes.append((tuple(0 for _ in shape), tuple(0 for _ in shape)))
    elif boxes and change == "drop":
        boxes.pop()
    elif boxes and change == "grow":
        o, n = boxes[0]
        d = draw(st.integers(0, len(shape) - 1)) if shape else None
        if d is not None and o[d] > 0:
            boxes[0] = (tuple(x - (i == d) for i, x in enumerate(o)), tuple(x + (i == d) for i, x in enumerate(n)))
    return boxes


def arrays(boxes, ndim):
    b = BoxArrays.of(boxes, ndim)
    return b.offsets, b.lengths


def meets(a, b):
    """Whether two boxes share an element (brute force; a 0-d box is one element)."""
    return intersect(*a, *b) is not None and math.prod(intersect(*a, *b)[1]) > 0


def tiles(shape, boxes):
    """The cell-count oracle: distinct non-empty boxes cover every cell exactly once."""
    counts = dict.fromkeys(itertools.product(*[range(s) for s in shape]), 0)
    for o, n in set(boxes):
        for cell in itertools.product(*[range(a, a + x) for a, x in zip(o, n, strict=True)]):
            counts[cell] += 1
    return all(c == 1 for c in counts.values())


@settings(max_examples=examples(400), deadline=None)
@given(data=st.data(), ndim=st.integers(0, 3))
def test_self_overlap_matches_brute_force(data, ndim):
    shape = (6,) * ndim
    boxes = data.draw(boxes_in(shape, max_boxes=10))
    offs, lens = arrays(boxes, ndim)
    any_pair = any(meets(boxes[i], boxes[j]) for i, j in itertools.combinations(range(len(boxes)), 2))
    pair = overlapping_pair(offs, lens)
    assert (pair is not None) == any_pair
    if pair is not None:
        i, j = pair
        assert i != j and meets(boxes[i], boxes[j])
    assert boxes_disjoint(offs, lens) == (not any_pair)


def test_self_overlap_gives_up_past_its_limit():
    offs = np.zeros((50, 2), np.int64)
    lens = np.full((50, 2), 3, np.int64)  # every box meets every other: 1,225 candidate pairs
    assert boxes_disjoint(offs, lens, limit=1000) is None
    assert overlapping_pair(offs, lens, limit=1000) is None
    assert boxes_disjoint(offs, lens, limit=2000) is False
    assert overlapping_pair(offs, lens, limit=2000) is not None


@settings(max_examples=examples(300), deadline=None)
@given(
    ivs=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), max_size=12),
    qs=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), max_size=6),
)
def test_sweep_windows_hold_every_interval_met(ivs, qs):
    starts = np.array(sorted(s for s, _n in ivs), np.int64)
    order = sorted(range(len(ivs)), key=lambda i: ivs[i][0])
    ends = np.array([ivs[i][0] + ivs[i][1] for i in order], np.int64)
    q_s = np.array([s for s, _n in qs], np.int64)
    q_e = np.array([s + n for s, n in qs], np.int64)
    first, width = sweep_windows(starts, ends, q_s, q_e)
    qi, pos = expand_windows(first, width)
    got = set(zip(qi.tolist(), pos.tolist(), strict=True))
    assert len(got) == len(qi), "no pair twice"
    # in order: query by query, positions ascending inside a window
    assert list(zip(qi.tolist(), pos.tolist(), strict=True)) == sorted(got)
    for q, (s, n) in enumerate(qs):
        for p in range(len(ivs)):
            lo, hi = max(s, int(starts[p])), min(s + n, int(ends[p]))
            if hi > lo:
                assert (q, p) in got, "an interval met lies outside the window"
    for q, p in got:
        assert starts[p] < q_e[q], "the window holds only intervals starting before the query ends"


@settings(max_examples=examples(400), deadline=None)
@given(data=st.data(), shape=shapes)
def test_tiling_matches_the_cell_count_oracle(data, shape):
    kind = data.draw(st.sampled_from(["grid", "random"]))
    boxes = data.draw(grid_tiling(shape)) if kind == "grid" else data.draw(boxes_in(shape))
    offs, lens = arrays(boxes, len(shape))
    want = tiles(shape, boxes)
    problem = tiling_problem(shape, offs, lens)
    # a 0-d tensor has one possible box: tiling_problem does not ask for it (covers_exactly does)
    assert (problem is None) == (want or shape == ()), problem
    assert covers_exactly(shape, boxes) == want
    if len(shape) and boxes:
        shown = simple_tilings([shape], offs, lens, [len(boxes)])
        assert not shown[0] or want, "the vectorised check accepted boxes that do not tile"


def test_tiling_of_0d_and_empty_shapes():
    none = np.zeros((0, 0), np.int64)
    assert tiling_problem((), none, none) is None
    assert covers_exactly((), [((), ())])
    assert not covers_exactly((), [])
    assert covers_exactly((0, 3), [])
    assert tiling_problem((0, 3), np.array([[0, 0]]), np.array([[0, 3]])) is None
    assert not covers_exactly((2,), [((1,), (2,))]), "outside the shape"
    assert not covers_exactly((2,), [((0, 0), (2, 1))]), "wrong number of dimensions"
    assert "missing" in tiling_problem((4,), np.array([[0]]), np.array([[3]]))
    assert "overlap" in tiling_problem((4,), np.array([[0], [1]]), np.array([[3], [3]]))


def test_0d_boxes_all_overlap():
    offs = lens = np.zeros((3, 0), np.int64)
    assert overlapping_pair(offs, lens) == (0, 1)
    assert boxes_disjoint(offs, lens) is False
    assert boxes_disjoint(offs[:1], lens[:1]) is True
    assert overlapping_pair(np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64)) is None


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), n_tensors=st.integers(1, 4), ndim=st.integers(1, 3))
def test_simple_tilings_never_accepts_what_does_not_tile(data, n_tensors, ndim):
    shapes_, rows, counts = [], [], []
    for _ in range(n_tensors):
        shape = tuple(data.draw(st.integers(0, 4)) for _ in range(ndim))
        boxes = data.draw(grid_tiling(shape)) if data.draw(st.booleans()) else data.draw(boxes_in(shape, 5))
        shapes_.append(shape)
        rows.extend(boxes)
        counts.append(len(boxes))
    offs, lens = arrays(rows, ndim)
    got = simple_tilings(shapes_, offs, lens, counts)
    at = 0
    for shape, n, ok in zip(shapes_, counts, got.tolist(), strict=True):
        mine = rows[at : at + n]
        at += n
        if ok:
            assert tiles(shape, mine) and mine
        # one cut dimension, rows in order along it, abutting: shown
        cut = {d for o, ln in mine if math.prod(ln) for d in range(ndim) if o[d] != 0 or ln[d] != shape[d]}
        live = [(o, ln) for o, ln in mine if math.prod(ln)]
        if len(cut) == 1 and live and tiles(shape, mine):
            (d,) = cut
            if [o[d] for o, _n in live] == sorted(o[d] for o, _n in live) and len(set(live)) == len(live):
                assert ok, (shape, mine)


@settings(max_examples=examples(300), deadline=None)
@given(cols=st.integers(1, 3), data=st.data())
def test_abut_running_in_blocks(cols, data):
    size = data.draw(st.integers(0, 10))
    rows = data.draw(st.integers(1, 6))

    def matrix(values):
        row = st.lists(values, min_size=cols, max_size=cols)
        return np.array(data.draw(st.lists(row, min_size=rows, max_size=rows)), np.int64)

    offs, lens = matrix(st.integers(0, size)), matrix(st.integers(0, 4))
    split = data.draw(st.integers(1, rows))
    ok = np.ones(cols, bool)
    before = np.zeros(cols, np.int64)
    for a, b in ((0, split), (split, rows)):
        if a < b:
            part, before = abut_running(offs[a:b], lens[a:b], before)
            ok &= part
    for c in range(cols):
        live = [(int(o), int(o + n)) for o, n in zip(offs[:, c], lens[:, c], strict=True) if n > 0]
        chain = all(live[i][1] == live[i + 1][0] for i in range(len(live) - 1))
        from_zero = not live or live[0][0] == 0
        ends_at_size = live[-1][1] == size if live else size == 0
        assert bool(ok[c] and before[c] == size) == (chain and from_zero and ends_at_size)


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple))
def test_regions_abut_only_when_they_tile(data, shape):
    box_off = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    regions = data.draw(grid_tiling(shape)) if data.draw(st.booleans()) else data.draw(boxes_in(shape, 4, False))
    offs = [[o + b for o, b in zip(r[0], box_off, strict=True)] for r in regions]
    lens = [list(r[1]) for r in regions]
    abut = bool(regions) and regions_abut(list(box_off), list(shape), offs, lens)
    if abut:
        live = [r for r in regions if math.prod(r[1])]
        assert tiles(shape, regions) and len(set(live)) == len(live)
    live = [r for r in regions if math.prod(r[1])]
    if len(shape) == 1 and len(live) > 1 and live == regions and len(set(live)) == len(live) and tiles(shape, live):
        assert abut, "intervals that tile a 1-d box abut"


@settings(max_examples=examples(300), deadline=None)
@given(
    keys=st.one_of(
        st.lists(st.integers(0, 5), max_size=40),
        st.lists(st.integers(-(1 << 40), 1 << 40), max_size=40),
        st.lists(st.integers(0, 1 << 20), max_size=40).map(sorted),
        st.lists(st.sampled_from([0, 1, 0xFFFF, 1 << 16, (1 << 16) + 1, (1 << 32) - 1]), max_size=40),
    ),
    long=st.integers(0, 5_000),
    seed=st.integers(0, 3),
)
def test_stable_order_is_numpys_stable_argsort(keys, long, seed):
    a = np.array(keys, np.int64)
    assert stable_order(a).tolist() == np.argsort(a, kind="stable").tolist()
    # long arrays of keys below 2**32, many equal: the two-pass radix order
    rng = np.random.default_rng(seed)
    b = rng.integers(0, [1 << 17, 1 << 32][seed % 2], long + (1 << 12)) // [1, 1 << 12][seed // 2]
    assert np.array_equal(stable_order(b), np.argsort(b, kind="stable"))


@settings(max_examples=examples(300), deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.one_of(st.integers(-(1 << 62), (1 << 62) - 1), st.integers(-9, 9)), st.integers(0, 99)),
        max_size=40,
    ),
    bound=st.integers(100, 1 << 40),
    unsigned=st.booleans(),
)
def test_packed_keys_sort_as_lexsort_or_refuse(pairs, bound, unsigned):
    """Sorting the packed keys gives the (high, low) lexsort order, decoded back to the
    same pairs; keys whose span and low bits need more than 63 bits are refused (None),
    unsigned ones at or past 2**63 too."""
    high = np.array([h for h, _l in pairs], np.int64)
    low = np.array([v for _h, v in pairs], np.int64)
    if unsigned:
        high = high.astype(np.uint64) + np.uint64(1 << 63) if len(high) else high.astype(np.uint64)
    packed = packed_keys(high, low, bound)
    bits = (bound - 1).bit_length()
    span = int(high.max()) - int(high.min()) if len(high) else 0
    if span.bit_length() + bits > 63 or (len(high) and int(high.max()) >= 1 << 63):
        assert packed is None
        return
    assert packed is not None and packed.dtype == np.int64
    order = np.lexsort((low, high))
    got = np.sort(packed)
    lo = int(high.min()) if len(high) else 0
    assert [(int(g >> bits) + lo, int(g & ((1 << bits) - 1))) for g in got] == [
        (int(high[i]), int(low[i])) for i in order
    ]


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple))
def test_common_runs_walk_every_element(data, shape):
    ndim = len(shape)
    src = data.draw(boxes_in(shape, 1, False).filter(len))[0] if ndim else ((), ())
    dst = data.draw(boxes_in(shape, 1, False).filter(len))[0] if ndim else ((), ())
    region = intersect(*src, *dst)
    if region is None:
        return
    s_idx, d_idx, run = common_runs(*region, *src, *dst)
    got = [(int(s) + i, int(d) + i) for s, d in zip(s_idx, d_idx, strict=True) for i in range(run)]
    s_str, d_str = row_major_strides(src[1]), row_major_strides(dst[1])
    want = []
    for cell in itertools.product(*[range(o, o + n) for o, n in zip(*region, strict=True)]):
        s = sum((c - o) * st_ for c, o, st_ in zip(cell, src[0], s_str, strict=True))
        d = sum((c - o) * st_ for c, o, st_ in zip(cell, dst[0], d_str, strict=True))
        want.append((s, d))
    assert got == want


@pytest.mark.parametrize("ndim", [0, 1, 3])
def test_box_arrays(ndim):
    boxes = [(tuple(range(i, i + ndim)), tuple([2] * ndim)) for i in range(3)]
    b = BoxArrays.of(boxes, ndim)
    assert len(b) == 3 and b.ndim == ndim and b.offsets.shape == (3, ndim) and b.offsets.dtype == np.int64
    assert b.groups().tolist() == [0, 0, 0]
    t = BoxArrays(b.offsets, b.lengths, np.array([5, 6, 7])).take(np.array([2, 0]))
    assert t.group.tolist() == [7, 5] and t.offsets.tolist() == [list(boxes[2][0]), list(boxes[0][0])]
    empty = BoxArrays.of([], ndim)
    assert len(empty) == 0 and empty.offsets.shape == (0, ndim)


def test_stable_order_of_floats_is_not_packed():
    """Float keys are not packed as integers (truncation would merge 0.5 and 0.25)."""
    keys = np.array([0.5, 0.25, 1.5, 0.25, -0.75])
    assert packed_keys(keys, np.arange(5), 5) is None
    assert stable_order(keys).tolist() == np.argsort(keys, kind="stable").tolist()
