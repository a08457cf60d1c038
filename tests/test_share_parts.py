"""Each rank's part of the share_reads plan, encoded per rank class (bcp/io_scheduler/
share_parts.py), decodes to exactly the part the previous per-fragment encoding gave
(kept here as the reference: every shared fragment's needing ranks expanded, sorted
by rank), for random layouts, rank counts and data-parallel classes; and a rank
refuses a part that is not of this version, not its own, or not self-consistent."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp.errors
from bcp.io_scheduler.share_match import by_tag
from bcp.io_scheduler.share_parts import SHARE_PART_VERSION, SharePart
from bcp.metadata.geometry import stable_order
from bcp.shared_read import Wanted, plan_shares
from helpers import examples, share_plan_pairs
from test_load_plan_fast import SHAPES, dest_boxes, stored_layout
from test_shared_read_plan import reader_of, sliced


def ref_parts(plan, world: int) -> list[tuple[np.ndarray, ...]]:
    """The previous SharePlan.parts, from the expanded needers: per rank (tags, tensors,
    offsets, lengths, owners, receivers flat, recv_starts)."""
    needers, starts, owners = plan.needers, plan.starts, plan.owners
    counts = np.diff(starts)
    tags = np.repeat(np.arange(len(owners)), counts)
    by_rank = tags[stable_order(needers)]
    bounds = np.r_[0, np.cumsum(np.bincount(needers, minlength=world))]
    owner_of = owners.astype(np.int64)[tags]
    sends = np.flatnonzero(needers != owner_of)
    sender = owner_of[sends]
    order = stable_order(sender)
    sends, sender = sends[order], sender[order]
    send_to = needers[sends]
    send_bounds = np.searchsorted(sender, np.arange(world + 1))
    out = []
    for r in range(world):
        mine = by_rank[bounds[r] : bounds[r + 1]]
        n_recv = np.where(owners[mine] == r, counts[mine] - 1, 0)
        recv_starts = np.r_[0, np.cumsum(n_recv)]
        out.append(
            (
                mine,
                plan.tensors[mine],
                plan.offsets[mine],
                plan.lengths[mine],
                owners[mine],
                send_to[send_bounds[r] : send_bounds[r + 1]],
                recv_starts,
            )
        )
    return out


@st.composite
def job(draw):
    """A reader over random stored layouts and every rank's wanted boxes: ranks in
    data-parallel groups (identical lists), groups wanting stored boxes, slices cut
    another way, or arbitrary boxes."""
    shapes = draw(st.lists(SHAPES, min_size=1, max_size=4))
    ranks = draw(st.integers(1, 9))
    names = [f"t{i}" for i in range(len(shapes))]
    tensors = {}
    for n, s in zip(names, shapes, strict=True):
        if s and draw(st.booleans()):
            stored = draw(sliced(s, draw(st.integers(0, len(s) - 1))))
        else:
            stored = draw(stored_layout(s))
        tensors[n] = (s, stored, draw(st.sampled_from(["float32", "bfloat16"])))
    reader = reader_of(tensors)
    groups = draw(st.integers(1, ranks))
    per_group = []
    for g in range(groups):
        mine = []
        for n, s in zip(names, shapes, strict=True):
            kind = draw(st.sampled_from(["stored", "slice", "boxes", "whole", "none"]))
            if kind == "stored":
                mine.append((n, tensors[n][1][g % len(tensors[n][1])]))
            elif kind == "slice" and s:
                cells = draw(sliced(s, draw(st.integers(0, len(s) - 1))))
                mine.append((n, cells[g % len(cells)]))
            elif kind == "boxes":
                mine += [(n, b) for b in draw(dest_boxes(s))]
            elif kind == "whole":
                mine.append((n, ((0,) * len(s), s)))
        per_group.append(mine)
    wanted = [per_group[draw(st.integers(0, groups - 1))] for _r in range(ranks)]
    return reader, wanted


@settings(max_examples=examples(300), deadline=None)
@given(case=job(), extra=st.integers(0, 2))
def test_class_parts_decode_to_the_per_fragment_parts(case, extra):
    reader, wanted = case
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    world = len(wanted) + extra  # ranks past the plan's get empty parts
    names = list(reader.catalog.tensors)
    ndims = [len(reader.catalog.shape(f)) for f in names]
    got = plan.parts(world)
    assert len(got) == world
    assert share_plan_pairs(plan) == len(plan.needers) == sum(len(p.tags) for p in got)
    for r, (part, want) in enumerate(zip(got, ref_parts(plan, world), strict=True)):
        part.check(rank=r, world=world, ndims=ndims)
        tags, tensors, offsets, lengths, owners, receivers, recv_starts = want
        assert part.version == SHARE_PART_VERSION and (part.rank, part.world) == (r, world)
        assert np.array_equal(part.tags, tags)
        assert np.array_equal(part.tensors, tensors)
        assert np.array_equal(part.offsets, offsets) and np.array_equal(part.lengths, lengths)
        assert np.array_equal(part.owners, owners)
        assert np.array_equal(part.receivers, receivers), (r, part.receivers, receivers)
        assert np.array_equal(part.recv_starts, recv_starts)
        for i in range(len(part.tags)):
            assert np.array_equal(part.receivers_of(i), receivers[recv_starts[i] : recv_starts[i + 1]])


def two_rank_part() -> SharePart:
    """Rank 0's part of a plan where ranks 0 and 1 both want all of one tensor."""
    stored = [((r * 3, 0), (3, 4)) for r in range(4)]
    reader = reader_of({"w": ((12, 4), stored, "float32")})
    wanted = [[("w", ((0, 0), (12, 4)))]] * 2
    part = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted]).parts(2)[0]
    part.check(rank=0, world=2, ndims=[2])
    assert len(part.tags) == 4 and len(part.send_starts) > 1, "rank 0 owns some of the four fragments"
    return part


