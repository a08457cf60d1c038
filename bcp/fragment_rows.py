"""The coordinator's side of a commit: every writer's fragment rows, merged as columns.

Writers report their rows as Arrow tables in CATALOG_SCHEMA's columns
(``WriterReport.rows``). At 1,024 ranks x 2,000 tensors that is 2 M rows: they are
concatenated, ordered and counted with Arrow and numpy (sort indices and hash
group-bys), never one Python object per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bcp.metadata import CATALOG_SCHEMA


def padded_boxes(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A list<int64> column as an int64 (rows, max length + 1) matrix: the values,
    zero-padded on the right, then the length of each list (so [0] and [0, 0] differ)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(array)
    ndim = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(array).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    width = int(ndim.max()) if n else 0
    out = np.zeros((n, width + 1), dtype=np.int64)
    out[:, width] = ndim
    if values.size:
        if int(ndim.min()) == width:  # one rank of tensor: a plain reshape
            out[:, :width] = values.reshape(n, width)
        else:
            of_row = np.repeat(ndim, ndim)  # each value's list length
            for d in np.unique(ndim).tolist():
                if d:
                    out[ndim == d, :d] = values[of_row == d].reshape(-1, d)
    return out


def sort_index(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Stable order of rows by ``keys`` (non-negative int64 columns, most significant
    first): one argsort of a packed int64 key when the columns fit in 63 bits, else
    np.lexsort."""
    n = len(keys[0])
    bits = [max(int(k.max()), 0).bit_length() if n else 0 for k in keys]
    if n and sum(bits) <= 63 and all(int(k.min()) >= 0 for k in keys):
        packed = np.zeros(n, dtype=np.int64)
        for k, b in zip(keys, bits, strict=True):
            packed <<= b
            packed |= k
        return np.argsort(packed, kind="stable")
    return np.lexsort(list(reversed(keys)))


