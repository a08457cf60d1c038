"""share_reads planned once by the coordinator (vectorised) against the plan every rank
used to compute over every rank's wanted list, kept here as the reference, on random
layouts (uneven, empty, replicated, flat, dim-1 and 2-D stored boxes; 0-d and 1-d
tensors): the same shared fragments (numbered in catalog order) with the same needing ranks,
each owned by one of them, and the owners' bytes about as balanced as the reference's
sequential least-loaded greedy (the coordinator balances by needer set instead)."""

from __future__ import annotations

import math
import types
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bcp.metadata import Catalog, Fragment, itemsize
from bcp.metadata.geometry import Box, intersect
from bcp.shared_read import Wanted, plan_shares
from helpers import examples, plan_sharing, share_plan_dict
from test_load_plan_fast import SHAPES, cuts, dest_boxes, grid, ref_choose_replicas, stored_layout

SharedKey = tuple[str, Box]


def ref_plan_sharing(reader, wanted_by_rank: list[list[tuple[str, Box]]]) -> dict[SharedKey, tuple[int, list[int]]]:
    needers: dict[SharedKey, list[int]] = {}
    wanted_elems: dict[SharedKey, int] = {}
    for rank, wanted in enumerate(wanted_by_rank):
        for fqn, (b_off, b_len) in wanted:
            for frag in ref_choose_replicas(reader.catalog.tensors[fqn]):
                key = (fqn, (frag.offsets, frag.lengths))
                region = intersect(b_off, b_len, frag.offsets, frag.lengths)
                if region is not None and math.prod(frag.lengths) != 0:
                    wanted_elems[key] = wanted_elems.get(key, 0) + math.prod(region[1])
                    ranks = needers.setdefault(key, [])
                    if not ranks or ranks[-1] != rank:
                        ranks.append(rank)
    redundant = [k for k, ranks in needers.items() if len(ranks) > 1 and wanted_elems[k] > math.prod(k[1][1])]
    load = [0] * len(wanted_by_rank)
    plan: dict[SharedKey, tuple[int, list[int]]] = {}
    for key in sorted(redundant):
        ranks = needers[key]
        owner = min(ranks, key=lambda r: (load[r], r))
        entry = reader.catalog.tensors[key[0]]
        load[owner] += math.prod(key[1][1]) * itemsize(entry.dtype)
        plan[key] = (owner, [r for r in ranks if r != owner])
    return plan


