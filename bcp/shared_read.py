"""Zero-redundant load: a stored fragment that several ranks need is read from
storage once, by one of them, and sent to the others over the process group.

Planned once, by the coordinator: every rank sends it the boxes it wants as compact
arrays (tensor indices in catalog order, offsets, lengths). Ranks whose lists are
identical (data-parallel replicas) form one class and are matched once. The
coordinator finds, vectorised over every tensor (:mod:`.share_match`: slices of one
dimension on int intervals, a lookup per box; the rest by the general overlap test),
the stored fragments (one per distinct box) those boxes meet and the ranks that need each; where that is more than
one rank and together they want more than the fragment holds, one of those ranks
reads the whole fragment (verifying every checksum block) and sends it
point-to-point. Shared fragments are numbered (their tags) in catalog order: tensors
as the catalog lists them, each tensor's rows in catalog order. The owner balances
bytes to fetch, deterministically and vectorised: shared fragments are grouped by
their set of needing ranks, and the groups are taken in order of their first
fragment. A group of one fragment goes to its needer with the fewest bytes so far
(ties to the lowest rank, the previous per-fragment rule); a larger group's bytes are
water-filled over its needers (targets that raise the least-loaded towards a common
level) and its fragments, in order, cut into consecutive runs of those sizes. Each
rank receives only its part of the plan: what it reads and sends to whom, what it
receives from whom. The receivers then copy their parts from memory. Costs memory
for the shared fragments in flight; saves storage bandwidth and request count,
which is what object stores charge for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from bcp import trace
from bcp.coordination.collectives import GroupCoordinator, portable
from bcp.errors import CheckpointError
from bcp.gc_pause import gc_paused
from bcp.io_scheduler.read_exec import ReadStats
from bcp.io_scheduler.share_disjoint import without_disjoint
from bcp.io_scheduler.share_match import (
    BOX_BATCH,
    CutIndex,
    box_batches,
    by_tag,
    class_major,
    general_pairs,
    met_twice,
    one_box_per_tensor,
    padded_boxes,
    pair_columns,
    rows_at,
    tag_major,
)
from bcp.io_scheduler.share_owners import choose_owners
from bcp.io_scheduler.share_parts import SharePart, class_parts
from bcp.metadata import itemsize
from bcp.metadata.geometry import (
    Box,
    row_products,
    stable_order,
)
from bcp.numpy_pages import with_ordinary_pages
from bcp.reader import CheckpointReader

SharedKey = tuple[str, Box]


@dataclasses.dataclass(frozen=True)
class Wanted:
    """One rank's wanted boxes, compact: tensor indices (catalog order) and the boxes'
    offsets and lengths, flat, each box ndim values of its tensor."""

    tensors: np.ndarray  # int32 (B,)
    offsets: np.ndarray  # int64, flat
    lengths: np.ndarray  # int64, flat

    @classmethod
    def encode(cls, reader: CheckpointReader, wanted: Sequence[tuple[str, Box]]) -> Wanted:
        index = {fqn: i for i, fqn in enumerate(reader.catalog.tensors)}
        flat_off = [v for _f, (o, _n) in wanted for v in o]
        flat_len = [v for _f, (_o, n) in wanted for v in n]
        return cls(
            np.array([index[f] for f, _b in wanted], np.int32),
            np.array(flat_off, np.int64),
            np.array(flat_len, np.int64),
        )


@dataclasses.dataclass(frozen=True)
class SharePlan:
    """The job-wide plan (coordinator): shared fragments in tag order, each with the
    rank classes needing it (``pair_classes[pair_starts[k]:pair_starts[k + 1]]``,
    ascending), ranks in classes as ``rank_class`` says. Kept per class: the needing
    ranks of every fragment (``needers``, ``starts``) are expanded only when asked."""

    tensors: np.ndarray  # int32 (K,)
    offsets: np.ndarray  # int64 (K, D)
    lengths: np.ndarray  # int64 (K, D)
    owners: np.ndarray  # int32 (K,)
    pair_classes: np.ndarray  # int64, flat
    pair_starts: np.ndarray  # int64 (K + 1,)
    #: ranks with equal classes want the same boxes, so take part in the same fragments
    rank_class: np.ndarray
    #: the tags of the (tag, class) pairs ordered by class, tag order within (what
    #: :meth:`parts` slices per class), where the matching produced them so; else None
    class_tags: np.ndarray | None = None

    @functools.cached_property
    def _needers(self) -> tuple[np.ndarray, np.ndarray]:
        return _RankClasses.of_classes(self.rank_class).expand(self.pair_classes, self.pair_starts)

    @property
    def needers(self) -> np.ndarray:
        """Needing ranks of fragment k (owner included), ascending: needers[starts[k]:starts[k+1]]."""
        return self._needers[0]

    @property
    def starts(self) -> np.ndarray:
        return self._needers[1]

    def parts(self, world: int) -> list[SharePart]:
        """Each rank's part (:mod:`.share_parts`: arrays per class, receivers decoded
        on the rank)."""
        return class_parts(
            world,
            self.tensors,
            self.offsets,
            self.lengths,
            self.owners,
            self.pair_classes,
            self.pair_starts,
            self.rank_class,
            self.class_tags,
        )


def _no_plan(rank_class: np.ndarray) -> SharePlan:
    z, empty = np.zeros(0, np.int64), np.zeros((0, 1), np.int64)
    return SharePlan(z.astype(np.int32), empty, empty, z.astype(np.int32), z, np.zeros(1, np.int64), rank_class)


@gc_paused  # as inside the load that calls it: the caller's heap is not walked mid-plan
@with_ordinary_pages  # its arrays: no huge-page compaction stalls (bcp.numpy_pages)
def plan_shares(reader: CheckpointReader, wanted: Sequence[Wanted], *, cut_index: bool = True) -> SharePlan:
    """(coordinator) The job-wide sharing plan for every rank's wanted boxes: the same
    shared fragments and needing ranks every rank used to compute over every rank's
    list, computed once and vectorised; owners balanced by needer set (module doc).

    Ranks that want exactly the same boxes (data-parallel replicas: HSDP, DDP) are
    planned as one class: the boxes are matched against the stored fragments once per
    class, and the class's ranks are expanded only into the needers of the shared
    fragments. Boxes of tensors stored as disjoint slices along one dimension (FSDP,
    TP) are matched on that dimension alone (:class:`CutIndex`), a batch of classes
    at a time; the rest go through the general overlap test (``cut_index=False``:
    every box does, the reference the tests compare against). Tensors no two ranks want
    an element of are left out first (:mod:`.share_disjoint`; not with ``cut_index=False``)."""
    names = list(reader.catalog.tensors)
    classes = _RankClasses.of(wanted)
    reps = [wanted[r] for r in classes.first]
    per_tensor = np.zeros(len(names), np.int64)
    for w in reps:
        codes = w.tensors
        if len(codes) and (int(codes.min()) < 0 or int(codes.max()) >= len(names)):
            raise ValueError("a wanted box names a tensor the catalog does not hold")
        per_tensor += np.bincount(codes, minlength=len(names))
    width = 1  # the plan's boxes: as wide as the widest tensor wanted (those left out included)
    one_rank_each = bool((classes.sizes == 1).all())  # then the tensors no two ranks meet are left out
    if cut_index and one_rank_each and (pruned := without_disjoint(reps, names, reader.catalog.shape)) is not None:
        reps, width = pruned
        per_tensor = np.bincount(reps[0].tensors, minlength=len(names))  # one list of tensors for every rank
    used = np.flatnonzero(per_tensor).tolist()
    if not used:
        return _no_plan(classes.of_rank)
    used_names = [names[t] for t in used]
    shapes = {t: tuple(reader.catalog.shape(names[t])) for t in used}
    reader.catalog.require([(names[t], ((0,) * len(shapes[t]), shapes[t])) for t in used])
    # offsets and lengths only; the tiling is proven by the cut index for the tensors it holds, the catalog the rest
    entries = reader.catalog.boxes(used_names, check_tiling=not cut_index)
    width = max(width, *(len(s) for s in shapes.values()))
    ndim_of = np.zeros(len(names), np.int64)
    extents = np.ones((len(names), width), np.int64)
    for t in used:
        ndim_of[t] = len(shapes[t])
        extents[t, : len(shapes[t])] = shapes[t]
    # stored rows numbered tensor after tensor (``used`` order): ``used[i]`` holds rows fstart[i]..fstart[i + 1] - 1
    fstart = np.r_[0, np.cumsum([e.num_fragments for e in entries])].astype(np.int64)
    n_frags = int(fstart[-1])
    slot = np.full(len(names), -1, np.int64)
    slot[used] = np.arange(len(used))
    index = CutIndex.build(entries, used, fstart, extents, len(names)) if cut_index else None
    if cut_index:
        proven = index.tiled[used] if index is not None else np.zeros(len(used), bool)
        unproven = [used_names[i] for i in np.flatnonzero(~proven).tolist()]
        if unproven:
            reader.catalog.boxes(unproven)  # FormatError where their rows do not tile them
    # classes of one rank each (one box per tensor): the rows met by several ranks need no
    # class per pair, nor elements where none is (each rank its own rows), so those wait,
    # not even computed, until some row is met twice (then the boxes are matched again)
    uniform = bool((classes.sizes == classes.sizes[0]).all())
    found, left, one_box, full = _match(reps, index, ndim_of, width, columns=not one_rank_each, rows=n_frags)
    if full:
        index = None  # the line's tables: not needed past the matching (the general test takes none)
    # the general test's pairs come with their classes and elements always: computed once
    general = general_pairs(entries, used, slot, fstart, shapes, extents, width, left) if left else None
    del left
    if not full:  # classes of one rank each: nothing shared unless some row is met twice
        met = [f for f, _c, _e in found] + ([general[0]] if general is not None else [])
        if not met_twice(met, n_frags):  # no joined copy of the rows met
            return _no_plan(classes.of_rank)
        # the cut index's pairs again, in the same order, now with their classes and elements
        # (the boxes it leaves to the general test are the same ones: their pairs are kept)
        found = _match(reps, index, ndim_of, width, columns=True)[0]
    index = None
    if general is not None:
        found.append(general)
    # as intp: numpy copies a narrower index array to intp at every gather and count by it
    fi = np.concatenate([f for f, _c, _e in found], dtype=np.intp)
    if not len(fi):
        return _no_plan(classes.of_rank)
    cls, elems = pair_columns(found, uniform)
    del found
    # per fragment: needing ranks, and elements wanted (every rank's boxes counted)
    if one_box:
        uf, uc = fi, cls  # each (fragment, class) pair once already
    else:
        key = np.unique(fi.astype(np.int64) * len(reps) + cls)
        uf, uc = key // len(reps), key % len(reps)
    candidates = _met_by_several(uf, uc, classes.sizes, n_frags)
    if not len(candidates):
        return _no_plan(classes.of_rank)
    # exact below 2**53; classes of one size: no weight per pair
    weights = elems if uniform else elems * classes.sizes[cls]
    wanted_elems: np.ndarray = np.bincount(fi, weights=weights, minlength=n_frags)
    del weights
    if uniform:
        wanted_elems *= float(classes.sizes[0])
    del fi, cls, elems
    item = np.zeros(len(names), np.int64)
    item[used] = [itemsize(e.dtype) for e in entries]
    c_off, c_len = rows_at(entries, fstart, candidates, width)
    del entries  # every stored box gathered: the largest arrays of the plan
    volumes = row_products(c_len)  # each row's elements, its bytes below
    keep_c = wanted_elems[candidates] > volumes
    del wanted_elems
    if keep_c.all():  # usually (replicas want whole rows): no copies
        shared, k_off, k_len = candidates, c_off, c_len
    else:
        shared, k_off, k_len, volumes = candidates[keep_c], c_off[keep_c], c_len[keep_c], volumes[keep_c]
    del c_off, c_len
    if not len(shared):
        return _no_plan(classes.of_rank)
    # tags in catalog order: tensors as the catalog lists them, each tensor's rows in order
    # shared rows ascend, numbered tensor after tensor: each tensor's count, not a search per row
    per_used = np.diff(np.searchsorted(shared, fstart))
    k_tid = np.repeat(np.array(used, np.int32 if len(names) < 1 << 31 else np.int64), per_used)
    tag_of = np.full(n_frags, -1, np.int32 if len(shared) < 1 << 31 else np.int64)
    tag_of[shared] = np.arange(len(shared), dtype=tag_of.dtype)
    pk = tag_of[uf].astype(np.intp)  # as index arrays: numpy copies narrower ones to intp at every gather
    del tag_of
    keep = pk >= 0
    if not keep.all():  # usually all are (data-parallel replicas): no masked copies
        pk, uc = pk[keep], uc[keep]
    class_tags = None
    if one_box:
        if class_major(uc, pk):  # the parts' order: kept, so that parts() need not sort back
            class_tags = pk  # the tags (intp: gathered by and gathering with)
        tags, tag_cls = by_tag(pk, uc, len(shared), len(reps), dtype=np.int64)  # no int64 copies first
    else:
        tags, tag_cls = pk.astype(np.int64), uc.astype(np.int64)
    del keep, uf, uc, pk
    tag_cls, pair_starts, group = classes.labels(tags, tag_cls, len(shared))
    del tags
    sizes = volumes
    del volumes
    if len(set(item[used].tolist())) == 1:  # one item size (the usual): no array of them
        sizes *= int(item[used[0]])
    else:
        sizes *= np.repeat(item[used], per_used)
    owners = choose_owners(
        classes.members, classes.mstarts, tag_cls, pair_starts, sizes, len(wanted), group, class_tags
    )
    return SharePlan(
        k_tid.astype(np.int32, copy=False), k_off, k_len, owners, tag_cls, pair_starts, classes.of_rank, class_tags
    )


def _match(
    reps: Sequence[Wanted],
    index: CutIndex | None,
    ndim_of: np.ndarray,
    width: int,
    *,
    columns: bool,
    rows: int = 0,
) -> tuple[list[tuple[np.ndarray, Any, Any]], list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], bool, bool]:
    """The classes' boxes (``reps``) matched by the cut index, a batch at a time: per
    batch (row, class, shared elements) of every pair met, the boxes left for the
    general test (tensor, offsets, lengths, class), whether no class wants two boxes of
    one tensor, and whether the classes and elements were computed. ``columns=False``:
    None for them, until a stored row (of ``rows``) is met twice by the cut index or a
    class wants two boxes of a tensor (pairs then counted once, by class): every batch is
    then matched again with them, so that they are not matched a third time."""
    one_box = True
    found: list[tuple[np.ndarray, Any, Any]] = []
    left: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    # each row met, marked by the pair's place in its batch: a row met by an earlier batch
    # reads non-zero, one met twice in a batch keeps one mark (the other place reads it)
    mark = None if columns or index is None else np.zeros(rows, np.int32)
    for lo, hi in box_batches([len(w.tensors) for w in reps], BOX_BATCH):
        tids = np.concatenate([reps[c].tensors for c in range(lo, hi)]).astype(np.int64)
        cls = np.repeat(np.arange(lo, hi, dtype=np.int32), [len(reps[c].tensors) for c in range(lo, hi)])
        one_box = one_box and one_box_per_tensor(tids, cls)
        if not (columns or one_box):
            del found, left
            return _match(reps, index, ndim_of, width, columns=True)
        offs = [reps[c].offsets for c in range(lo, hi)]
        b_off, b_len = padded_boxes(tids, ndim_of, offs, [reps[c].lengths for c in range(lo, hi)], width)
        if index is None:
            left.append((tids, b_off, b_len, cls))
            continue
        qi, fi, elems, rest = index.pairs(tids, b_off, b_len, elements=columns)
        if mark is not None and len(fi):
            at = fi.astype(np.intp)  # once: numpy copies int32 indices to intp at each use
            place = np.arange(1, len(fi) + 1, dtype=np.int32)
            again = bool(mark[at].any())
            mark[at] = place
            if again or not bool((mark[at] == place).all()):
                del mark, found, left
                return _match(reps, index, ndim_of, width, columns=True)
        found.append((fi, cls[qi] if columns else None, elems))
        if rest.any():
            left.append((tids[rest], b_off[rest], b_len[rest], cls[rest]))
    return found, left, one_box, columns


def _met_by_several(frags: np.ndarray, classes: np.ndarray, sizes: np.ndarray, n_frags: int) -> np.ndarray:
    """The stored rows (ascending) that more than one rank needs, from the (row, class)
    pairs met (each once; ``classes`` is not read, and may be empty, where every class
    has one size).
    Classes of two ranks or more (data-parallel replicas): every row met, found by a
    table of flags, not a count per row; of one rank each, as many rows flagged as
    pairs shows that none is met twice (each rank reads its own rows) without a count."""
    uniform = bool(len(sizes)) and bool((sizes == sizes[0]).all())
    if uniform:
        met = np.zeros(n_frags, bool)
        met[frags] = True
        if int(sizes[0]) > 1:
            return np.flatnonzero(met)
        if int(np.count_nonzero(met)) == len(frags):
            return np.zeros(0, np.int64)
        del met
    if uniform:
        n_ranks = np.bincount(frags, minlength=n_frags)
        n_ranks *= int(sizes[0])
    else:
        n_ranks = np.bincount(frags, weights=sizes[classes], minlength=n_frags)
    return np.flatnonzero(n_ranks > 1)


@dataclasses.dataclass(frozen=True)
class _RankClasses:
    """Ranks grouped by identical wanted lists (value for value): ``first[c]`` is class
    c's lowest rank, its ranks (ascending) are ``members[mstarts[c]:mstarts[c + 1]]``."""

    first: list[int]
    of_rank: np.ndarray  # int64 (ranks,): each rank's class
    sizes: np.ndarray  # int64 (C,)
    members: np.ndarray  # int64, flat
    mstarts: np.ndarray  # int64 (C + 1,)

    @classmethod
    def of(cls, wanted: Sequence[Wanted]) -> _RankClasses:
        # a cheap fingerprint per list (lengths and XXH3 hashes of the values) finds the
        # candidates; equal lists are then confirmed value for value
        by_print: dict[tuple[int, ...], list[int]] = {}
        lists: list[Wanted] = []
        class_of = np.empty(len(wanted), np.int64)
        for r, w in enumerate(wanted):
            key = (
                len(w.tensors),
                len(w.offsets),
                _fingerprint(w.tensors),
                _fingerprint(w.offsets),
                _fingerprint(w.lengths),
            )
            c = -1
            for known in by_print.get(key, ()):
                x = lists[known]
                if (
                    np.array_equal(x.tensors, w.tensors)
                    and np.array_equal(x.offsets, w.offsets)
                    and np.array_equal(x.lengths, w.lengths)
                ):
                    c = known
                    break
            if c < 0:
                c = len(lists)
                lists.append(w)
                by_print.setdefault(key, []).append(c)
            class_of[r] = c
        members = stable_order(class_of).astype(np.int64)  # ranks by class, ascending within
        sizes = np.bincount(class_of, minlength=len(lists)).astype(np.int64)
        first = members[np.r_[0, np.cumsum(sizes)[:-1]]].tolist() if len(lists) else []
        return cls(first, class_of, sizes, members, np.r_[0, np.cumsum(sizes)].astype(np.int64))

    @classmethod
    def of_classes(cls, class_of: np.ndarray) -> _RankClasses:
        """The classes of a plan, from each rank's class."""
        members = stable_order(class_of).astype(np.int64)
        sizes = np.bincount(class_of, minlength=int(class_of.max()) + 1 if len(class_of) else 0).astype(np.int64)
        starts = np.r_[0, np.cumsum(sizes)].astype(np.int64)
        return cls(members[starts[:-1]].tolist(), class_of, sizes, members, starts)

    def labels(self, tags: np.ndarray, classes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For shared fragments 0..k-1 met by the (tag, class) pairs (each pair once):
        the pairs' classes in order of tag then class, the starts of each fragment's,
        and a label per fragment equal for equal needer sets (its class where one class
        needs it; other labels numbered past the classes). Equal needer sets are equal
        sets of classes: classes partition the ranks."""
        n_classes = len(self.sizes)
        if not tag_major(tags, classes, n_classes):  # usually in order already
            order = np.argsort(tags * n_classes + classes, kind="stable")
            tags, classes = tags[order], classes[order]
        pairs = np.bincount(tags, minlength=k)  # classes needing each fragment
        pair_starts = np.zeros(len(pairs) + 1, np.int64)
        np.cumsum(pairs, out=pair_starts[1:])
        # each fragment's first class where one class needs it, else -1 (one gather, no index arrays)
        group = classes.take(pair_starts[:-1], mode="clip") if len(classes) else np.zeros(k, np.int64)
        group = group.astype(np.int64, copy=False)
        group[pairs != 1] = -1
        several = np.flatnonzero(pairs > 1)
        if len(several):
            mine = classes[np.repeat(pairs > 1, pairs)]
            if (pairs[several] == 2).all():  # two classes each (a chunk boundary): one exact key per pair
                label = _dense_inverse(mine[0::2] * n_classes + mine[1::2], n_classes * n_classes)
            else:
                label = _needer_groups(mine, np.concatenate(([0], np.cumsum(pairs[several]))))
            group[several] = n_classes + label.reshape(-1)
        return classes.astype(np.int64, copy=False), pair_starts, group

    def ranks_of(self, classes: np.ndarray) -> np.ndarray:
        """The ranks of ``classes`` (a few), ascending."""
        if len(classes) == 1:
            c = int(classes[0])
            return self.members[self.mstarts[c] : self.mstarts[c + 1]]
        return np.sort(np.concatenate([self.members[self.mstarts[c] : self.mstarts[c + 1]] for c in classes.tolist()]))

    def expand(self, classes: np.ndarray, pair_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every fragment's needing ranks, ascending, as flat values and starts, from
        its classes ``classes[pair_starts[k]:pair_starts[k + 1]]`` (ascending)."""
        k = len(pair_starts) - 1
        pairs = np.diff(pair_starts)
        if not len(self.sizes):
            return np.zeros(0, np.int64), np.zeros(k + 1, np.int64)
        s = int(self.sizes[0])
        if (self.sizes == s).all():  # every class of s ranks: rows of a table
            counts = pairs * s
            needers = np.take(self.members.reshape(-1, s), classes, axis=0).reshape(-1)
        else:
            n = self.sizes[classes]
            counts = np.bincount(np.repeat(np.arange(k), pairs), weights=n, minlength=k).astype(np.int64)
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            needers = self.members[np.repeat(self.mstarts[classes], n) + within]
        starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        if (pairs > 1).any():
            # ranks ascending within a fragment unless two of its classes' rank ranges interleave
            lowest, highest = self.members[self.mstarts[:-1]], self.members[self.mstarts[1:] - 1]
            same = np.ones(len(classes), bool)
            same[pair_starts[:-1][pairs > 0]] = False  # each fragment's first pair follows another fragment's
            if (highest[classes[:-1]][same[1:]] > lowest[classes[1:]][same[1:]]).any():
                needers = needers[np.lexsort((needers, np.repeat(np.arange(k), counts)))]
        return needers, starts


def _dense_inverse(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.unique(keys, return_inverse=True)[1]`` of keys in [0, bound): by a table of
    the keys seen where the bound is small beside their number (no sort of millions)."""
    if bound > 8 * len(keys) + (1 << 22):
        return np.unique(keys, return_inverse=True)[1]
    seen = np.zeros(bound, bool)
    seen[keys] = True
    rank: np.ndarray = np.cumsum(seen, dtype=np.int32 if bound < 1 << 31 else np.int64)
    return rank[keys].astype(np.int64) - 1


def _fingerprint(a: np.ndarray) -> int:
    """XXH3 (64 bits) of ``a``'s values as contiguous int64: equal arrays give equal
    values, different ones rarely do (a few microseconds for a rank's list, no copy
    where it is int64 already)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(a, np.int64))  # type: ignore[arg-type]  # a buffer


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of ``x + salt`` (uint64, wrapping)."""
    z = x.astype(np.uint64) + np.uint64(salt)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _needer_groups(needers: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per fragment, the id of its needer set: fragments with the same needing ranks get
    the same id, ids numbered by first fragment (in tag order). Sets are hashed (a
    64-bit sum) and then checked against their group's first member, exactly."""
    k = len(starts) - 1
    counts = np.diff(starts)
    if not k:
        return np.zeros(0, np.int64)
    with np.errstate(over="ignore"):
        h = np.add.reduceat(_mix(needers, 0x9E3779B97F4A7C15), starts[:-1]) + _mix(counts, 0x632BE59BD9B4E019)
    order = np.argsort(h, kind="stable")
    hs = h[order]
    new = np.r_[True, hs[1:] != hs[:-1]]
    head = order[np.flatnonzero(new)]  # each group's first fragment (lowest tag)
    rep = np.empty(k, np.int64)
    rep[order] = np.repeat(head, np.diff(np.r_[np.flatnonzero(new), k]))
    same = bool((counts == counts[rep]).all())
    if same:
        pos = np.arange(len(needers)) - np.repeat(starts[:-1], counts)
        same = bool((needers == needers[np.repeat(starts[rep], counts) + pos]).all())
    if not same:  # a hash collision: fall back to exact tuples
        ids: dict[tuple[int, ...], int] = {}
        lst, st = needers.tolist(), starts.tolist()
        return np.array([ids.setdefault(tuple(lst[st[i] : st[i + 1]]), len(ids)) for i in range(k)], np.int64)
    # number groups by their first fragment
    first = np.unique(rep)  # ascending tags: group order
    return np.searchsorted(first, rep)


def fetch_shared(
    reader: CheckpointReader, coord: GroupCoordinator, wanted: list[tuple[str, Box]]
) -> tuple[dict[SharedKey, torch.Tensor], ReadStats]:
    """(all ranks) Read the shared fragments this rank owns, exchange them, and return
    every shared fragment this rank needs, as tensors shaped like their boxes."""
    dist = coord.dist
    gathered = coord.gather(Wanted.encode(reader, wanted))
    parts: list | None = None
    if coord.is_coordinator:
        assert gathered is not None
        try:
            parts = [("ok", p) for p in plan_shares(reader, gathered).parts(coord.world_size)]
        except Exception as e:  # noqa: BLE001 - every rank raises it (after the scatter)
            parts = [("error", portable(e))] * coord.world_size
    tag_kind, part = coord.scatter(parts)
    if tag_kind == "error":
        error = part.restore()
        if not coord.is_coordinator:
            error.add_note("raised on the coordinator while planning shared reads")
        raise error
    names = list(reader.catalog.tensors)
    problem: CheckpointError | None = None
    try:  # a part is checked before any rank sends or receives: agreed, so none waits on a rank that refused
        if tag_kind != "ok" or not isinstance(part, SharePart):
            raise CheckpointError(
                f"share_reads plan part for rank {coord.rank}: {type(part).__name__}, not a SharePart"
            )
        part.check(rank=coord.rank, world=coord.world_size, ndims=[len(reader.catalog.shape(f)) for f in names])
    except CheckpointError as e:
        problem = e
    coord.check(problem, "checking the share_reads plan")
    ndims = {t: len(reader.catalog.shape(names[t])) for t in set(part.tensors.tolist())}
    keys = part.keys(names, ndims)
    stats = ReadStats()
    held: dict[SharedKey, torch.Tensor] = {}
    owners = part.owners.tolist()
    for key, owner in zip(keys, owners, strict=True):
        if owner == coord.rank:
            fqn, box = key
            held[key] = reader.empty(fqn, box)  # after checking the files holding it
            stats.add(reader.fill([(fqn, box, held[key])]))
    received = 0
    with trace.span("exchange") as exchanging:  # bytes: those received from the other ranks
        works = []
        ranks = dist.get_process_group_ranks(coord.group)
        for i, (tag, key, owner) in enumerate(zip(part.tags.tolist(), keys, owners, strict=True)):
            if owner == coord.rank:
                wire = held[key].reshape(-1).view(torch.uint8) if held[key].numel() else None
                if wire is not None:
                    works += [
                        dist.isend(wire, dst=ranks[r], group=coord.group, tag=tag)
                        for r in part.receivers_of(i).tolist()
                    ]
            else:
                fqn, box = key
                held[key] = reader.empty(fqn, box)  # bounded like the owner's: by the bytes stored
                if held[key].numel():
                    received += held[key].numel() * held[key].element_size()
                    works.append(
                        dist.irecv(
                            held[key].reshape(-1).view(torch.uint8), src=ranks[owner], group=coord.group, tag=tag
                        )
                    )
        for work in works:
            work.wait()
        if exchanging is not None:
            exchanging.nbytes = received
    return held, stats
