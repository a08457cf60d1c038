"""Many TensorEntry objects at once, from a catalog's flat rows.

Building entries one tensor at a time costs a gather per column and a tiling check
per tensor (about 0.4 ms each at 1,024 rows per tensor); a loading rank under FSDP,
and the coordinator planning shared reads, need every tensor. Here the rows of all
requested tensors of one rank (number of dimensions) are gathered in one pass, each
entry's columns are views of those arrays, and the usual layouts are checked for
exact tiling in one vectorised pass: every row spans the whole tensor except along
one dimension, where the rows (in catalog order) abut from 0 to the end. Tensors that
do not match that pattern get the general check (:func:`tiling_problem`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .rows import Rows, TensorEntry


def gather_entries(
    rows: Rows,
    row_ids: Sequence[np.ndarray],
    ndim: int,
    codes: Sequence[int],
    make: Callable[[int, tuple[np.ndarray, ...]], TensorEntry],
) -> tuple[list[TensorEntry], np.ndarray, np.ndarray]:
    """The entries of tensors ``codes`` whose rows are ``row_ids[i]`` (all of ``ndim``
    dimensions), ``make(code, columns)`` building each entry from its columns (offsets,
    lengths, byte offsets, sizes, files, writers, checksum starts and values, as
    :meth:`Rows.take` returns them); the columns are views of one gather, whose
    offsets and lengths ((rows, ndim), tensor after tensor) come back too."""
    counts = np.array([len(r) for r in row_ids], np.int64)
    every = np.concatenate(row_ids) if len(row_ids) else np.zeros(0, np.int64)
    offs, lens, byte_offsets, sizes, files, writers, sum_starts, sums = rows.take(every, ndim)
    bounds = np.r_[0, np.cumsum(counts)].tolist()
    sum_bounds = sum_starts[bounds].tolist()
    out = []
    for i in range(len(row_ids)):
        a, b = bounds[i], bounds[i + 1]
        s0, s1 = sum_bounds[i], sum_bounds[i + 1]
        columns = (
            offs[a:b],
            lens[a:b],
            byte_offsets[a:b],
            sizes[a:b],
            files[a:b],
            writers[a:b],
            sum_starts[a : b + 1] - s0,
            sums[s0:s1],
        )
        out.append(make(codes[i], columns))
    return out, offs, lens


def simple_tilings(
    shapes: Sequence[tuple[int, ...]], off: np.ndarray, length: np.ndarray, counts: Sequence[int]
) -> np.ndarray:
    """Per tensor (all of one number of dimensions, at least 1; its ``counts[i]`` rows
    of ``off`` and ``length``, (rows, ndim), follow the previous tensor's): True where its rows
    certainly tile its shape exactly: empty rows aside, every row is whole on all
    dimensions but at most one, along which the rows, in order, abut from 0 to the
    end (or every row is the whole tensor, replicas counting once). False means "not
    shown here", not "wrong": the caller runs the general check on those."""
    n = len(shapes)
    ok = np.zeros(n, bool)
    if not n or not len(shapes[0]) or not len(off):
        return ok
    ndim = len(shapes[0])
    cnt = np.asarray(counts, np.int64)
    held = np.flatnonzero(cnt)
    live = np.ones(len(length), bool)
    for d in range(ndim):  # column by column: reductions along a short last axis are slow
        live &= length[:, d] > 0
    shape = np.array([shapes[i] for i in held.tolist()], np.int64).reshape(-1, ndim)
    seg = np.r_[0, np.cumsum(cnt[held])[:-1]]
    # empty rows hold nothing: they cut no dimension and are left out of the chain below
    partial = ((off != 0) | (length != np.repeat(shape, cnt[held], axis=0))) & live[:, None]
    cut = np.logical_or.reduceat(partial, seg, axis=0)  # (T, ndim): dimensions some row cuts
    n_cut = cut.sum(axis=1)
    k = cut.argmax(axis=1)  # the cut dimension (where there is one)
    if (k == k[0]).all():  # the usual case: one cut dimension for every tensor
        start, end = off[:, k[0]], off[:, k[0]] + length[:, k[0]]
    else:
        k_rows = np.repeat(k, cnt[held])
        at = np.arange(len(off))
        start = off[at, k_rows]
        end = start + length[at, k_rows]
    tensor = np.repeat(np.arange(len(held)), cnt[held])
    if not live.all():
        start, end, tensor = start[live], end[live], tensor[live]
    live_cnt = np.bincount(tensor, minlength=len(held))
    some = np.flatnonzero(live_cnt)  # tensors with a row that holds something
    if not len(some):
        return ok
    seg = np.r_[0, np.cumsum(live_cnt[some])[:-1]]
    last = np.r_[seg[1:], len(start)] - 1
    abut = np.ones(len(start), bool)  # row i ends where row i + 1 starts, within a tensor
    if len(start) > 1:
        abut[:-1] = end[:-1] == start[1:]
    abut[last] = True
    chain = np.logical_and.reduceat(abut, seg)
    span = (start[seg] == 0) & (end[last] == shape[some, k[some]])
    ok[held[some]] = (n_cut[some] == 0) | ((n_cut[some] == 1) & chain & span)
    return ok
