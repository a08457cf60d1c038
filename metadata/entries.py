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

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from bcp.metadata.format_errors import FormatError
from bcp.metadata.geometry import simple_tilings, tiling_problem
from bcp.metadata.rows import Rows, TensorBoxes, TensorEntry

if TYPE_CHECKING:
    from bcp.metadata.catalog.tensors import TensorTable


def gather_entries(
    rows: Rows,
    row_ids: Sequence[np.ndarray],
    ndim: int,
    codes: Sequence[int],
    make: Callable[[int, tuple[np.ndarray | None, ...]], TensorEntry],
) -> tuple[list[TensorEntry], np.ndarray, np.ndarray]:
    """The entries of tensors ``codes`` whose rows are ``row_ids[i]`` (all of ``ndim``
    dimensions), ``make(code, columns)`` building each entry from its columns (offsets,
    lengths, byte offsets, sizes, files, writers, checksum starts and values, as
    :meth:`Rows.take` returns them, then the digests or None, as
    :meth:`Rows.take_digests`); the columns are read-only views of one gather
    (``make`` need not freeze them), whose offsets and lengths ((rows, ndim), tensor
    after tensor) come back too."""
    counts = np.array([len(r) for r in row_ids], np.int64)
    every = np.concatenate(row_ids) if len(row_ids) else np.zeros(0, np.int64)
    offs, lens, byte_offsets, sizes, files, writers, sum_starts, sums = rows.take(every, ndim)
    digests = rows.take_digests(every)
    if digests is not None:
        digests.setflags(write=False)
    bound_arr = np.r_[0, np.cumsum(counts)]
    # each entry's checksum starts (its rows' and one past, from 0) for every entry at
    # once: one array, each entry's a view of it (not one subtraction per tensor)
    spans = counts + 1
    rel_at = np.r_[0, np.cumsum(spans)]
    pick = np.arange(int(rel_at[-1]), dtype=np.int64) + np.repeat(bound_arr[:-1] - rel_at[:-1], spans)
    rel = sum_starts[pick] - np.repeat(sum_starts[bound_arr[:-1]], spans)
    # read-only once here: every entry's columns are views of these, read-only with them
    for column in (offs, lens, byte_offsets, sizes, files, writers, rel, sums):
        column.setflags(write=False)
    bounds, rel_bounds = bound_arr.tolist(), rel_at.tolist()
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
            rel[rel_bounds[i] : rel_bounds[i + 1]],
            sums[s0:s1],
            None if digests is None else digests[a:b],
        )
        out.append(make(codes[i], columns))
    return out, offs, lens


def check_tilings(
    tensors: TensorTable,
    codes: Sequence[int],
    offs: np.ndarray,
    lens: np.ndarray,
    counts: Sequence[int],
    complete: Callable[[int], bool],
    where: str,
) -> None:
    """FormatError unless the rows of tensors ``codes`` (all of one number of
    dimensions; ``counts[i]`` rows each, tensor after tensor in ``offs``/``lens``) tile
    their shapes exactly; tensors not ``complete`` (not every row held) are skipped.
    The usual layouts in one vectorised pass, the rest one by one."""
    if not codes:
        return
    if not len(tensors.shapes[codes[0]]):  # 0-d: its one element in a row (or replicas of it)
        for i in np.flatnonzero(np.asarray(counts) == 0).tolist():
            if complete(codes[i]):
                raise FormatError(f"{where}: tensor {tensors.names[codes[i]]!r}: no row holds its one element")
        return
    simple = simple_tilings([tensors.shapes[t] for t in codes], offs, lens, counts)
    bounds = np.r_[0, np.cumsum(counts)].tolist()
    for i in np.flatnonzero(~simple).tolist():
        t = codes[i]
        if complete(t):
            problem = tiling_problem(
                tensors.shapes[t], offs[bounds[i] : bounds[i + 1]], lens[bounds[i] : bounds[i + 1]]
            )
            if problem is not None:
                raise FormatError(f"{where}: tensor {tensors.names[t]!r}: {problem}")


def gather_boxes(
    rows: Rows,
    tensors: TensorTable,
    row_ids: Mapping[int, np.ndarray],
    check: Callable[[list[int], np.ndarray, np.ndarray, list[int]], None],
) -> dict[int, TensorBoxes]:
    """Tensor code -> its TensorBoxes, for the tensors of ``row_ids`` (code -> its
    rows): one gather of offsets and lengths per number of dimensions, each group
    passed to ``check(codes, offsets, lengths, counts)`` (the tiling check) first; the
    boxes are views of the gather."""
    by_ndim: dict[int, list[int]] = {}
    for t in row_ids:
        by_ndim.setdefault(len(tensors.shapes[t]), []).append(t)
    out: dict[int, TensorBoxes] = {}
    for ndim, codes in by_ndim.items():
        counts = [len(row_ids[t]) for t in codes]
        offs, lens = rows.take_boxes(_joined([row_ids[t] for t in codes]), ndim)
        check(codes, offs, lens, counts)
        out.update(_views(tensors, codes, offs, lens, counts))
    return out


def _joined(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``np.concatenate(parts)``, or the one view of their base they are where they are
    consecutive slices of it (the catalog's row order, every tensor used): at millions
    of rows the copy is a first touch of as much new memory."""
    held = [p for p in parts if len(p)]
    base = held[0].base if held else None
    if isinstance(base, np.ndarray) and base.ndim == 1 and base.flags.c_contiguous:
        at = lo = (held[0].__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize
        for p in held:
            if p.base is not base or p.ndim != 1 or p.strides != base.strides or p.dtype != base.dtype:
                break
            if (p.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize != at:
                break
            at += len(p)
        else:
            return base[lo:at]
    return np.concatenate(parts)


def _views(
    tensors: TensorTable, codes: Sequence[int], offs: np.ndarray, lens: np.ndarray, counts: Sequence[int]
) -> dict[int, TensorBoxes]:
    bounds = np.r_[0, np.cumsum(counts)].tolist()
    return {
        t: TensorBoxes(
            tensors.names[t],
            tensors.dtypes[t],
            tensors.shapes[t],
            offs[bounds[i] : bounds[i + 1]],
            lens[bounds[i] : bounds[i + 1]],
        )
        for i, t in enumerate(codes)
    }


__all__ = ["check_tilings", "gather_boxes", "gather_entries"]
