"""Owners of the share_reads plan's shared fragments (coordinator).

Split from :mod:`bcp.shared_read`, which finds the shared fragments and their needing
rank classes: here, which needing rank reads each one, balancing bytes to fetch by
needer set (:func:`choose_owners`)."""

from __future__ import annotations

import itertools

import numpy as np

from bcp.metadata.geometry import stable_order


def choose_owners(
    class_members: np.ndarray,
    mstarts: np.ndarray,
    pair_classes: np.ndarray,
    pair_starts: np.ndarray,
    sizes: np.ndarray,
    world: int,
    group: np.ndarray,
    class_tags: np.ndarray | None = None,
) -> np.ndarray:
    """The owner of each shared fragment (in tag order), one of its needers, balancing
    bytes to fetch: fragments are grouped by needer set (``group``: equal labels for
    equal sets), groups taken in order of their first fragment. A group of one fragment
    goes to its least-loaded needer so far (ties to the lowest rank: the previous
    rule). A larger group's bytes are water-filled over its needers (each needer's
    target brings its load towards a common level), then its fragments, in tag order,
    are cut into consecutive runs matching those targets (a fragment goes to the
    needer whose target holds its midpoint). A group's needers are the ranks of its
    first fragment's classes (``pair_classes[pair_starts[k]:pair_starts[k + 1]]``), class
    c's ranks ``class_members[mstarts[c]:mstarts[c + 1]]``.
    ``class_tags``: the (tag, class) pairs' tags in order of class then tag, where the
    matching gave them so (the fragments of one class, labelled by it, in group order)."""
    k = len(pair_starts) - 1
    owners = np.zeros(k, np.int32)
    if not k:
        return owners
    # fragments by group (label order, tag order within); groups visited by first fragment
    order = _group_order(group, pair_starts, class_tags)
    counts = np.bincount(group)
    gstart = np.r_[0, np.cumsum(counts)].astype(np.int64)
    present = np.flatnonzero(counts)
    visit = present[np.argsort(order[gstart[present]], kind="stable")]
    # each group's running byte count (exact int64, a cumsum of its slice: no array as long
    # as every fragment); the fragments' midpoints on it, non-decreasing within a group, so
    # a group's cut points are binary searches of its targets (a few per group)
    sz = sizes[order].astype(np.int64, copy=False)
    # plain Python per group (a few needers each): loads, members and cuts as ints
    load = [0] * world
    ranks_of = [class_members[x:y].tolist() for x, y in itertools.pairwise(mstarts.tolist())]
    run_ranks: list[list[int]] = [[]] * len(counts)  # per group label
    run_lengths: list[list[int]] = [[]] * len(counts)
    gs = gstart.tolist()
    for g in visit.tolist():
        a, b = gs[g], gs[g + 1]
        f0 = int(order[a])
        p0, p1 = int(pair_starts[f0]), int(pair_starts[f0 + 1])
        if p1 - p0 == 1:
            members = ranks_of[int(pair_classes[p0])]
        else:
            members = sorted(r for c in pair_classes[p0:p1].tolist() for r in ranks_of[c])
        if b - a == 1:
            owner = min(members, key=load.__getitem__)  # the first least-loaded: ranks ascend
            run_ranks[g], run_lengths[g] = [owner], [1]
            load[owner] += int(sz[a])
            continue
        have = [load[m] for m in members]
        cum = np.cumsum(sz[a:b])
        level = _water_level(have, int(cum[-1]))
        target, acc = [], 0.0
        for h in have[:-1]:
            acc += max(level - h, 0.0)
            target.append(acc)
        # fragment i goes to members[j], j = targets at or below its midpoint (at most the last)
        cuts = [0, *np.searchsorted(cum - sz[a:b] / 2.0, target, side="left").tolist(), b - a]
        run_ranks[g], run_lengths[g] = members, [y - x for x, y in itertools.pairwise(cuts)]
        held = [int(cum[c - 1]) if c else 0 for c in cuts]
        for m, x, y in zip(members, held, held[1:], strict=False):
            load[m] += y - x
    # the runs, by group label, cover the fragments as ``order`` lists them
    flat_ranks = [r for runs in run_ranks for r in runs]
    owners[order] = np.repeat(np.array(flat_ranks, np.int32), [n for runs in run_lengths for n in runs])
    return owners


def narrow_stable_order(keys: np.ndarray) -> np.ndarray:
    """``stable_order(keys)`` of int keys; where they span fewer than 2**16 values (owner
    ranks, rank classes), one ``np.argsort`` of ``keys - min`` as uint16, kind
    "stable": numpy's radix sort for 16-bit keys, a few times faster at millions than a
    sort of int64 keys packed with their positions."""
    if len(keys) < 2:
        return np.arange(len(keys))
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo >= 1 << 16:
        return stable_order(keys)
    small = np.subtract(keys, lo, dtype=np.int64) if lo else keys
    return np.argsort(small.astype(np.uint16), kind="stable")


def _group_order(group: np.ndarray, pair_starts: np.ndarray, class_tags: np.ndarray | None) -> np.ndarray:
    """``stable_order(group)``: fragments by label, tag order within. A fragment one
    class needs is labelled by that class (below every other label), so where the pairs'
    tags are at hand class by class those fragments come in that order already: only
    the fragments of several classes are sorted (at a chunk boundary, a few)."""
    if class_tags is None:
        return narrow_stable_order(group)
    several = np.flatnonzero(np.diff(pair_starts) > 1)
    if not len(several):
        return class_tags
    alone = np.ones(len(group), bool)
    alone[several] = False
    return np.concatenate((class_tags[alone[class_tags]], several[narrow_stable_order(group[several])]))


def _water_level(have: list[int], total: int) -> float:
    """The level L such that raising every load in ``have`` below L up to L takes
    exactly ``total`` (loads above L stay). Plain Python: a group has few needers."""
    ascending = sorted(have)
    acc = 0
    for i, h in enumerate(ascending):
        acc += h
        fill = (total + acc) / (i + 1)
        if i + 1 == len(ascending) or fill <= ascending[i + 1]:
            return fill
    return 0.0
