"""Which tensors a catalog stores as one row holding the whole tensor, found in a few numpy
passes over its rows (:meth:`bcp.metadata.catalog.Catalog.whole_rows`): a load of 10,000
small tensors reads them without an object per tensor; and which row is exactly a wanted box
(:func:`find_exact_rows`: shards loaded at the layout they were saved with)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from bcp.metadata.catalog.tensors import TensorTable
from bcp.metadata.rows import Rows


@dataclasses.dataclass(frozen=True)
class WholeRows:
    """:meth:`Catalog.whole_rows`: for each asked name, as lists (one item per name)."""

    #: the tensor's one stored row when that row holds the whole tensor (and every row
    #: of the tensor is held); -1 otherwise (a name not stored, several rows, a part)
    rows: list[int]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    #: the row's data file, a code into ``file_names``; its first byte there; its bytes
    files: list[int]
    byte_offsets: list[int]
    nbytes: list[int]
    #: where the row's block checksums start and stop in ``sums``
    sum_starts: list[int]
    sum_stops: list[int]
    #: the catalog's flat block checksum column (uint32, read-only)
    sums: np.ndarray
    file_names: tuple[str, ...]
    #: ``rows``, ``nbytes`` and each row's count of block checksums as int64 arrays, for
    #: checks over every name at once
    row_array: np.ndarray
    nbytes_array: np.ndarray
    blocks_array: np.ndarray


def find_whole_rows(
    fqns: Sequence[str],
    tensors: TensorTable,
    rows: Rows,
    starts: np.ndarray,
    order: np.ndarray,
    *,
    usable: bool,
    complete: Callable[[int], bool] | None,
    file_names: tuple[str, ...],
) -> WholeRows:
    """:class:`WholeRows` of ``fqns`` (``starts``/``order``: each tensor's rows in the
    catalog's order; ``usable`` False answers -1 for every name; ``complete``: whether
    every row of a tensor is held, None when the catalog is whole)."""
    n = len(fqns)
    index = tensors.index
    codes = np.fromiter(map(index.get, fqns, itertools.repeat(-1, n)), np.int64, n)  # no generator step a name
    code = np.maximum(codes, 0)
    ok = codes >= 0
    if not usable or not len(rows) or not len(tensors):
        ok[:] = False
    if ok.any():
        lo = starts[code]
        ok &= starts[code + 1] - lo == 1
        row = order[np.minimum(lo, len(order) - 1)].astype(np.int64)
        arrays = tensors.arrays
        nd = arrays.ndim[code]
        cs = rows.coord_starts
        ok &= cs[row + 1] - cs[row] == nd
        # every offset 0 and every length the shape's: one pass over all coordinates
        width = np.where(ok, nd, 0)
        seg = np.repeat(np.arange(n), width)
        pos = np.arange(len(seg)) - np.repeat(np.cumsum(width) - width, width)
        at, dim = cs[row][seg] + pos, arrays.starts[code][seg] + pos
        bad = (rows.offsets[at] != 0) | (rows.lengths[at] != arrays.shape[dim])
        ok &= np.bincount(seg[bad], minlength=n) == 0
        if complete is not None:
            ok &= np.fromiter((complete(int(t)) for t in code), bool, n)
    else:
        row = np.zeros(n, np.int64)
    return _answer(np.where(ok, row, -1), code, tensors, rows, file_names)


def _answer(
    row: np.ndarray, code: np.ndarray, tensors: TensorTable, rows: Rows, file_names: tuple[str, ...]
) -> WholeRows:
    """:class:`WholeRows` of the rows ``row`` (-1: none) of tensors ``code``."""
    n = len(row)
    r = np.maximum(row, 0)
    names = tensors.names
    shapes, dtypes = tensors.shapes, tensors.dtypes
    code_list = code.tolist()
    zeros = np.zeros(n, np.int64)
    nbytes = rows.nbytes[r].astype(np.int64) if len(rows) else zeros
    sum_starts = rows.sum_starts[r].astype(np.int64) if len(rows) else zeros
    sum_stops = rows.sum_starts[r + 1].astype(np.int64) if len(rows) else zeros
    return WholeRows(
        rows=row.tolist(),
        shapes=[shapes[t] for t in code_list] if len(names) else [()] * n,
        dtypes=[dtypes[t] for t in code_list] if len(names) else [""] * n,
        files=rows.file[r].tolist() if len(rows) else [0] * n,
        byte_offsets=rows.byte_offset[r].tolist() if len(rows) else [0] * n,
        nbytes=nbytes.tolist(),
        sum_starts=sum_starts.tolist(),
        sum_stops=sum_stops.tolist(),
        sums=rows.sums,
        file_names=file_names,
        row_array=row.astype(np.int64),
        nbytes_array=nbytes,
        blocks_array=sum_stops - sum_starts,
    )


#: a tensor stored in more rows than this is left to the planner: each of its rows is
#: compared with the box here, where the planner's index finds the few that meet it
MAX_ROWS = 64


def _ranges(lo: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(which range, position) of every item of the ranges ``lo[i] .. lo[i] + count[i]``."""
    seg = np.repeat(np.arange(len(lo)), count)
    return seg, lo[seg] + np.arange(len(seg)) - np.repeat(np.cumsum(count) - count, count)


