"""The share_reads plan's owners (``share_owners.choose_owners``, vectorised over each group's
fragments) against a plain per-fragment reference of the same rule, kept here: shared
fragments grouped by needer set, groups in order of their first fragment; a group of
one fragment to its least-loaded needer (ties to the lowest rank), a larger group's
bytes water-filled over its needers and its fragments, in order, given to the needer
whose target holds their midpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.io_scheduler import share_owners
from bcp.io_scheduler.share_owners import choose_owners
from bcp.metadata import itemsize
from bcp.metadata.geometry import stable_order
from bcp.shared_read import Wanted, _dense_inverse, _met_by_several, _RankClasses, plan_shares
from helpers import examples
from test_share_parts import job
from test_shared_read_plan import ref_plan_sharing


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def ref_owners(needers: list[tuple[int, ...]], sizes: list[int], world: int) -> list[int]:
    groups: dict[tuple[int, ...], list[int]] = {}  # insertion order: by first fragment
    for k, ranks in enumerate(needers):
        groups.setdefault(ranks, []).append(k)
    load = [0] * world
    owners = [-1] * len(needers)
    for members, frags in groups.items():
        if len(frags) == 1:
            owner = min(members, key=lambda r: (load[r], r))
            owners[frags[0]] = owner
            load[owner] += sizes[frags[0]]
            continue
        total = sum(sizes[f] for f in frags)
        have = [load[r] for r in members]
        low = sorted(have)
        for i in range(1, len(low) + 1):  # the level raising the i lowest loads takes ``total``
            level = (total + sum(low[:i])) / i
            if i == len(low) or level <= low[i]:
                break
        bounds, acc = [], 0.0
        for h in have:
            acc += max(level - h, 0.0)
            bounds.append(acc)
        done = 0
        for f in frags:
            done += sizes[f]
            midpoint = done - sizes[f] / 2
            j = next((j for j, b in enumerate(bounds[:-1]) if midpoint < b), len(members) - 1)
            owners[f] = members[j]
        for f in frags:
            load[owners[f]] += sizes[f]
    return owners


@settings(max_examples=examples(300), deadline=None)
@given(
    n_classes=st.integers(1, 6),
    data=st.data(),
)
def test_owners_follow_the_grouped_water_fill(n_classes, data):
    world = data.draw(st.integers(n_classes, 12), label="world")
    # every class has a rank; the rest fall anywhere (classes interleave)
    rank_class = np.array(
        list(range(n_classes))
        + data.draw(st.lists(st.integers(0, n_classes - 1), min_size=world - n_classes, max_size=world - n_classes)),
        np.int64,
    )
    rank_class = rank_class[np.array(data.draw(st.permutations(range(world)), label="ranks' order"))]
    classes = _RankClasses.of_classes(rank_class)
    pool = data.draw(
        st.lists(st.sets(st.integers(0, n_classes - 1), min_size=1), min_size=1, max_size=5), label="needer sets"
    )
    sets = [sorted(s) for s in pool if sum(int(classes.sizes[c]) for c in s) > 1] or [[0]]
    k = data.draw(st.integers(1, 40), label="fragments")
    which = data.draw(st.lists(st.integers(0, len(sets) - 1), min_size=k, max_size=k), label="each one's set")
    big = data.draw(st.booleans(), label="sizes past 2**32")
    sizes = data.draw(st.lists(st.integers(0, (1 << 40) if big else 9), min_size=k, max_size=k), label="sizes")
    tags = np.repeat(np.arange(k), [len(sets[w]) for w in which])
    cls = np.array([c for w in which for c in sets[w]], np.int64)
    pair_classes, pair_starts, group = classes.labels(tags, cls, k)
    # the pairs' tags class by class, as the matching gives them: fragments of one class in order already
    class_tags = tags[np.lexsort((tags, cls))] if data.draw(st.booleans(), label="class-major tags") else None
    got = choose_owners(
        classes.members, classes.mstarts, pair_classes, pair_starts, np.array(sizes, np.int64), world, group, class_tags
    )
    needers = [tuple(classes.ranks_of(np.array(sets[w])).tolist()) for w in which]
    want = ref_owners(needers, sizes, world)
    assert got.tolist() == want
    assert all(o in n for o, n in zip(got.tolist(), needers, strict=True))


@settings(max_examples=examples(200), deadline=None)
@given(keys=st.lists(st.integers(0, 60), min_size=1, max_size=50), wide=st.booleans())
def test_dense_inverse_numbers_keys_as_unique_does(keys, wide):
    bound = (1 << 40) if wide else 61  # wide: past the table's bound, np.unique itself
    a = np.array(keys, np.int64) * (bound // 61)
    got = _dense_inverse(a, bound)
    assert got.reshape(-1).tolist() == np.unique(a, return_inverse=True)[1].reshape(-1).tolist()


@settings(max_examples=examples(150), deadline=None)
@given(case=job())
def test_the_plan_is_the_same_array_for_array_without_the_class_major_order(case, monkeypatch_module):
    """The owners' group order taken from the matching's class-major tags gives the
    plan, value for value and dtype for dtype, that sorting every fragment's label gives."""
    reader, wanted = case
    encoded = [Wanted.encode(reader, w) for w in wanted]
    fast = plan_shares(reader, encoded)
    with monkeypatch_module.context() as m:
        m.setattr(share_owners, "_group_order", lambda group, _starts, _tags: stable_order(group))
        slow = plan_shares(reader, encoded)
    for field in ("tensors", "offsets", "lengths", "owners", "pair_classes", "pair_starts", "rank_class"):
        a, b = getattr(fast, field), getattr(slow, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field


@settings(max_examples=examples(200), deadline=None)
@given(case=job(), dp=st.integers(1, 3), interleave=st.booleans())
def test_the_whole_plan_equals_the_plain_reference_value_for_value(case, dp, interleave):
    """The coordinator's plan for data-parallel replicas (every distinct list wanted by
    ``dp`` ranks, as consecutive or interleaved ranks) against the plain per-fragment
    reference: the same shared fragments in catalog order, needing ranks, owners by the
    grouped water-fill (exactly) and sizes, whatever shortcuts the replicas allow."""
    reader, wanted = case
    lists = list({repr(w): w for w in wanted}.values())
    if interleave:
        wanted = [lists[r % len(lists)] for r in range(dp * len(lists))]
    else:
        wanted = [lists[r // dp] for r in range(dp * len(lists))]
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    want = ref_plan_sharing(reader, wanted)
    names = list(reader.catalog.tensors)
    ndims = [len(reader.catalog.shape(f)) for f in names]
    keys = [
        (names[t], (tuple(o[:d]), tuple(n[:d])))
        for t, o, n, d in zip(
            plan.tensors.tolist(),
            plan.offsets.tolist(),
            plan.lengths.tolist(),
            [ndims[t] for t in plan.tensors.tolist()],
            strict=True,
        )
    ]
    catalog_order: dict = {}
    for i, f in enumerate(reader.catalog.fragments):
        catalog_order.setdefault((f.fqn, (f.offsets, f.lengths)), i)
    assert keys == sorted(want, key=lambda k: catalog_order[k])
    needers = [tuple(sorted([o, *rs])) for o, rs in (want[k] for k in keys)]
    got = [tuple(plan.needers[plan.starts[i] : plan.starts[i + 1]].tolist()) for i in range(len(keys))]
    assert got == needers
    sizes = [math.prod(n) * itemsize(reader.catalog.tensors[f].dtype) for f, (_o, n) in keys]
    assert plan.owners.tolist() == ref_owners(needers, sizes, len(wanted))
    assert plan.owners.dtype == np.int32 and plan.pair_classes.dtype == plan.pair_starts.dtype == np.int64
    assert plan.class_tags is None or plan.class_tags.dtype == np.intp  # gathered by, as index arrays


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), n_frags=st.integers(1, 30), n_classes=st.integers(1, 5), uniform=st.booleans())
def test_rows_met_by_several_ranks_are_those_counted_so(data, n_frags, n_classes, uniform):
    """Rows needed by more than one rank, found by flags where every class has two ranks
    or more, are the rows whose needing ranks, counted, exceed one."""
    size = data.draw(st.integers(1, 3))
    sizes = np.array(
        [size] * n_classes
        if uniform
        else data.draw(st.lists(st.integers(1, 3), min_size=n_classes, max_size=n_classes)),
        np.int64,
    )
    pairs = sorted(data.draw(st.sets(st.tuples(st.integers(0, n_frags - 1), st.integers(0, n_classes - 1)))))
    frags = np.array([f for f, _c in pairs], np.int32)
    classes = np.array([c for _f, c in pairs], np.int32)
    counted = np.bincount(frags, weights=sizes[classes], minlength=n_frags) if pairs else np.zeros(n_frags)
    got = _met_by_several(frags, classes, sizes, n_frags)
    assert got.tolist() == np.flatnonzero(counted > 1).tolist()
