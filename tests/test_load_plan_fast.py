"""The indexed load planner (read_plan over the catalog's columns) against the
per-fragment planner it replaced, kept here as the reference, on random layouts:
uneven and empty shards, replicas, flat ranges, dim-1 and 2-D grids, 0-d and 1-d
tensors. Same RunSets, same errors; plus the overlap search against brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler.read_plan import RunSet, overlap_pairs, overlap_volumes, plan_tensor_reads, touched_rows
from bcp.metadata import Catalog, Fragment, TensorEntry, itemsize
from bcp.metadata.geometry import Box, BoxArrays, common_runs, flat_range_to_boxes, intersect
from helpers import examples

# -- the reference: the planner before the columnar catalog ------------------------------


def ref_choose_replicas(entry: TensorEntry, prefer_rank: int = 0) -> list[Fragment]:
    by_box: dict[Box, list[Fragment]] = {}
    for f in entry.fragments:
        by_box.setdefault((f.offsets, f.lengths), []).append(f)
    return [frags[prefer_rank % len(frags)] for frags in by_box.values()]


def ref_plan_tensor_reads(
    entry: TensorEntry, dest_boxes: list[Box], *, prefer_rank: int = 0, in_memory: frozenset[Box] = frozenset()
) -> list[RunSet]:
    size = itemsize(entry.dtype)
    fragments = ref_choose_replicas(entry, prefer_rank)
    plans: list[RunSet] = []
    for index, (d_off, d_len) in enumerate(dest_boxes):
        need = math.prod(d_len)
        covered = 0
        for frag in fragments:
            region = intersect(d_off, d_len, frag.offsets, frag.lengths)
            if region is None:
                continue
            r_off, r_len = region
            covered += math.prod(r_len)
            if (frag.offsets, frag.lengths) in in_memory:
                continue
            src, dst, run = common_runs(r_off, r_len, frag.offsets, frag.lengths, d_off, d_len)
            if run:
                plans.append(RunSet(frag, index, src * size, dst * size, run * size))
        if covered != need:
            raise CorruptCheckpointError(f"tensor {entry.fqn!r}: covers {covered} of {need}", fqn=entry.fqn)
    return plans


# -- random layouts -------------------------------------------------------------------------


@st.composite
def cuts(draw, n: int, parts: int) -> list[int]:
    inner = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    return [0, *inner, n]


@st.composite
def grid(draw, shape: tuple[int, ...], max_dims: int = 2) -> list[Box]:
    """Boxes cutting ``shape`` along 1-2 random dimensions (uneven, possibly empty)."""
    if not shape:
        return [((), ())]
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=max_dims, unique=True))
    splits = {d: draw(cuts(shape[d], draw(st.integers(1, 4)))) for d in dims}
    cells: list[Box] = [((), ())]
    for d in range(len(shape)):
        c = splits.get(d, [0, shape[d]])
        cells = [((*o, c[i]), (*n, c[i + 1] - c[i])) for o, n in cells for i in range(len(c) - 1)]
    return cells


@st.composite
def stored_layout(draw, shape: tuple[int, ...]) -> list[Box]:
    """Stored boxes that tile ``shape``: a grid or flat ranges, plus replicas."""
    if shape and draw(st.booleans()):
        c = draw(cuts(math.prod(shape), draw(st.integers(1, 4))))
        boxes = [b for i in range(len(c) - 1) for b, _pos in flat_range_to_boxes(shape, c[i], c[i + 1] - c[i])]
        boxes = boxes or [((0,) * len(shape), tuple(shape))]
    else:
        boxes = draw(grid(shape))
    replicas = draw(st.lists(st.sampled_from(boxes), max_size=3))
    order = draw(st.permutations(boxes + replicas))
    return list(order)


@st.composite
def dest_boxes(draw, shape: tuple[int, ...]) -> list[Box]:
    if draw(st.booleans()):
        return draw(grid(shape))
    out = []
    for _ in range(draw(st.integers(1, 3))):
        off, lens = [], []
        for s in shape:
            a = draw(st.integers(0, s))
            off.append(a)
            lens.append(draw(st.integers(0, s - a)))
        out.append((tuple(off), tuple(lens)))
    return out


SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 5, 7]), min_size=0, max_size=3).map(tuple)


def catalog_of(shape: tuple[int, ...], boxes: list[Box], dtype: str = "float32") -> Catalog:
    size = itemsize(dtype)
    frags, offset = [], 0
    for w, (o, n) in enumerate(boxes):
        nbytes = math.prod(n) * size
        frags.append(
            Fragment("t", "[]", dtype, shape, o, n, f"f{w % 3}.bin", offset, nbytes, (0,) * -(-nbytes // 16), w)
        )
        offset += nbytes + 8
    return Catalog(frags)


def same_plans(a: list[RunSet], b: list[RunSet]) -> None:
    assert len(a) == len(b), f"{len(a)} run sets vs {len(b)} (reference)"
    for x, y in zip(a, b, strict=True):
        assert x.fragment == y.fragment and x.dest == y.dest and x.run_bytes == y.run_bytes
        assert np.array_equal(x.src, y.src) and np.array_equal(x.dst, y.dst)


@settings(max_examples=examples(400), deadline=None)
@given(shape=SHAPES, prefer=st.integers(0, 5), data=st.data())
def test_indexed_planner_matches_the_reference(shape, prefer, data):
    stored = data.draw(stored_layout(shape), label="stored")
    entry = catalog_of(shape, stored).tensors["t"]
    wanted = data.draw(dest_boxes(shape), label="wanted")
    held = data.draw(st.sets(st.sampled_from(stored)), label="in memory") if stored else set()
    got = plan_tensor_reads(entry, wanted, prefer_rank=prefer, in_memory=frozenset(held))
    same_plans(got, ref_plan_tensor_reads(entry, wanted, prefer_rank=prefer, in_memory=frozenset(held)))
    # the runs fill every destination byte exactly once
    size = itemsize(entry.dtype)
    for index, (_o, n) in enumerate(wanted):
        hit = np.zeros(math.prod(n) * size, np.int64)
        for p in got:
            if p.dest == index:
                for d in p.dst.tolist():
                    hit[d : d + p.run_bytes] += 1
        covered_elsewhere = any(
            intersect(wanted[index][0], n, o, ln) is not None for o, ln in held if math.prod(ln) and math.prod(n)
        )
        assert covered_elsewhere or (hit == 1).all(), f"box {index} not filled exactly once"


@settings(max_examples=examples(200), deadline=None)
@given(shape=SHAPES.filter(lambda s: math.prod(s) > 0), data=st.data())
def test_a_missing_fragment_fails_naming_the_tensor_and_box(shape, data):
    stored = list(dict.fromkeys(data.draw(grid(shape), label="stored")))
    stored = [b for b in stored if math.prod(b[1])]
    assume(len(stored) > 1)
    missing = data.draw(st.sampled_from(stored))
    entry = catalog_of(shape, [b for b in stored if b != missing]).tensors["t"]
    whole = ((0,) * len(shape), tuple(shape))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 't'.*box offsets=") as err:
        plan_tensor_reads(entry, [whole])
    assert err.value.fqn == "t"
    with pytest.raises(CorruptCheckpointError):
        ref_plan_tensor_reads(entry, [whole])
    plan_tensor_reads(entry, [b for b in stored if intersect(*b, *missing) is None])  # the rest still plans


def test_overlap_and_hole_of_the_same_size_is_refused():
    """Element counts match (the reference accepted this) but two fragments overlap and
    leave a hole: the indexed planner checks that the fragments tile the box."""
    entry = catalog_of((4,), [((0,), (2,)), ((1,), (2,))]).tensors["t"]
    with pytest.raises(CorruptCheckpointError):  # 2 + 2 elements for a box of 3: both refuse
        plan_tensor_reads(entry, [((0,), (3,))])
    entry = catalog_of((2, 2), [((0, 0), (1, 2)), ((0, 1), (2, 1))]).tensors["t"]
    box = ((0, 0), (2, 2))  # 2 + 2 = 4 == 4, yet element (0, 1) twice and (1, 0) never
    ref_plan_tensor_reads(entry, [box])  # the reference does not notice
    with pytest.raises(CorruptCheckpointError, match=r"do not tile|overlap"):
        plan_tensor_reads(entry, [box])


@settings(max_examples=examples(300), deadline=None)
@given(
    ndim=st.integers(0, 3),
    groups=st.integers(1, 3),
    data=st.data(),
)
def test_overlap_pairs_match_brute_force(ndim, groups, data):
    def boxes(n):
        rows = []
        for _ in range(n):
            o = [data.draw(st.integers(0, 6)) for _ in range(ndim)]
            ln = [data.draw(st.integers(0, 4)) for _ in range(ndim)]
            rows.append((o, ln, data.draw(st.integers(0, groups - 1))))
        return rows

    frs, bxs = boxes(data.draw(st.integers(0, 12))), boxes(data.draw(st.integers(0, 6)))

    def arrays(rows):
        off = np.array([r[0] for r in rows], np.int64).reshape(len(rows), ndim)
        ln = np.array([r[1] for r in rows], np.int64).reshape(len(rows), ndim)
        return off, ln, np.array([r[2] for r in rows], np.int64)

    whole = data.draw(st.sets(st.integers(0, ndim - 1))) if ndim else set()
    for rows in (frs, bxs):  # dimensions every box spans whole (length 5), as FSDP's dim 1
        for o, n, _g in rows:
            for d in whole:
                o[d], n[d] = 0, 5
    fo, fl, fg = arrays(frs)
    bo, bl, bg = arrays(bxs)
    bi, fi = overlap_pairs(BoxArrays(fo, fl, fg), BoxArrays(bo, bl, bg))
    want = [
        (i, j)
        for i, (o, n, g) in enumerate(bxs)
        for j, (fo_, fn_, h) in enumerate(frs)
        if g == h and math.prod(n) and math.prod(fn_) and intersect(o, n, fo_, fn_) is not None
    ]
    assert list(zip(bi.tolist(), fi.tolist(), strict=True)) == want
    # the same pairs with the elements each shares, with and without the tensors' extents
    shared = sorted((i, j, math.prod(intersect(*bxs[i][:2], *frs[j][:2])[1])) for i, j in want)
    extents = np.full((groups, ndim), 10, np.int64)
    extents[:, sorted(whole)] = 5
    for ext in (None, extents):
        vb, vf, vol = overlap_volumes(BoxArrays(fo, fl, fg), BoxArrays(bo, bl, bg), extents=ext)
        assert sorted(zip(vb.tolist(), vf.tolist(), vol.tolist(), strict=True)) == shared


def test_planning_touches_only_the_fragments_a_box_meets():
    """4,096 fragments on dim 1 (column shards), one wanted box: the candidates found
    are the fragments it meets, not all of them."""
    shape = (64, 4096)
    stored = [((0, c), (64, 1)) for c in range(4096)]
    entry = catalog_of(shape, stored).tensors["t"]
    bi, rows, _o, _n = touched_rows(entry, [((0, 100), (64, 3))])
    assert rows.tolist() == [100, 101, 102] and bi.tolist() == [0, 0, 0]
    plans = plan_tensor_reads(entry, [((0, 100), (64, 3))])
    assert [p.fragment.offsets for p in plans] == [(0, 100), (0, 101), (0, 102)]