def reader_of(tensors: dict[str, tuple[tuple[int, ...], list[Box], str]], *, arrow: bool = False):
    """A reader over a catalog of ``tensors`` (shape, stored boxes, dtype): built from
    Fragments, or (``arrow``) read back from its Arrow bytes, whose rows the plan
    gathers as views of one array per number of dimensions."""
    frags, offset = [], 0
    for fqn, (shape, boxes, dtype) in tensors.items():
        for w, (o, n) in enumerate(boxes):
            nbytes = math.prod(n) * itemsize(dtype)
            sums = (0,) * -(-nbytes // 16)
            frags.append(Fragment(fqn, "[]", dtype, shape, o, n, f"f{w % 3}.bin", offset, nbytes, sums, w))
            offset += nbytes
    if arrow:
        return types.SimpleNamespace(
            catalog=Catalog.from_arrow(Catalog(frags).to_arrow(), where="test", checksum_block_bytes=16)
        )
    return types.SimpleNamespace(catalog=Catalog(frags))


@settings(max_examples=examples(300), deadline=None)
@given(
    shapes=st.lists(SHAPES, min_size=1, max_size=3),
    ranks=st.integers(1, 5),
    data=st.data(),
)
def test_coordinator_plan_matches_every_rank_plan(shapes, ranks, data):
    names = [f"t{i}" for i in range(len(shapes))]
    dtypes = data.draw(st.lists(st.sampled_from(["float32", "int8", "bfloat16"]), min_size=3, max_size=3))
    tensors = {
        n: (s, data.draw(stored_layout(s), label=f"stored {n}"), dtypes[i])
        for i, (n, s) in enumerate(zip(names, shapes, strict=True))
    }
    reader = reader_of(tensors, arrow=data.draw(st.booleans(), label="catalog read from Arrow"))
    wanted = []
    for r in range(ranks):
        if r and data.draw(st.booleans(), label=f"rank {r} copies a rank before it"):
            # data-parallel replicas: identical lists, planned as one class of ranks
            wanted.append(list(wanted[data.draw(st.integers(0, r - 1))]))
            continue
        mine = []
        for n, s in zip(names, shapes, strict=True):
            kind = data.draw(st.sampled_from(["none", "whole", "boxes", "grid"]), label=f"rank {r} {n}")
            if kind == "whole":
                mine.append((n, ((0,) * len(s), s)))
            elif kind == "boxes":
                mine += [(n, b) for b in data.draw(dest_boxes(s))]
            elif kind == "grid":
                cells = data.draw(grid(s))
                mine.append((n, cells[data.draw(st.integers(0, len(cells) - 1))]))
        wanted.append(mine)
    got = plan_sharing(reader, wanted)
    want = ref_plan_sharing(reader, wanted)
    assert sorted(got) == list(want)
    catalog_order: dict[SharedKey, int] = {}  # a box's first row (replicas share a key)
    for i, f in enumerate(reader.catalog.fragments):
        catalog_order.setdefault((f.fqn, (f.offsets, f.lengths)), i)
    assert list(got) == sorted(got, key=lambda k: catalog_order[k]), "tags follow the catalog's order"
    load_got, load_want = [0] * ranks, [0] * ranks
    biggest = 0
    for key, (owner, receivers) in got.items():
        want_owner, want_receivers = want[key]
        assert sorted([owner, *receivers]) == sorted([want_owner, *want_receivers])
        assert owner not in receivers and receivers == sorted(receivers)
        nbytes = math.prod(key[1][1]) * itemsize(reader.catalog.tensors[key[0]].dtype)
        load_got[owner] += nbytes
        load_want[want_owner] += nbytes
        biggest = max(biggest, nbytes)
    if got:
        assert max(load_got) <= max(load_want) + biggest, (load_got, load_want)
    # every rank's part: what it needs, from the right owner; owners send to the rest
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    keys = list(got)
    for r, part in enumerate(plan.parts(ranks)):
        mine = [k for k, (o, rs) in got.items() if r == o or r in rs]
        assert [keys[t] for t in part.tags.tolist()] == mine
        for i, tag in enumerate(part.tags.tolist()):
            owner, receivers = got[keys[tag]]
            assert part.owners[i] == owner
            assert part.receivers_of(i).tolist() == (receivers if owner == r else [])


def test_each_rank_gets_only_its_part():
    shape = (12, 4)
    stored = [((r * 3, 0), (3, 4)) for r in range(4)]
    reader = reader_of({"w": (shape, stored, "float32")})
    # ranks 0-2 want everything (DDP-like), rank 3 only rows 0..2, rank 4 nothing
    wanted = [[("w", ((0, 0), shape))]] * 3 + [[("w", ((0, 0), (3, 4)))], []]
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    parts = plan.parts(5)
    shared = share_plan_dict(plan, ["w"], [2])
    assert len(shared) == 4 and all(len(rs) + 1 in (3, 4) for _o, rs in shared.values())
    owners = {owner for owner, _rs in shared.values()}
    assert owners <= {0, 1, 2, 3} and len(owners) >= 3, f"reads not spread: {shared}"
    assert len(parts[4].tags) == 0, "a rank that wants nothing gets an empty part"
    assert len(parts[3].tags) == 1 and parts[3].offsets[0].tolist() == [0, 0]
    for r, part in enumerate(parts):
        for tag in part.tags.tolist():
            key = list(shared)[tag]
            owner, receivers = shared[key]
            assert r == owner or r in receivers
            i = part.tags.tolist().index(tag)
            assert sorted(part.receivers_of(i).tolist()) == (sorted(receivers) if r == owner else [])
    total = sum(len(p.tags) for p in parts)
    assert total == sum(1 + len(rs) for _o, rs in shared.values())
    assert np.array_equal(
        np.sort(np.concatenate([p.tags for p in parts])),
        np.sort(np.repeat(np.arange(4), [1 + len(rs) for _o, rs in shared.values()])),
    )


@st.composite
def sliced(draw, shape: tuple[int, ...], dim: int) -> list[Box]:
    """``shape`` cut along ``dim`` only (uneven, possibly empty slices): FSDP on dim 0, TP on dim 1."""
    c = draw(cuts(shape[dim], draw(st.integers(1, 5))))
    return [
        (
            tuple(c[i] if d == dim else 0 for d in range(len(shape))),
            tuple(c[i + 1] - c[i] if d == dim else s for d, s in enumerate(shape)),
        )
        for i in range(len(c) - 1)
    ]


@settings(max_examples=examples(300), deadline=None)
@given(shapes=st.lists(SHAPES, min_size=1, max_size=4), ranks=st.integers(1, 6), data=st.data())
def test_cut_index_plan_equals_general_plan(shapes, ranks, data):
    """Boxes matched on the cut dimension (slices of one dimension, same or another
    layout, data-parallel classes, boxes cut another way) give the same plan, array
    for array, as every box through the general overlap test, and the reference's
    shared fragments and needing ranks (every wanted byte of a shared fragment comes
    from it, once per rank)."""
    names = [f"t{i}" for i in range(len(shapes))]
    tensors = {}
    for n, s in zip(names, shapes, strict=True):
        if s and data.draw(st.booleans(), label=f"{n} sliced"):
            stored = data.draw(sliced(s, data.draw(st.integers(0, len(s) - 1))), label=f"stored {n}")
            stored = data.draw(st.permutations(stored)) if data.draw(st.booleans()) else stored
        else:
            stored = data.draw(stored_layout(s), label=f"stored {n}")
        tensors[n] = (s, stored, data.draw(st.sampled_from(["float32", "bfloat16"])))
    reader = reader_of(tensors, arrow=data.draw(st.booleans(), label="catalog read from Arrow"))
    groups = data.draw(st.integers(1, ranks), label="data-parallel groups")
    per_group = []
    for g in range(groups):
        mine = []
        for n, s in zip(names, shapes, strict=True):
            kind = data.draw(st.sampled_from(["stored", "slice", "boxes", "none"]), label=f"group {g} {n}")
            if kind == "stored":  # the same layout: exactly a stored box
                mine.append((n, tensors[n][1][g % len(tensors[n][1])]))
            elif kind == "slice" and s:
                cells = data.draw(sliced(s, data.draw(st.integers(0, len(s) - 1))))
                mine.append((n, cells[g % len(cells)]))
            elif kind == "boxes":
                mine += [(n, b) for b in data.draw(dest_boxes(s))]
        per_group.append(mine)
    wanted = [per_group[data.draw(st.integers(0, groups - 1))] for _r in range(ranks)]
    encoded = [Wanted.encode(reader, w) for w in wanted]
    fast = plan_shares(reader, encoded)
    general = plan_shares(reader, encoded, cut_index=False)
    for field in ("tensors", "offsets", "lengths", "owners", "needers", "starts", "rank_class"):
        a, b = getattr(fast, field), getattr(general, field)
        assert np.array_equal(a, b), field
    names_all = list(reader.catalog.tensors)
    got = share_plan_dict(fast, names_all, [len(reader.catalog.tensors[f].global_shape) for f in names_all])
    want = ref_plan_sharing(reader, wanted)
    assert sorted(got) == list(want)
    for key, (owner, receivers) in got.items():
        assert sorted([owner, *receivers]) == sorted([want[key][0], *want[key][1]])


def test_the_coordinator_plans_from_stored_boxes_not_entries(monkeypatch):
    """At thousands of ranks the catalog holds millions of rows: the plan gathers their
    offsets and lengths (Catalog.boxes, tiling checked) and builds no TensorEntry
    (whose byte offsets, files and checksums it never reads); a tensor that does not
    tile is still refused with the catalog's FormatError."""
    from bcp.metadata import FormatError

    def blob(stored):  # a row of 4 float32 is one 16-byte checksum block
        frags = [
            Fragment("w", "[]", "float32", (12, 4), o, n, f"f{i}.bin", 0, math.prod(n) * 4, (0,) * n[0], i)
            for i, (o, n) in enumerate(stored)
        ]
        return Catalog(frags).to_arrow()

    stored = [((r * 3, 0), (3, 4)) for r in range(4)]
    wanted = [[("w", ((0, 0), (12, 4)))]] * 3

    def no_entries(self, fqns):
        raise AssertionError("the share plan built entries")

    monkeypatch.setattr(Catalog, "entries", no_entries)
    monkeypatch.setattr(Catalog, "_entry", no_entries)
    cat = Catalog.from_arrow(blob(stored), where="test", checksum_block_bytes=16)
    reader = types.SimpleNamespace(catalog=cat)
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    assert len(plan.owners) == 4 and np.array_equal(np.diff(plan.starts), [3, 3, 3, 3])
    overlapping = [((0, 0), (6, 4)), ((3, 0), (6, 4)), ((9, 0), (3, 4)), ((0, 0), (0, 4))]
    bad = types.SimpleNamespace(catalog=Catalog.from_arrow(blob(overlapping), where="test", checksum_block_bytes=16))
    with pytest.raises(FormatError, match="'w'"):
        plan_shares(bad, [Wanted.encode(bad, w) for w in wanted])


def _arrow_catalog(shape, stored):
    """A catalog of one float32 tensor ``w`` read back from its Arrow bytes (the
    rows-table path the coordinator gathers from), None where the catalog refuses the
    rows on reading (a box outside the tensor)."""
    from bcp.metadata import FormatError

    block = 4 * math.prod(shape[1:]) if len(shape) > 1 else 4
    frags = []
    for i, (o, n) in enumerate(stored):
        nbytes = math.prod(n) * 4
        frags.append(Fragment("w", "[]", "float32", shape, o, n, f"f{i}.bin", 0, nbytes, (0,) * -(-nbytes // block), i))
    try:
        return Catalog.from_arrow(Catalog(frags).to_arrow(), where="test", checksum_block_bytes=block)
    except FormatError:
        return None


@settings(max_examples=examples(200), deadline=None)
@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 4)), data=st.data())
def test_the_cut_index_refuses_exactly_the_layouts_the_catalog_refuses(shape, data):
    """The coordinator takes the catalog's tiling check from its cut index (the rows of
    slice-cut tensors sorted on their cut dimension, shown to abut from 0 to the end)
    and asks the catalog only about the others: on slice layouts broken at random (a
    row moved, resized, dropped, doubled or cut on the other dimension too, rows in any
    order) the plan is refused with the catalog's FormatError exactly when the
    catalog's own check (``Catalog.entries``) refuses the layout."""
    from bcp.metadata import FormatError

    dim = data.draw(st.integers(0, 1), label="cut dimension")
    stored = [list(map(list, b)) for b in data.draw(sliced(shape, dim), label="stored")]
    for _ in range(data.draw(st.integers(0, 2), label="breaks")):
        i = data.draw(st.integers(0, len(stored) - 1))
        how = data.draw(st.sampled_from(["move", "resize", "drop", "double", "other"]))
        if how == "drop" and len(stored) > 1:
            stored.pop(i)
        elif how == "double":
            stored.insert(i, [list(stored[i][0]), list(stored[i][1])])
        elif how == "move":
            stored[i][0][dim] += data.draw(st.sampled_from([-1, 1]))
        elif how == "resize":
            stored[i][1][dim] = max(0, stored[i][1][dim] + data.draw(st.sampled_from([-1, 1])))
        else:
            other = 1 - dim
            stored[i][1][other] = max(0, stored[i][1][other] - 1)
    stored = [(tuple(o), tuple(n)) for o, n in data.draw(st.permutations(stored), label="row order")]
    cat = _arrow_catalog(shape, stored)
    assume(cat is not None)
    try:
        _arrow_catalog(shape, stored).entries(["w"])  # a fresh catalog: nothing cached
        refused = False
    except FormatError:
        refused = True
    reader = types.SimpleNamespace(catalog=cat)
    wanted = [[("w", ((0, 0), shape))]] * 2
    for cut_index in (True, False):
        if refused:
            with pytest.raises(FormatError, match="'w'"):
                plan_shares(reader, [Wanted.encode(reader, w) for w in wanted], cut_index=cut_index)
        else:
            plan_shares(reader, [Wanted.encode(reader, w) for w in wanted], cut_index=cut_index)


def test_tensors_the_cut_index_proves_are_not_checked_again(monkeypatch):
    """The catalog's vectorised tiling check is not run a second time over the rows the
    cut index has already sorted and shown to tile (at 4,096 ranks x 2,000 tensors it
    was a third of the plan's CPU time); a tensor stored as replicas still is."""
    import bcp.metadata.entries as entries_module

    checked: list[int] = []
    real = entries_module.simple_tilings

    def counting(shapes, off, length, counts):
        checked.append(len(shapes))
        return real(shapes, off, length, counts)

    monkeypatch.setattr(entries_module, "simple_tilings", counting)
    sliced_rows = [((r * 3, 0), (3, 4)) for r in range(4)]
    cat = _arrow_catalog((12, 4), sliced_rows)
    reader = types.SimpleNamespace(catalog=cat)
    wanted = [[("w", ((0, 0), (12, 4)))]] * 3
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    assert len(plan.owners) == 4 and checked == []
    replicas = _arrow_catalog((12, 4), [((0, 0), (12, 4))] * 2)
    reader = types.SimpleNamespace(catalog=replicas)
    plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    assert checked == [1], "a layout the index cannot prove goes to the catalog's check"


@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=6), width=st.integers(1, 3), data=st.data())
def test_joined_is_a_view_of_consecutive_slices_else_a_copy(counts, width, data):
    """The cut index reads every tensor's boxes as one array: a view where they are
    consecutive slices of one gather (as Catalog.boxes returns them), else a copy;
    equal to np.concatenate either way."""
    from bcp.io_scheduler.share_match import joined

    base = np.arange(sum(counts) * width, dtype=np.int64).reshape(-1, width).copy()  # owns its data, as a gather
    bounds = np.r_[0, np.cumsum(counts)].tolist()
    parts = [base[bounds[i] : bounds[i + 1]] for i in range(len(counts))]
    lo = data.draw(st.integers(0, len(parts) - 1))
    parts = parts[lo:]
    broken = data.draw(st.sampled_from(["none", "copy", "swap"]))
    if broken == "copy":
        i = data.draw(st.integers(0, len(parts) - 1))
        parts[i] = parts[i].copy()
        if not len(parts[i]):
            broken = "none"  # an empty part adds nothing: the rest is still one view
    elif broken == "swap" and len(parts) > 1:
        parts[0], parts[1] = parts[1], parts[0]
    out = joined(parts)
    assert np.array_equal(out, np.concatenate(parts))
    if broken == "none" and out.size:
        assert np.shares_memory(out, base), "consecutive slices: a view"
    if broken == "copy" and out.size:
        assert not np.shares_memory(out, base)


