"""Which tensors a catalog stores as one row holding the whole tensor, found in a few numpy
passes over its rows (:meth:`bcp.metadata.catalog.Catalog.whole_rows`): a load of 10,000
small tensors reads them without an object per tensor."""

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
    row = np.where(ok, row, -1)
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