def _distinct(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Indices of the first row of each distinct combination of ``keys`` (int64 columns)."""
    order = sort_index(keys)
    new = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        same = np.ones(len(order) - 1, dtype=bool)
        for k in keys:
            s = k[order]
            same &= s[1:] == s[:-1]
        new[1:] = ~same
    return order[new]


@dataclasses.dataclass(frozen=True)
class Merged:
    """Every writer's rows in catalog order, and the manifest's counts over them."""

    table: pa.Table
    stats: dict[str, int]


def merge_rows(tables: Sequence[pa.Table], order: Sequence[str]) -> pa.Table:
    """Every writer's rows as one table, ordered by the tensors' save order (``order``:
    FQNs; a tensor missing from it goes last), then the box offsets, then the writer."""
    return merge(tables, order).table


def merge(tables: Sequence[pa.Table], order: Sequence[str]) -> Merged:
    """:func:`merge_rows` and :func:`row_stats` in one pass over the rows."""
    tables = [
        t if t.schema.equals(CATALOG_SCHEMA) else t.select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        for t in tables
        if t.num_rows
    ]
    if not tables:
        return Merged(CATALOG_SCHEMA.empty_table(), _no_rows())
    table = pa.concat_tables(tables)
    fqn = table.column("fqn").combine_chunks().dictionary_encode()
    codes = fqn.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    position = {name: i for i, name in enumerate(order)}
    names = fqn.dictionary.to_pylist()
    rank = np.array([position.get(name, len(order) + i) for i, name in enumerate(names)], dtype=np.int64)
    offsets = padded_boxes(table.column("offsets"))
    lengths = padded_boxes(table.column("lengths"))
    file = table.column("file").combine_chunks().dictionary_encode()
    writer = table.column("writer_rank").to_numpy().astype(np.int64)
    # writer ranks are >= 0 in bcp's own reports; shift anyway so the packed key stays exact
    idx = sort_index([rank[codes], *(offsets[:, d] for d in range(offsets.shape[1] - 1)), writer - writer.min()])
    stats = _stats(table, codes, len(names), offsets, lengths, file.indices)
    # Reorder column by column. A take of a string or list column over 2 M rows in this
    # order misses the cache at every row; strings go as dictionary codes instead, boxes
    # from their integer matrices (exact: every row keeps its own values).
    columns: dict[str, pa.Array] = {
        "fqn": _dictionary(fqn, idx),
        "key_path": _dictionary(table.column("key_path").combine_chunks().dictionary_encode(), idx),
        "dtype": _dictionary(table.column("dtype").combine_chunks().dictionary_encode(), idx),
        "global_shape": table.column("global_shape").combine_chunks().take(idx),
        "offsets": _lists(offsets, idx),
        "lengths": _lists(lengths, idx),
        "file": _dictionary(file, idx),
    }
    for name in ("byte_offset", "nbytes", "writer_rank"):
        columns[name] = pa.array(table.column(name).to_numpy()[idx])
    columns["checksums"] = table.column("checksums").combine_chunks().take(idx)
    return Merged(pa.table([columns[n] for n in CATALOG_SCHEMA.names], names=CATALOG_SCHEMA.names), stats)


def _dictionary(encoded: pa.DictionaryArray, idx: np.ndarray) -> pa.DictionaryArray:
    codes = encoded.indices.to_numpy(zero_copy_only=False)[idx]
    return pa.DictionaryArray.from_arrays(pa.array(codes), encoded.dictionary)


def _lists(padded: np.ndarray, idx: np.ndarray) -> pa.ListArray:
    """Rows ``idx`` of a :func:`padded_boxes` matrix as a list<int64> array."""
    rows = padded[idx]
    ndim = rows[:, -1]
    width = rows.shape[1] - 1
    if len(rows) and int(ndim.min()) == width:
        values = rows[:, :width].ravel()
    else:
        values = rows[:, :width][np.arange(width) < ndim[:, None]]
    bounds = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(ndim, out=bounds[1:])
    return pa.ListArray.from_arrays(pa.array(bounds), pa.array(values, pa.int64()))


def row_stats(table: pa.Table) -> dict[str, int]:
    """The manifest's counts over the rows (vectorised): distinct tensors; distinct
    stored fragments (file, byte offset, box: a tied tensor's row shares its target's
    bytes); tensor bytes counting each (tensor, box) once."""
    if table.num_rows == 0:
        return _no_rows()
    fqn = table.column("fqn").combine_chunks().dictionary_encode()
    codes = fqn.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = padded_boxes(table.column("offsets"))
    lengths = padded_boxes(table.column("lengths"))
    file = table.column("file").combine_chunks().dictionary_encode()
    return _stats(table, codes, len(fqn.dictionary), offsets, lengths, file.indices)


def _no_rows() -> dict[str, int]:
    return {"tensors": 0, "fragments": 0, "tensor_bytes": 0}


def _stats(
    table: pa.Table, codes: np.ndarray, tensors: int, offsets: np.ndarray, lengths: np.ndarray, files: pa.Array
) -> dict[str, int]:
    file = files.to_numpy(zero_copy_only=False).astype(np.int64)
    byte_offset = table.column("byte_offset").to_numpy()
    nbytes = table.column("nbytes").to_numpy()
    box = [*(offsets[:, d] for d in range(offsets.shape[1])), *(lengths[:, d] for d in range(lengths.shape[1] - 1))]
    # distinct stored fragments: rows sharing (file, byte offset) are few (ties, empty
    # items); only those are compared box for box
    at = _distinct([file, byte_offset])
    fragments = len(at)
    if len(at) < len(file):
        shared = _rows_sharing([file, byte_offset])
        keys = [file[shared], byte_offset[shared], *(k[shared] for k in box)]
        fragments += len(_distinct(keys)) - len(_distinct(keys[:2]))
    # tensor bytes: each (tensor, box) once
    firsts = _distinct([codes, *box])
    return {"tensors": tensors, "fragments": fragments, "tensor_bytes": int(nbytes[firsts].sum())}


def _rows_sharing(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Indices of the rows whose combination of ``keys`` also occurs in another row."""
    order = sort_index(keys)
    same = np.ones(max(len(order) - 1, 0), dtype=bool)
    for k in keys:
        s = k[order]
        same &= s[1:] == s[:-1]
    mark = np.zeros(len(order), dtype=bool)
    mark[1:] |= same
    mark[:-1] |= same
    return np.sort(order[mark])
