"""The share_reads plan's cheaper steps (issue 37: its CPU at 4,096 ranks) give exactly
what the steps they replaced gave, kept here as the references: the pairs' tag order by
a counting sort (:func:`by_tag`; before, one sort of packed keys), what each owner sends
with fewer pair-long temporaries (:func:`_sent_by_owner`), the owner and class orders by
a 16-bit radix argsort (:func:`narrow_stable_order`), and the positions of every
window (:func:`_windows`), values and dtypes, for random inputs; and classes of one
rank matched without classes or elements per pair until a row is met twice give the
general test's plan, batch size whatever."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.io_scheduler import share_parts
from bcp.io_scheduler.share_match import ascending, by_tag, tag_major
from bcp.io_scheduler.share_owners import narrow_stable_order
from bcp.metadata.geometry import packed_keys, stable_order
from bcp.shared_read import Wanted, plan_shares
from helpers import examples
from test_load_plan_fast import SHAPES, stored_layout
from test_shared_read_plan import reader_of, sliced


def ref_by_tag(tags: np.ndarray, classes: np.ndarray, k: int, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """by_tag before the counting sort: one sort of the pairs packed into one int64."""
    if len(tags) < 2 or not ascending(classes) or tag_major(tags, classes, n_classes):
        return tags, classes
    packed = packed_keys(tags, classes, n_classes)
    if packed is None or (len(classes) and int(classes.min()) < 0):
        order = stable_order(tags)
        return tags[order], classes[order]
    packed.sort()
    bits = max(n_classes - 1, 1).bit_length()
    out_cls = packed & ((1 << bits) - 1)
    packed >>= bits
    packed += int(tags.min())
    return packed.astype(tags.dtype, copy=False), out_cls.astype(classes.dtype, copy=False)


def ref_sent_by_owner(world, owners, pair_classes, pair_starts, n_classes):
    """_sent_by_owner before: a repeat and an arange as long as the pairs, owner
    offsets added and taken off by repeats."""
    span = max(world, int(owners.max()) + 1) if len(owners) else world
    obounds = np.zeros(span + 1, np.int64)
    np.cumsum(np.bincount(owners, minlength=span), out=obounds[1:])
    by_owner = stable_order(owners)
    per_tag = np.diff(pair_starts)[by_owner]
    sstarts = np.zeros(len(by_owner) + 1, np.int64)
    np.cumsum(per_tag, out=sstarts[1:])
    n = int(sstarts[-1])
    pos = np.repeat(pair_starts[by_owner] - sstarts[:-1], per_tag)
    pos += np.arange(n, dtype=np.int64)
    key = pair_classes[pos].astype(np.int64)
    per_owner = np.diff(sstarts[obounds])
    key += np.repeat(np.arange(span, dtype=np.int64) * n_classes, per_owner)
    bound = span * n_classes
    if n and bound <= 8 * n + share_parts._TABLE_SLACK:
        seen = np.zeros(bound, bool)
        seen[key] = True
        number = np.cumsum(seen, dtype=np.int32 if bound < 1 << 31 else np.int64)
        uniq = np.flatnonzero(seen)
        local = number[key].astype(np.int64)
        local -= 1
    else:
        uniq, inverse = np.unique(key, return_inverse=True)
        local = inverse.reshape(-1).astype(np.int64, copy=False)
    ubounds = np.searchsorted(uniq, np.arange(span + 1, dtype=np.int64) * n_classes)
    local -= np.repeat(ubounds[:-1], per_owner)
    at = obounds[: world + 1]
    return at.tolist(), sstarts, local, ubounds[: world + 1].tolist(), uniq % max(n_classes, 1)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


@settings(max_examples=examples(300), deadline=None)
@given(
    per_class=st.lists(st.lists(st.integers(0, 60), max_size=14, unique=True), min_size=1, max_size=9),
    extra_k=st.integers(0, 5),
    narrow=st.booleans(),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_by_tag_equals_the_packed_sort(per_class, extra_k, narrow, shuffle, data):
    """Class-major (tag, class) pairs, each once, tags in any order within a class
    (sorted or not), tags int64 or int32: the counting sort gives the packed sort's
    arrays, values and dtypes; tags past k, or k large beside the pairs, take the
    stable sort; int32 pairs returned as int64 (``dtype``) give the int64 pairs' order."""
    dtype = np.int32 if narrow else np.int64
    lists = [sorted(ts) if not shuffle else data.draw(st.permutations(ts)) for ts in per_class]
    tags = np.array([t for ts in lists for t in ts], dtype)
    classes = np.array([c for c, ts in enumerate(lists) for _t in ts], np.int64)
    top = int(tags.max()) + 1 if len(tags) else 0
    for k in (top + extra_k, max(top - 1, 0), top + (1 << 23)):
        got, want = by_tag(tags, classes, k, len(lists)), ref_by_tag(tags, classes, k, len(lists))
        assert same(got[0], want[0]) and same(got[1], want[1])
        # narrow inputs written as int64 while placed: the int64 copies' order
        wide = ref_by_tag(tags.astype(np.int64), classes, k, len(lists))
        got = by_tag(tags, classes.astype(np.int32), k, len(lists), dtype=np.int64)
        assert same(got[0], wide[0]) and same(got[1], wide[1])


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), n_classes=st.integers(1, 7), world=st.integers(1, 9), table=st.booleans())
def test_what_each_owner_sends_equals_the_previous_arrays(data, n_classes, world, table):
    """_sent_by_owner gives the previous version's bounds and arrays, values and
    dtypes: tags of one class or of several, owners past ``world``, table or sort."""
    k = data.draw(st.integers(0, 40), label="fragments")
    owners = np.array(data.draw(st.lists(st.integers(0, world + 1), min_size=k, max_size=k)), np.int32)
    most = data.draw(st.integers(1, n_classes), label="classes per fragment at most")
    sets = [sorted(data.draw(st.sets(st.integers(0, n_classes - 1), min_size=1, max_size=most))) for _ in range(k)]
    pair_classes = np.array([c for s in sets for c in s], np.int64)
    pair_starts = np.r_[0, np.cumsum([len(s) for s in sets])].astype(np.int64)
    slack = share_parts._TABLE_SLACK
    share_parts._TABLE_SLACK = slack if table else -(1 << 40)
    try:
        got = share_parts._sent_by_owner(world, owners, pair_classes, pair_starts, n_classes)
        want = ref_sent_by_owner(world, owners, pair_classes, pair_starts, n_classes)
    finally:
        share_parts._TABLE_SLACK = slack
    assert got[0] == want[0] and got[3] == want[3]
    for g, w in zip((got[1], got[2], got[4]), (want[1], want[2], want[4]), strict=True):
        assert same(g, w)


