"""Catalog.entries builds many tensors' entries at once (one gather, one vectorised
tiling check): the same columns as building them one by one, the same FormatError for
a tensor that does not tile, and the vectorised check never accepts what the general
one rejects."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.metadata import Catalog, FormatError, Fragment, itemsize
from bcp.metadata.geometry import simple_tilings, tiling_problem
from bcp.metadata.rows import Rows
from helpers import examples
from test_load_plan_fast import SHAPES, dest_boxes, stored_layout

COLUMNS = ("offsets", "lengths", "byte_offsets", "sizes", "files", "writer_ranks", "_sum_starts", "_sum_values")


def stored_bytes(layouts: dict[str, tuple[tuple[int, ...], list]]) -> bytes:
    """Catalog bytes of the tensors' boxes (rows interleaved by writer, as a save writes
    them); decoding them checks tiling, as a load does."""
    frags, offset = [], 0
    rows = [(w, fqn, box) for fqn, (_s, boxes) in layouts.items() for w, box in enumerate(boxes)]
    for w, fqn, (o, n) in sorted(rows, key=lambda r: r[0]):
        shape = layouts[fqn][0]
        nbytes = math.prod(n) * itemsize("float32")
        sums = (7,) * -(-nbytes // 16)
        frags.append(Fragment(fqn, "[]", "float32", shape, o, n, f"w{w}.bin", offset, nbytes, sums, w))
        offset += nbytes
    return Catalog(frags).to_arrow()


def decoded(data: bytes) -> Catalog:
    return Catalog.from_arrow(data, where="test", checksum_block_bytes=16)


@settings(max_examples=examples(200), deadline=None)
@given(shapes=st.lists(SHAPES, min_size=1, max_size=4), data=st.data())
def test_entries_built_together_equal_entries_built_one_by_one(shapes, data):
    layouts = {}
    for i, shape in enumerate(shapes):
        boxes = data.draw(stored_layout(shape), label=f"t{i}")
        if data.draw(st.integers(0, 4), label=f"t{i} damaged") == 0:
            boxes = data.draw(dest_boxes(shape), label=f"t{i} arbitrary boxes")  # may not tile
        layouts[f"t{i}"] = (shape, boxes)
    blob = stored_bytes(layouts)
    names = list(layouts)
    one_by_one, errors = {}, {}
    for fqn in names:
        try:
            one_by_one[fqn] = decoded(blob).tensors[fqn]
        except FormatError as e:
            errors[fqn] = str(e)
    together = decoded(blob)
    if errors:
        with pytest.raises(FormatError) as caught:
            together.entries(names)
        assert str(caught.value) in errors.values()
        return
    for fqn, entry in zip(names, together.entries(names), strict=True):
        want = one_by_one[fqn]
        assert (entry.fqn, entry.global_shape) == (want.fqn, want.global_shape)
        for column in COLUMNS:
            assert np.array_equal(getattr(entry, column), getattr(want, column)), (fqn, column)
    assert together.entries(names[:1])[0] is together.tensors[names[0]], "entries are cached"


@settings(max_examples=examples(300), deadline=None)
@given(shape=SHAPES.filter(len), data=st.data())
def test_the_vectorised_check_accepts_only_tilings(shape, data):
    boxes = data.draw(st.one_of(stored_layout(shape), dest_boxes(shape)))
    if data.draw(st.booleans()):  # rows in order along one dimension: the fast path's case
        boxes = sorted(boxes)
    off = np.array([o for o, _n in boxes], np.int64).reshape(-1, len(shape))
    length = np.array([n for _o, n in boxes], np.int64).reshape(-1, len(shape))
    fast = simple_tilings([shape], off, length, [len(boxes)])
    if fast[0]:
        assert tiling_problem(shape, off, length) is None


def test_the_usual_layouts_take_the_fast_path():
    """torch.chunk-like splits along one dimension (with empty tail shards) and whole
    replicas are shown to tile without the general check."""
    shapes = [(10, 4), (3, 8), (6, 6)]
    layouts = [
        [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((8, 0), (2, 4)), ((10, 0), (0, 4))],
        [((0, 0), (3, 4)), ((0, 4), (3, 4))],
        [((0, 0), (6, 6)), ((0, 0), (6, 6))],
    ]
    off = np.concatenate([np.array([o for o, _n in b], np.int64) for b in layouts])
    length = np.concatenate([np.array([n for _o, n in b], np.int64) for b in layouts])
    assert simple_tilings(shapes, off, length, [len(b) for b in layouts]).tolist() == [True, True, True]
    gap = [((0, 0), (4, 4)), ((5, 0), (5, 4))]
    off = np.array([o for o, _n in gap], np.int64)
    length = np.array([n for _o, n in gap], np.int64)
    assert simple_tilings([(10, 4)], off, length, [2]).tolist() == [False]


@settings(max_examples=examples(200), deadline=None)
@given(
    ranks=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    blocks=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    data=st.data(),
)
def test_rows_take_reads_each_rows_values(ranks, blocks, data):
    """Rows.take gathers whole rows when every row has the same number of dimensions
    (and one gather of checksums when each row has one): the same values, row for row,
    as the general per-value gather for rows of mixed rank."""
    frags = []
    for i, nd in enumerate(ranks):
        offs = tuple(data.draw(st.integers(0, 9)) for _ in range(nd))
        lens = tuple(data.draw(st.integers(0, 9)) for _ in range(nd))
        sums = tuple(range(i * 10, i * 10 + blocks[i]))
        frags.append(Fragment("t", "[]", "float32", (9,) * nd, offs, lens, "f.bin", i * 100, 4, sums, i))
    rows = Rows.from_fragments(frags, {}, {})
    assert rows.fixed_ndim == (ranks[0] if len(set(ranks)) == 1 else -1)
    for nd in set(ranks):
        pick = [i for i, r in enumerate(ranks) if r == nd]
        pick = data.draw(st.permutations(pick))
        offs, lens, byte_offsets, _sizes, _files, writers, sum_starts, sums = rows.take(np.array(pick, np.int64), nd)
        assert offs.shape == lens.shape == (len(pick), nd)
        for j, i in enumerate(pick):
            f = frags[i]
            assert tuple(offs[j]) == f.offsets and tuple(lens[j]) == f.lengths
            assert byte_offsets[j] == f.byte_offset and writers[j] == f.writer_rank
            assert tuple(sums[sum_starts[j] : sum_starts[j + 1]]) == f.checksums


@settings(max_examples=examples(200), deadline=None)
@given(shapes=st.lists(SHAPES, min_size=1, max_size=4), data=st.data())
def test_boxes_equal_the_entries_boxes_without_building_entries(shapes, data):
    """Catalog.boxes (what the share_reads coordinator gathers): each tensor's offsets,
    lengths, dtype and shape as its entry has them, the same FormatError for a tensor
    that does not tile, and no entry built (or cached) for it; names repeated and in
    any order; a tensor whose entry is cached already gives that entry's columns."""
    layouts = {}
    for i, shape in enumerate(shapes):
        boxes = data.draw(stored_layout(shape), label=f"t{i}")
        if data.draw(st.integers(0, 4), label=f"t{i} damaged") == 0:
            boxes = data.draw(dest_boxes(shape), label=f"t{i} arbitrary boxes")
        layouts[f"t{i}"] = (shape, boxes)
    blob = stored_bytes(layouts)
    names = list(layouts)
    ask = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=6), label="asked")
    cat = decoded(blob)
    if data.draw(st.booleans(), label="one entry cached first"):
        try:
            cat.tensors[ask[0]]
        except FormatError:
            pass
    errors = {}
    for fqn in set(ask):
        try:
            decoded(blob).tensors[fqn]
        except FormatError as e:
            errors[fqn] = str(e)
    if errors:
        with pytest.raises(FormatError) as caught:
            cat.boxes(ask)
        assert str(caught.value) in errors.values()
        return
    calls = []
    entries_of = Catalog.entries
    try:
        Catalog.entries = lambda self, fqns: calls.append(fqns)  # type: ignore[method-assign]
        got = cat.boxes(ask)
    finally:
        Catalog.entries = entries_of  # type: ignore[method-assign]
    assert not calls
    for fqn, boxes in zip(ask, got, strict=True):
        want = decoded(blob).tensors[fqn]
        assert (boxes.fqn, boxes.dtype, boxes.global_shape) == (want.fqn, want.dtype, want.global_shape)
        assert cat.shape(fqn) == want.global_shape
        assert boxes.num_fragments == want.num_fragments
        assert np.array_equal(boxes.offsets, want.offsets) and np.array_equal(boxes.lengths, want.lengths)
        assert not boxes.offsets.flags.writeable


