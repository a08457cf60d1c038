"""share_reads (coordinator): the tensors no two ranks want an element of, left out of
the plan before any stored row is looked at.

A stored fragment is shared only where the ranks needing it want more of it, together,
than it holds: some element is wanted twice. Where every rank wants different boxes
of a tensor and those boxes are pairwise disjoint (FSDP's row shards loaded at any
world size, TP's column shards), no element of it is wanted twice, whatever the stored
layout: the tensor cannot hold a shared fragment, and its stored rows (millions at
thousands of ranks) need not be gathered, indexed or matched. Disjointness is shown
cheaply, without a sort: along one dimension, in rank order, each rank's box starts at
or after the end of the previous rank's, as sharding by rank lays them out. Tensors not
shown disjoint (replicated ones, 0-d step counters, 2-D meshes) stay in the plan, which
decides for them exactly as before; nothing else changes but the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

W = TypeVar("W")

#: ranks compared at a time (their boxes stacked: about 8 MB at 2,000 2-D tensors)
RANK_BATCH = 256


def without_disjoint(
    lists: Sequence[W], names: Sequence[str], shape: Callable[[str], Sequence[int]]
) -> tuple[list[W], int] | None:
    """``lists`` (each rank's wanted boxes, one rank a list, in rank order: dataclasses
    with ``tensors`` (indices into ``names``, checked), flat ``offsets`` and ``lengths``,
    as ``bcp.shared_read.Wanted``) without the tensors whose boxes are shown pairwise
    disjoint across the ranks (:func:`disjoint_boxes`), and the most dimensions of a
    tensor they wanted; None where none is shown (or the lists name different tensors)."""
    if len(lists) < 2:
        return None
    ranks: Any = lists
    first = ranks[0].tensors
    if len(np.unique(first)) != len(first):
        return None  # a rank wanting two boxes of a tensor: planned as they are
    nd = np.array([len(shape(names[t])) for t in first.tolist()], np.int64)
    disjoint = disjoint_boxes([w.tensors for w in ranks], [w.offsets for w in ranks], [w.lengths for w in ranks], nd)
    if disjoint is None or not disjoint.any():
        return None
    keep = ~disjoint
    flat = np.repeat(keep, nd)
    out = [
        dataclasses.replace(w, tensors=w.tensors[keep], offsets=w.offsets[flat], lengths=w.lengths[flat]) for w in ranks
    ]
    return out, max(1, int(nd.max(initial=0)))


def disjoint_boxes(
    tensors: Sequence[np.ndarray], offsets: Sequence[np.ndarray], lengths: Sequence[np.ndarray], nd: np.ndarray
) -> np.ndarray | None:
    """For ranks wanting one box of each tensor of one list (``tensors[r]`` the same for
    every rank, box i of ``nd[i]`` values in the flat ``offsets[r]``, ``lengths[r]``):
    per box of the list, whether the ranks' boxes of its tensor are shown pairwise
    disjoint (along one of its dimensions, in rank order, each starts at or after the
    end of the one before). 0-d boxes never are. None where the lists differ (or a
    length is negative)."""
    first = tensors[0]
    width = int(nd.sum())
    for t, o, n in zip(tensors, offsets, lengths, strict=True):
        if len(o) != width or len(n) != width or not np.array_equal(t, first):
            return None
    ascending = np.ones(width, bool)  # per flat value: that dimension ascends so far
    end = np.full(width, np.iinfo(np.int64).min, np.int64)
    for lo in range(0, len(offsets), RANK_BATCH):
        starts, ends = np.stack(offsets[lo : lo + RANK_BATCH]), np.stack(lengths[lo : lo + RANK_BATCH])
        if width and int(ends.min()) < 0:
            return None
        ends += starts
        ascending &= starts[0] >= end
        ascending &= (starts[1:] >= ends[:-1]).all(axis=0)
        end = ends[-1]
    out = np.zeros(len(nd), bool)
    boxes = np.flatnonzero(nd > 0)
    if len(boxes):  # each box: any of its dimensions (consecutive flat values) ascending
        at = (np.cumsum(nd) - nd)[boxes]
        out[boxes] = np.logical_or.reduceat(ascending, at)
    return out