BROKEN = {
    "another version": (lambda p: {"version": SHARE_PART_VERSION + 1}, "version"),
    "another rank": (lambda p: {"rank": 1}, "made for rank 1"),
    "another world": (lambda p: {"world": 3}, "of 3"),
    "tags out of order": (lambda p: {"tags": p.tags[::-1].copy()}, "ascending"),
    "a tag missing": (lambda p: {"tags": p.tags[1:]}, "differ in length"),
    "an owner out of range": (lambda p: {"owners": p.owners + 5}, "owner"),
    "a float array": (lambda p: {"offsets": p.offsets.astype(float)}, "integer"),
    "a negative length": (lambda p: {"lengths": -p.lengths}, "negative"),
    "an unknown tensor": (lambda p: {"tensors": p.tensors + 1}, "tensor index"),
    "sends cut short": (lambda p: {"send_starts": p.send_starts[:-1]}, "send_starts"),
    "a peer out of range": (lambda p: {"peer_ranks": p.peer_ranks + 7}, "peer"),
    "a sending class out of range": (lambda p: {"send_classes": p.send_classes + 9}, "sending class"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_rank_refuses_a_malformed_part(kind):
    part = two_rank_part()
    change, words = BROKEN[kind]
    bad = dataclasses.replace(part, **change(part))
    with pytest.raises(bcp.errors.CheckpointError, match="share_reads plan part for rank 0") as caught:
        bad.check(rank=0, world=2, ndims=[2])
    assert words in str(caught.value) and "\n" not in str(caught.value)


@settings(max_examples=examples(200), deadline=None)
@given(case=job())
def test_parts_from_the_matchings_class_order_equal_parts_sorted_back(case):
    """The plan keeps its (tag, class) pairs in the order the matching produced them,
    class after class, where that is so (``class_tags``): the parts sliced from it are
    the parts of the pairs sorted back by class, array for array."""
    reader, wanted = case
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    pair_tags = np.repeat(np.arange(len(plan.owners)), np.diff(plan.pair_starts))
    if plan.class_tags is not None:
        assert np.array_equal(plan.class_tags, pair_tags[stable_order(plan.pair_classes)])
    sorted_back = dataclasses.replace(plan, class_tags=None).parts(len(wanted))
    for a, b in zip(plan.parts(len(wanted)), sorted_back, strict=True):
        for field in dataclasses.fields(SharePart):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert np.array_equal(x, y) and np.asarray(x).dtype == np.asarray(y).dtype, field.name


def test_an_fsdp_like_plan_keeps_its_class_order():
    """Every class naming its tensors in catalog order (FSDP, HSDP): the plan keeps the
    class order, so its parts need no sort."""
    stored = [((r * 3, 0), (3, 4)) for r in range(4)]
    reader = reader_of({"w": ((12, 4), stored, "float32"), "b": ((12,), [((0,), (6,)), ((6,), (6,))], "float32")})
    halves = [[("w", ((0, 0), (6, 4))), ("b", ((0,), (6,)))], [("w", ((6, 0), (6, 4))), ("b", ((6,), (6,)))]]
    wanted = [halves[0], halves[0], halves[1], halves[1]]
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    assert len(plan.owners) == 6 and plan.class_tags is not None
    assert plan.class_tags.tolist() == [0, 1, 4, 2, 3, 5]


def test_parts_gather_each_class_without_copying_every_box_first():
    """At 4,096 ranks the coordinator's memory peaks while it cuts the parts: each class's
    boxes are gathered straight from the plan's offsets and lengths (no joined copy of
    every shared box first), so cutting the parts allocates little beyond the parts."""
    import tracemalloc

    from bcp.io_scheduler.share_parts import class_parts

    k, width = 200_000, 4  # boxes wider than the per-fragment temporaries (int64 each)
    rng = np.random.default_rng(0)
    offsets = rng.integers(0, 1000, (k, width)).astype(np.int64)
    lengths = rng.integers(1, 1000, (k, width)).astype(np.int64)
    tensors = np.zeros(k, np.int32)
    owners = np.zeros(k, np.int32)
    pair_classes = np.zeros(k, np.int64)  # one class of two ranks needs every fragment
    pair_starts = np.arange(k + 1, dtype=np.int64)
    rank_class = np.zeros(2, np.int64)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        parts = class_parts(2, tensors, offsets, lengths, owners, pair_classes, pair_starts, rank_class)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(parts[1].offsets, offsets) and np.array_equal(parts[1].lengths, lengths)
    assert after - before >= offsets.nbytes + lengths.nbytes  # the parts themselves
    beyond = (peak - after) / 1e6
    assert peak - after < offsets.nbytes + lengths.nbytes, f"{beyond:.1f} MB beyond the parts while cutting them"


@settings(max_examples=examples(200), deadline=None)
@given(
    per_class=st.lists(st.sets(st.integers(0, 50), max_size=12), min_size=1, max_size=8),
    shift=st.sampled_from([0, 1 << 20, (1 << 62) - 64]),
)
def test_by_tag_is_the_lexsort_order(per_class, shift):
    """Class-major (tag, class) pairs, each once, come back in (tag, class) order, as a
    lexsort gives them: by the packed sort, or by the stable sort where the tags' span
    with the class bits passes 63 bits (a shift near 2**62 with a tag 0 forced)."""
    tags = np.array([shift + t for ts in per_class for t in sorted(ts)], np.int64)
    classes = np.array([c for c, ts in enumerate(per_class) for _t in ts], np.int64)
    if shift > 1 << 40 and len(tags):
        tags[0] = 0  # span ~2**62: packed keys refused
    order = np.lexsort((classes, tags))
    got_tags, got_cls = by_tag(tags, classes, int(tags.max()) + 1 if len(tags) else 0, len(per_class))
    assert got_tags.tolist() == tags[order].tolist()
    assert got_cls.tolist() == classes[order].tolist()


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), n_classes=st.integers(1, 6), world=st.integers(1, 8), table=st.booleans())
def test_what_each_rank_sends_is_its_own_unique_of_classes(data, n_classes, world, table):
    """The sends of every rank found at once (one numbering of (owner, class) keys)
    equal each rank's own ``np.unique`` of the classes it sends to (the per-rank loop
    this replaced), owners past ``world`` included, both the table and the sort."""
    from bcp.io_scheduler import share_parts

    k = data.draw(st.integers(0, 30), label="fragments")
    owners = np.array(data.draw(st.lists(st.integers(0, world + 1), min_size=k, max_size=k)), np.int32)
    sets = [sorted(data.draw(st.sets(st.integers(0, n_classes - 1), min_size=1))) for _ in range(k)]
    pair_classes = np.array([c for s in sets for c in s], np.int64)
    pair_starts = np.r_[0, np.cumsum([len(s) for s in sets])].astype(np.int64)
    slack = share_parts._TABLE_SLACK
    share_parts._TABLE_SLACK = slack if table else -(1 << 40)
    try:
        obounds, sstarts, local, ubounds, peers = share_parts._sent_by_owner(
            world, owners, pair_classes, pair_starts, n_classes
        )
    finally:
        share_parts._TABLE_SLACK = slack
    by_owner = stable_order(owners)
    for r in range(world):
        tags = by_owner[obounds[r] : obounds[r + 1]]
        assert (owners[tags] == r).all() and len(tags) == int((owners == r).sum())
        sent = [c for t in tags.tolist() for c in sets[t]]
        sa, sb = int(sstarts[obounds[r]]), int(sstarts[obounds[r + 1]])
        assert np.diff(sstarts[obounds[r] : obounds[r + 1] + 1]).tolist() == [len(sets[t]) for t in tags.tolist()]
        want_peers, want_local = np.unique(np.array(sent, np.int64), return_inverse=True)
        assert peers[ubounds[r] : ubounds[r + 1]].tolist() == want_peers.tolist()
        assert local[sa:sb].tolist() == want_local.reshape(-1).tolist()


