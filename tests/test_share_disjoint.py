"""share_reads' coordinator leaves out the tensors no two ranks want an element of
(``bcp.io_scheduler.share_disjoint``): what it shows disjoint is disjoint (checked box
against box), the plan is the same array for array as without it (and as the
reference), and the stored rows of those tensors are never gathered."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.io_scheduler.share_disjoint import disjoint_boxes
from bcp.metadata import Catalog
from bcp.metadata.geometry import intersect
from bcp.shared_read import Wanted, plan_shares
from helpers import examples, share_plan_dict
from test_load_plan_fast import SHAPES, cuts
from test_shared_read_plan import reader_of, ref_plan_sharing, sliced


def _box(draw, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    off, lens = [], []
    for s in shape:
        o = draw(st.integers(0, s))
        off.append(o)
        lens.append(draw(st.integers(0, s - o)))
    return tuple(off), tuple(lens)


@st.composite
def rank_boxes(draw, shape: tuple[int, ...], ranks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """One box of ``shape`` per rank: shards along a dimension in rank order (FSDP, TP),
    the same shards in another order, the whole tensor on every rank, or any boxes."""
    kind = draw(st.sampled_from(["shards", "shuffled", "whole", "any"]))
    if kind in ("shards", "shuffled") and shape:
        dim = draw(st.integers(0, len(shape) - 1))
        c = draw(cuts(shape[dim], ranks))
        c = (c + [c[-1]] * ranks)[: ranks + 1]
        boxes = [
            (
                tuple(c[r] if d == dim else 0 for d in range(len(shape))),
                tuple(c[r + 1] - c[r] if d == dim else s for d, s in enumerate(shape)),
            )
            for r in range(ranks)
        ]
        return draw(st.permutations(boxes)) if kind == "shuffled" else boxes
    if kind == "whole":
        return [((0,) * len(shape), tuple(shape))] * ranks
    return [_box(draw, shape) for _ in range(ranks)]


@settings(max_examples=examples(400), deadline=None)
@given(shapes=st.lists(SHAPES, min_size=1, max_size=4), ranks=st.integers(2, 6), data=st.data())
def test_what_is_shown_disjoint_is_disjoint(shapes, ranks, data):
    """Sound: a tensor shown disjoint has no two ranks' boxes sharing an element
    (intersected box by box); shards in rank order along one dimension are shown."""
    per_tensor = [data.draw(rank_boxes(s, ranks), label=f"t{i}") for i, s in enumerate(shapes)]
    nd = np.array([len(s) for s in shapes], np.int64)
    codes = np.arange(len(shapes), dtype=np.int32)
    offsets = [np.array([v for b in per_tensor for v in b[r][0]], np.int64) for r in range(ranks)]
    lengths = [np.array([v for b in per_tensor for v in b[r][1]], np.int64) for r in range(ranks)]
    shown = disjoint_boxes([codes] * ranks, offsets, lengths, nd)
    assert shown is not None and shown.dtype == bool and len(shown) == len(shapes)
    for i, boxes in enumerate(per_tensor):
        meets = [
            (a, b)
            for a in range(ranks)
            for b in range(a + 1, ranks)
            if (x := intersect(*boxes[a], *boxes[b])) is not None and math.prod(x[1]) > 0
        ]
        if shown[i]:
            assert not meets, (i, boxes)
        if not shapes[i]:
            assert not shown[i]  # a 0-d tensor: one element, wanted by every rank
    # the lists must name the same tensors, rank by rank
    if len(shapes) > 1:
        other = [codes] * (ranks - 1) + [codes[::-1].copy()]
        assert disjoint_boxes(other, offsets, lengths, nd) is None


def test_fsdp_row_shards_are_shown_at_any_count_of_ranks():
    """Row shards of 2-D tensors (uneven, empty at the end) at 7 ranks: every tensor."""
    shapes = [(10, 3), (3, 4), (1, 2)]
    ranks = 7
    offsets, lengths = [], []
    for r in range(ranks):
        o, n = [], []
        for rows, cols in shapes:
            size = -(-rows // ranks)
            start = min(r * size, rows)
            o += [start, 0]
            n += [min(size, rows - start), cols]
        offsets.append(np.array(o, np.int64))
        lengths.append(np.array(n, np.int64))
    codes = np.arange(3, dtype=np.int32)
    shown = disjoint_boxes([codes] * ranks, offsets, lengths, np.array([2, 2, 2]))
    assert shown is not None and shown.all()
    lengths[3][0] = -1  # never from a rank's own matching; refused rather than read as an interval
    assert disjoint_boxes([codes] * ranks, offsets, lengths, np.array([2, 2, 2])) is None


@settings(max_examples=examples(300), deadline=None)
@given(shapes=st.lists(SHAPES, min_size=1, max_size=4), ranks=st.integers(2, 6), data=st.data())
def test_the_plan_is_the_same_with_the_disjoint_tensors_left_out(shapes, ranks, data):
    """One rank a class (every rank wants other boxes): the plan with disjoint tensors
    left out equals, array for array, the general plan (which keeps them all), and the
    reference's shared fragments and needing ranks."""
    names = [f"t{i}" for i in range(len(shapes))]
    tensors = {}
    for n, s in zip(names, shapes, strict=True):
        stored = data.draw(sliced(s, data.draw(st.integers(0, len(s) - 1))), label=f"stored {n}") if s else [((), ())]
        tensors[n] = (s, stored, "float32")
    reader = reader_of(tensors, arrow=data.draw(st.booleans(), label="catalog read from Arrow"))
    per_tensor = [data.draw(rank_boxes(s, ranks), label=f"wanted {n}") for n, s in zip(names, shapes, strict=True)]
    wanted = [[(n, per_tensor[i][r]) for i, n in enumerate(names)] for r in range(ranks)]
    encoded = [Wanted.encode(reader, w) for w in wanted]
    fast = plan_shares(reader, encoded)
    general = plan_shares(reader, encoded, cut_index=False)
    for field in ("tensors", "offsets", "lengths", "owners", "needers", "starts", "rank_class"):
        assert np.array_equal(getattr(fast, field), getattr(general, field)), field
    names_all = list(reader.catalog.tensors)
    got = share_plan_dict(fast, names_all, [len(reader.catalog.tensors[f].global_shape) for f in names_all])
    want = ref_plan_sharing(reader, wanted)
    assert sorted(got) == list(want)