@settings(max_examples=examples(300), deadline=None)
@given(
    values=st.lists(st.integers(-5, 70), max_size=60),
    scale=st.sampled_from([1, 1000, 1 << 16, 1 << 40]),
    dtype=st.sampled_from([np.int32, np.int64]),
)
def test_narrow_stable_order_is_the_stable_argsort(values, scale, dtype):
    """Keys spanning fewer than 2**16 values (the radix sort) or more (the packed sort),
    negative or not: the stable argsort's order."""
    if dtype is np.int32 and scale > 1 << 16:
        scale = 1 << 16
    keys = np.array(values, np.int64) * scale
    keys = keys.astype(dtype)
    assert narrow_stable_order(keys).tolist() == np.argsort(keys, kind="stable").tolist()


@settings(max_examples=examples(300), deadline=None)
@given(windows=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 4)), max_size=20))
def test_windows_are_every_position_of_each_window(windows):
    """Positions first, first + 1, ... of every window, in order: as the repeat and
    arange the running sum replaced give them (empty windows included)."""
    first = np.array([f for f, _w in windows], np.int64)
    width = np.array([w for _f, w in windows], np.int64)
    starts = np.zeros(len(width) + 1, np.int64)
    np.cumsum(width, out=starts[1:])
    n = int(starts[-1])
    want = np.repeat(first - starts[:-1], width) + np.arange(n, dtype=np.int64)
    got = share_parts._windows(first, width, starts, n)
    assert same(got, want)