@settings(max_examples=examples(200), deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(-1, 4)), max_size=30),
    block=st.integers(1, 5),
    sort=st.booleans(),
)
def test_pair_order_checks_by_block_equal_the_packed_key(pairs, block, sort):
    """The order checks done a block at a time (no key or step as long as the pairs) say
    what the packed key ``tags * n + classes`` and the class-major step test said,
    blocks of any size, classes inside [0, n) or not."""
    from bcp.io_scheduler import share_match

    pairs = sorted(pairs) if sort else pairs
    tags = np.array([t for t, _c in pairs], np.int64)
    classes = np.array([c for _t, c in pairs], np.int64)
    saved = share_match._CHECK_BLOCK
    share_match._CHECK_BLOCK = block
    try:
        for n in (3, 5):
            key = tags * n + classes
            assert share_match.tag_major(tags, classes, n) == bool(len(key) < 2 or (key[1:] >= key[:-1]).all())
        step = classes[1:] - classes[:-1]
        want = len(tags) < 2 or bool(((step > 0) | ((step == 0) & (tags[1:] > tags[:-1]))).all())
        assert share_match.class_major(classes, tags) == want
    finally:
        share_match._CHECK_BLOCK = saved


@settings(max_examples=examples(200), deadline=None)
@given(
    points=st.lists(st.integers(-2, 40), max_size=20), line=st.integers(1, 41), sort=st.booleans(), wide=st.booleans()
)
def test_the_cut_index_tables_count_points_at_or_before_each_place(points, line, sort, wide):
    """The cut index's prefix-count tables (runs of equal counts, or the plain count where
    points are out of order) are ``cumsum(bincount(points))`` over the line."""
    from bcp.io_scheduler.share_match import _upto

    a = np.array(sorted(points) if sort else points, np.int64)
    inside = (a >= 0) & (a < line)
    if not inside.all() or (len(a) > 1 and (np.diff(a) < 0).any()):
        a = np.unique(a[inside])  # the runs need ascending points; the marks distinct ones
    dtype = np.int64 if wide else np.int32
    got = _upto(a, line, dtype)
    assert got.dtype == dtype and got.tolist() == np.cumsum(np.bincount(a, minlength=line)).tolist()