def test_the_rows_of_disjoint_tensors_are_never_gathered(monkeypatch):
    """FSDP row shards of three matrices and a 0-d step counter wanted by all 4 ranks:
    only the counter's rows are gathered (failed before: all four tensors'), and the
    counter is the one shared fragment."""
    ranks = 4
    tensors = {
        "w0": ((8, 3), [((2 * r, 0), (2, 3)) for r in range(4)], "float32"),
        "w1": ((5, 2), [((0, 0), (3, 2)), ((3, 0), (2, 2))], "float32"),
        "w2": ((4, 4), [((0, 0), (4, 4))], "float32"),
        "step": ((), [((), ())], "float32"),
    }
    reader = reader_of(tensors, arrow=True)
    asked: list[str] = []
    boxes = Catalog.boxes

    def recording(self, fqns, **kwargs):
        fqns = list(fqns)
        asked.extend(fqns)
        return boxes(self, fqns, **kwargs)

    monkeypatch.setattr(Catalog, "boxes", recording)
    wanted = []
    for r in range(ranks):
        mine = []
        for n in ("w0", "w1", "w2"):
            rows, cols = tensors[n][0]
            size = -(-rows // ranks)
            start = min(r * size, rows)
            mine.append((n, ((start, 0), (min(size, rows - start), cols))))
        wanted.append([*mine, ("step", ((), ()))])
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    assert set(asked) == {"step"}
    names = list(reader.catalog.tensors)
    got = share_plan_dict(plan, names, [len(reader.catalog.tensors[f].global_shape) for f in names])
    assert list(got) == [("step", ((), ()))]
    owner, receivers = got[("step", ((), ()))]
    assert sorted([owner, *receivers]) == list(range(ranks))
    asked.clear()
    general = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted], cut_index=False)
    assert set(asked) == {"step", "w0", "w1", "w2"}  # the reference path keeps every tensor
    assert np.array_equal(general.owners, plan.owners)


def test_one_rank_shares_nothing():
    reader = reader_of({"w": ((4, 2), [((0, 0), (4, 2))], "float32")})
    plan = plan_shares(reader, [Wanted.encode(reader, [("w", ((0, 0), (4, 2)))])])
    assert len(plan.owners) == 0 and np.array_equal(plan.rank_class, [0])
