"""Flat spans: the integer test that decides which v2 catalog sections a box may need.

Row-major, the elements of a box lie between the flat indices of its first and last
corners, so two boxes that share an element have meeting flat spans. The writer
stores each (section, tensor)'s hull of spans in the head (:mod:`.sections`); a
reader compares its boxes' spans with them (:mod:`.partial`). Also the stable
ordering by tensor that every part of the catalog uses for its rows.
"""

from __future__ import annotations

import numpy as np

from bcp.metadata.catalog.tensors import TensorTable
from bcp.metadata.geometry import stable_order
from bcp.metadata.rows import Rows

#: (first, last) of a (section, tensor) whose fragments there are all empty
EMPTY_SPAN = (0, -1)


def flat_spans(
    tensor: np.ndarray, coord_starts: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, tensors: TensorTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each box (rows of flat ``offsets``/``lengths`` with ``coord_starts``, box i a
    box of tensor ``tensor[i]``): (first flat index, last flat index, non-empty). The
    flat span of a box contains every element of it, so two boxes that share an
    element have meeting spans. Boxes must lie inside their tensors (validated rows);
    a box with another number of dimensions than its tensor counts as empty (only a
    writer given such rows meets one: readers refuse them before)."""
    n = len(tensor)
    stride, t_starts = tensors.arrays.strides, tensors.arrays.starts
    counts = np.diff(coord_starts)
    fits = counts == tensors.arrays.ndim[tensor]
    if not fits.all():
        keep = np.repeat(fits, counts)
        first, last, live = flat_spans(
            tensor[fits],
            np.concatenate([[0], np.cumsum(counts[fits])]),
            offsets[coord_starts[0] : coord_starts[-1]][keep],
            lengths[coord_starts[0] : coord_starts[-1]][keep],
            tensors,
        )
        out = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
        out[0][fits], out[1][fits], out[2][fits] = first, last, live
        return out
    base = coord_starts[0]
    d = uniform_width(coord_starts)
    if d is not None:  # every box has d dimensions: matrices, row sums
        return _flat_spans_uniform(tensor, offsets[base : base + n * d], lengths[base : base + n * d], d, tensors)
    step = np.arange(int(coord_starts[-1]) - int(coord_starts[0]), dtype=np.int64) - np.repeat(
        coord_starts[:-1] - coord_starts[0], counts
    )
    row_of = np.repeat(np.arange(n), counts)
    s = stride[t_starts[tensor[row_of]] + step]
    o = offsets[base : base + len(step)]
    ln = lengths[base : base + len(step)]
    first = np.zeros(n, dtype=np.int64)
    last = np.zeros(n, dtype=np.int64)
    np.add.at(first, row_of, o * s)
    np.add.at(last, row_of, (o + ln - 1) * s)
    live = np.ones(n, dtype=bool)
    live[row_of[ln <= 0]] = False
    return first, last, live


def _flat_spans_uniform(
    tensor: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, d: int, tensors: TensorTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`flat_spans` of n boxes of d dimensions each (boxes of their tensors' rank):
    the same integer sums, one dimension at a time instead of scattered adds."""
    n = len(tensor)
    first, last, live = np.zeros(n, np.int64), np.zeros(n, np.int64), np.ones(n, dtype=bool)
    base = tensors.arrays.starts[tensor]
    for k in range(d):
        s = tensors.arrays.strides[base + k]
        o, ln = offsets[k::d], lengths[k::d]
        first += o * s
        last += (o + ln - 1) * s
        live &= ln > 0
    return first, last, live


def section_spans(rows: Rows, tensors: TensorTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tensor, first, last) for every tensor with rows in ``rows``, ascending by tensor:
    the hull of its non-empty fragments' flat spans, EMPTY_SPAN when all are empty."""
    first, last, live = flat_spans(rows.tensor, rows.coord_starts, rows.offsets, rows.lengths, tensors)
    order = stable_order(rows.tensor)
    t = rows.tensor[order]
    if not len(t):
        z = np.zeros(0, np.int64)
        return z, z, z
    starts = np.flatnonzero(np.concatenate([[True], t[1:] != t[:-1]]))
    big = np.iinfo(np.int64).max
    lo = np.minimum.reduceat(np.where(live[order], first[order], big), starts)
    hi = np.maximum.reduceat(np.where(live[order], last[order], -1), starts)
    empty = hi < 0
    lo[empty], hi[empty] = EMPTY_SPAN
    return t[starts].astype(np.int64), lo, hi


def uniform_width(starts: np.ndarray) -> int | None:
    """d when every row of a starts array holds d values, else None (then the rows'
    values form an n x d matrix: the fast paths here and in :mod:`.sections`)."""
    n = len(starts) - 1
    total = int(starts[-1] - starts[0]) if n >= 0 else 0
    if n <= 0 or total % n:
        return None
    d = total // n
    return d if bool((np.diff(starts) == d).all()) else None
