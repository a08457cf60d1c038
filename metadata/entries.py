"""Many TensorEntry objects at once, from a catalog's flat rows.

Building entries one tensor at a time costs a gather per column and a tiling check
per tensor (about 0.4 ms each at 1,024 rows per tensor); a loading rank under FSDP,
and the coordinator planning shared reads, need every tensor. Here the rows of all
requested tensors of one rank (number of dimensions) are gathered in one pass, each
entry's columns are views of those arrays, and the usual layouts are checked for
exact tiling in one vectorised pass: every row spans the whole tensor except along
one dimension, where the rows (in catalog order) abut from 0 to the end. Tensors that
do not match that pattern get the general check (:func:`tiling_problem`). Both checks
live in :mod:`bcp.metadata.geometry`."""

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


__all__ = ["gather_entries"]