@settings(max_examples=examples(100), deadline=None)
@given(n=st.integers(2, 40), blocks=st.lists(st.integers(1, 5), min_size=40, max_size=40))
def test_entries_built_together_are_frozen_once_not_per_tensor(n, blocks):
    """A load of many tensors builds their entries together: the gathered columns are
    made read-only once (every entry's columns are views of them), not eight numpy
    calls per tensor; each entry's checksum starts, computed for all at once, still
    read each fragment's own checksums, and no column can be written."""
    import bcp.metadata.rows as rows_module

    frags, offset = [], 0
    for i in range(n):
        nbytes = 16 * blocks[i]  # blocks[i] checksum blocks of 16 bytes
        sums = tuple(1000 * i + b for b in range(blocks[i]))
        shape = (nbytes // 4,)
        frags.append(Fragment(f"t{i}", "[]", "float32", shape, (0,), shape, "w0.bin", offset, nbytes, sums))
        offset += nbytes
    catalog = decoded(Catalog(frags).to_arrow())
    calls = []
    real = rows_module._frozen
    rows_module._frozen = lambda a: calls.append(1) or real(a)
    try:
        entries = catalog.entries([f"t{i}" for i in range(n)])
    finally:
        rows_module._frozen = real
    assert calls == [], f"{len(calls)} freezing calls for {n} tensors"
    for i, entry in enumerate(entries):
        assert entry.checksums(0) == frags[i].checksums
        assert entry.fragment(0) == frags[i]
        for name in COLUMNS:
            column = getattr(entry, name)
            assert not column.flags.writeable, name
            with pytest.raises(ValueError, match="read-only"):
                column[...] = 0


def test_boxes_of_every_tensor_gather_through_the_rows_order_not_a_copy_of_it(monkeypatch):
    """At 8 M stored rows (the share_reads coordinator asks for every tensor) the row
    ids of the tensors asked in catalog order are one view of the catalog's row order,
    not a joined copy; the boxes are those of each tensor's entry."""
    layouts = {f"t{i}": ((8, 4), [((2 * r, 0), (2, 4)) for r in range(4)]) for i in range(5)}
    blob = stored_bytes(layouts)
    cat = decoded(blob)
    seen = []
    take = Rows.take_boxes
    monkeypatch.setattr(Rows, "take_boxes", lambda self, rows, ndim: (seen.append(rows), take(self, rows, ndim))[1])
    got = cat.boxes(list(layouts))
    assert len(seen) == 1 and len(seen[0]) == 20
    assert seen[0].base is not None, "the row ids were copied"
    for fqn, boxes in zip(layouts, got, strict=True):
        want = decoded(blob).tensors[fqn]
        assert np.array_equal(boxes.offsets, want.offsets) and np.array_equal(boxes.lengths, want.lengths)


def test_the_fixed_rank_check_takes_bounded_memory():
    """Rows.fixed_ndim over millions of rows compares their coordinate starts in bounded
    passes (no row-long temporaries), and still finds one row of another rank."""
    import tracemalloc

    n = 4 << 20
    starts = np.arange(0, 2 * n + 1, 2, dtype=np.int64)
    empty = np.zeros(0, np.int64)

    def rows(cs: np.ndarray) -> Rows:
        z = np.zeros(n, np.int32)
        return Rows(z, cs, empty, empty, empty, empty, z, z, empty, empty.astype(np.uint32))

    every = rows(starts)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert every.fixed_ndim == 2
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < starts.nbytes // 2, f"{peak / 1e6:.1f} MB of temporaries"
    odd = starts.copy()
    odd[n - 3 :] += 1  # one row of 3 values near the end, the last of 1
    assert rows(odd).fixed_ndim == -1