@settings(max_examples=examples(200), deadline=None)
@given(shapes=st.lists(SHAPES, min_size=1, max_size=3), ranks=st.integers(2, 6), data=st.data())
def test_one_rank_classes_plan_the_same_in_batches_of_any_size(shapes, ranks, data):
    """Ranks wanting each their own slice of every tensor (classes of one rank) are
    matched without classes or elements per pair until a stored row is met twice, by
    an earlier batch or within one; then matched again with them. Batches of one class,
    of two and of the default size give one plan, array for array, and the plan of the
    general overlap test."""
    from bcp import shared_read

    names = [f"t{i}" for i in range(len(shapes))]
    tensors = {}
    for n, s in zip(names, shapes, strict=True):
        stored = data.draw(sliced(s, 0), label=f"stored {n}") if s else data.draw(stored_layout(s))
        tensors[n] = (s, stored, "float32")
    reader = reader_of(tensors)
    wanted = []
    for r in range(ranks):
        mine = []
        for n, s in zip(names, shapes, strict=True):
            if not s:
                continue
            if data.draw(st.booleans(), label=f"rank {r} {n} as stored"):
                mine.append((n, tensors[n][1][r % len(tensors[n][1])]))
            else:
                cells = data.draw(sliced(s, 0), label=f"rank {r} {n} cells")
                mine.append((n, cells[r % len(cells)]))
        wanted.append(mine)
    encoded = [Wanted.encode(reader, w) for w in wanted]
    general = plan_shares(reader, encoded, cut_index=False)
    saved = shared_read.BOX_BATCH
    try:
        for batch in (1, 2, saved):
            shared_read.BOX_BATCH = batch
            got = plan_shares(reader, encoded)
            for field in ("tensors", "offsets", "lengths", "owners", "pair_classes", "pair_starts", "rank_class"):
                assert np.array_equal(getattr(got, field), getattr(general, field)), (batch, field)
    finally:
        shared_read.BOX_BATCH = saved


@settings(max_examples=examples(300), deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 40), max_size=12), max_size=5),
    extra=st.integers(0, 5),
    narrow=st.booleans(),
)
def test_met_twice_is_a_count_above_one(batches, extra, narrow):
    """Rows met twice, checked batch by batch in a table of flags (no joined copy of the
    rows), as the count of each row over them all says."""
    from bcp.io_scheduler.share_match import met_twice

    dtype = np.int32 if narrow else np.int64
    rows = [np.array(b, dtype) for b in batches]
    n = max([v for b in batches for v in b], default=-1) + 1 + extra
    joined = np.concatenate(rows) if rows else np.zeros(0, dtype)
    assert met_twice(rows, n) == bool(len(joined) and np.bincount(joined, minlength=n).max() > 1)


@settings(max_examples=examples(300), deadline=None)
@given(
    batches=st.lists(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1 << 60)), max_size=8), max_size=4),
    as_float=st.booleans(),
)
def test_pair_columns_as_float_weigh_as_the_int_elements(batches, as_float):
    """Elements joined as float64 (``as_float``) give np.bincount the weights it made of
    the int64 elements before, bit for bit; classes joined as they are."""
    from bcp.io_scheduler.share_match import pair_columns

    found = [
        (
            np.array([f for f, _e in b], np.int64),
            np.arange(len(b), dtype=np.int32),
            np.array([e for _f, e in b], np.int64),
        )
        for b in batches
    ]
    if not found:
        return
    frags = np.concatenate([f for f, _c, _e in found])
    ints = np.concatenate([e for _f, _c, e in found])
    classes = np.concatenate([c for _f, c, _e in found])
    batches_left = list(found)
    cls, elems = pair_columns(batches_left, as_float)
    assert not batches_left  # emptied: its batches freed
    assert same(cls, classes)
    assert elems.dtype == (np.float64 if as_float else np.int64)
    want = np.bincount(frags, weights=ints, minlength=31)
    assert np.array_equal(np.bincount(frags, weights=elems, minlength=31), want)


def test_one_rank_classes_run_the_general_test_once(monkeypatch):
    """Classes of one rank each whose boxes go to the general overlap test (no cut index)
    and meet a stored row twice: the general test's pairs carry their classes and
    elements already, so it runs once, not again with the cut index's second match."""
    from bcp import shared_read

    reader = reader_of({"t": ((6,), [((0,), (3,)), ((3,), (3,))], "float32")})
    wanted = [[("t", ((0,), (4,)))], [("t", ((2,), (4,)))]]  # rows 0 and 1, rows 0 and 1: both met twice
    encoded = [Wanted.encode(reader, w) for w in wanted]
    calls = []
    real = shared_read.general_pairs
    monkeypatch.setattr(shared_read, "general_pairs", lambda *a: calls.append(1) or real(*a))
    plan = plan_shares(reader, encoded, cut_index=False)
    assert len(calls) == 1
    assert len(plan.tensors) == 2 and plan.pair_starts.tolist() == [0, 2, 4]  # both rows, each needed by both ranks