@given(
    points=st.lists(st.integers(0, 40), max_size=30),
    extra=st.integers(-2, 10),
    ordered=st.booleans(),
    distinct=st.booleans(),
)
def test_upto_tables_count_points_at_or_before(points, extra, ordered, distinct):
    """The cut index's lookup tables, a flag per point summed in place (its interval
    ends and starts are distinct), equal the prefix counts of the points (repeated
    points, or points off the line, rows outside their tensor, take the counting way)."""
    from bcp.io_scheduler.share_match import _upto

    points = list(dict.fromkeys(points)) if distinct else points
    line = max(max(points, default=0) + extra, 0)
    p = np.array(sorted(points) if ordered else points, np.int64)
    got = _upto(p, line, np.int32)
    assert got.dtype == np.int32
    assert got.tolist()[:line] == [sum(v <= x for v in points) for x in range(line)]
    assert len(got) == max(line, max(points, default=-1) + 1)


@given(
    pairs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3)), unique=True, max_size=25),
    sizes=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    one_size=st.booleans(),
)
def test_rows_met_by_several_ranks(pairs, sizes, one_size):
    """The rows more than one rank needs, from (row, class) pairs each once: with classes
    of one rank each, a row met by two classes is found (none met twice: none, without a
    count per row), and with no classes given where every class has one size."""
    from bcp.shared_read import _met_by_several

    sizes_a = np.array([sizes[0]] * 4 if one_size else sizes, np.int64)
    frags = np.array([f for f, _c in pairs], np.int64)
    classes = np.array([c for _f, c in pairs], np.int64)
    ranks = [sum(int(sizes_a[c]) for f2, c in pairs if f2 == f) for f in range(10)]
    want = [f for f in range(10) if ranks[f] > 1]
    with mock.patch.object(np, "bincount", wraps=np.bincount) as counts:
        assert _met_by_several(frags, classes, sizes_a, 10).tolist() == want
    if one_size and (sizes[0] > 1 or not want):
        assert not counts.called, "rows found by flags, not counted"
    if one_size:
        assert _met_by_several(frags, np.zeros(0, np.int64), sizes_a, 10).tolist() == want