def find_exact_rows(
    fqns: Sequence[str],
    tensors: TensorTable,
    rows: Rows,
    starts: np.ndarray,
    order: np.ndarray,
    boxes: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    usable: bool,
    file_names: tuple[str, ...],
    check: Callable[[list[int], np.ndarray, np.ndarray, list[int]], None],
) -> WholeRows:
    """:class:`WholeRows` of each (``fqns[i]``, ``boxes[i]``): the one held row whose box is
    exactly ``boxes[i]`` when no other held row of the tensor meets that box (so the
    planner would read that row alone), the tensor held in at most :data:`MAX_ROWS` rows;
    -1 otherwise. A sharded load at the layout it was saved with (FSDP, DTensor or
    explicit shards on as many ranks) reads its boxes so, in a few numpy passes, no
    entry built. The rows of every tensor answered are checked to tile it (``check``,
    as building its entry would: FormatError); a catalog read in part holds every row
    meeting the boxes asked (``require``), tensors not held whole are not checked."""
    n = len(fqns)
    index = tensors.index
    codes = np.fromiter(map(index.get, fqns, itertools.repeat(-1, n)), np.int64, n)
    code = np.maximum(codes, 0)
    ok = codes >= 0
    match = np.full(n, -1, np.int64)
    if not usable or not len(rows) or not len(tensors) or not ok.any():
        return _answer(match, code, tensors, rows, file_names)
    nd = tensors.arrays.ndim[code].astype(np.int64)
    ndims = np.fromiter((len(off) for off, _len in boxes), np.int64, n)
    lo = starts[code]
    count = starts[code + 1] - lo
    ok &= (nd == ndims) & (count >= 1) & (count <= MAX_ROWS)
    flat = itertools.chain.from_iterable
    b_off = np.fromiter(flat(off for off, _len in boxes), np.int64, int(ndims.sum()))
    b_len = np.fromiter(flat(length for _off, length in boxes), np.int64, len(b_off))
    b_start = np.cumsum(ndims) - ndims
    seg, at = _ranges(lo, np.where(ok, count, 0))  # every row of every tensor asked
    cand = order[at].astype(np.int64)
    cs = rows.coord_starts
    width = nd[seg]
    bad = cs[cand + 1] - cs[cand] != width
    ok &= np.bincount(seg[bad], minlength=n) == 0
    width[bad] = 0
    c_idx, r_at = _ranges(cs[cand], width)  # every coordinate of those rows, with the box's
    b_at = b_start[seg][c_idx] + r_at - cs[cand][c_idx]
    ro, rl, bo, bl = rows.offsets[r_at], rows.lengths[r_at], b_off[b_at], b_len[b_at]
    m = len(cand)
    equal = np.bincount(c_idx[(ro != bo) | (rl != bl)], minlength=m) == 0
    meets = np.bincount(c_idx[(ro >= bo + bl) | (bo >= ro + rl)], minlength=m) == 0
    ok &= (np.bincount(seg[meets], minlength=n) == 1) & (np.bincount(seg[meets & equal], minlength=n) == 1)
    hit = np.flatnonzero(meets & equal)
    match[seg[hit]] = cand[hit]
    match[~ok] = -1
    if ok.any():  # the tiling of each tensor answered, as its entry's build checks it
        picked = np.unique(code[ok])
        for k in np.unique(nd[ok]).tolist():
            group = picked[tensors.arrays.ndim[picked] == k]
            counts = starts[group + 1] - starts[group]
            _g, where = _ranges(starts[group], counts)
            offs, lens = rows.take_boxes(order[where].astype(np.int64), k)
            check(group.tolist(), offs, lens, counts.tolist())
    return _answer(match, code, tensors, rows, file_names)
