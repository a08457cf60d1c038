"""The coordinator's side of a commit: every writer's fragment rows, merged as columns.

Writers report their rows as Arrow tables (``WriterReport.rows``: a tensor index into
the rank's layout metadata, the box, where its bytes lie, their checksums). At 1,024
ranks x 2,000 tensors that is 2 M rows: they are concatenated, ordered and counted
with Arrow and numpy (sort indices), never one Python object per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bcp.metadata import CATALOG_SCHEMA

from .io_scheduler.write_pipeline import WriterReport
from .save_plan import LayoutMeta


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


def merge_reports(reports: Sequence[WriterReport], metas: Sequence[LayoutMeta], order: Sequence[str]) -> Merged:
    """Every writer's rows as one catalog table (CATALOG_SCHEMA's columns, strings
    dictionary-encoded), ordered by the tensors' save order (``order``: FQNs), then the
    box offsets, then the writer; and the manifest's counts.

    ``metas[r]`` is rank r's layout metadata: report rows name a tensor by its index
    there. The plan checked that ranks agree on each tensor's key path, dtype and shape,
    so the per-tensor columns come from one table of tensors, not from every row."""
    position = {name: i for i, name in enumerate(order)}
    # the tensor table, indexed by save-order position
    fqns: list[str | None] = [None] * len(order)
    paths: list[str] = [""] * len(order)
    dtypes: list[str] = [""] * len(order)
    shapes: list[tuple[int, ...]] = [()] * len(order)
    to_global: dict[int, np.ndarray] = {}
    for meta in {id(m): m for m in metas}.values():
        ids = np.array([position[f] for f in meta.fqns], dtype=np.int64)
        to_global[id(meta)] = ids
        for i, g in enumerate(ids.tolist()):
            if fqns[g] is None:
                fqns[g], paths[g], dtypes[g], shapes[g] = (
                    meta.fqns[i],
                    meta.key_paths[i],
                    meta.dtypes[i],
                    meta.shapes[i],
                )
    writing = [r for r in reports if r.rows.num_rows]
    if not writing:
        return Merged(CATALOG_SCHEMA.empty_table(), _no_rows())
    table = pa.concat_tables([r.rows for r in writing])
    tensor = np.concatenate([to_global[id(metas[r.rank])][r.rows.column("tensor").to_numpy()] for r in writing])
    sizes = np.array([r.rows.num_rows for r in writing], dtype=np.int64)
    file = np.repeat(np.arange(len(writing), dtype=np.int64), sizes)
    writer = np.repeat(np.array([r.rank for r in writing], dtype=np.int64), sizes)
    offsets = padded_boxes(table.column("offsets"))
    lengths = padded_boxes(table.column("lengths"))
    idx = sort_index([tensor, *(offsets[:, d] for d in range(offsets.shape[1] - 1)), writer - int(writer.min())])
    present = int(np.count_nonzero(np.bincount(tensor, minlength=len(order))))
    stats = _stats(table, tensor, present, offsets, lengths, pa.array(file), by_box=idx)
    t_sorted = tensor[idx]
    names = [r.file.path if r.file is not None else "" for r in writing]
    columns: dict[str, pa.Array] = {
        "fqn": _coded(t_sorted, [f or "" for f in fqns]),
        "key_path": _coded(t_sorted, paths),
        "dtype": _coded(t_sorted, dtypes),
        "global_shape": pa.array(shapes, pa.list_(pa.int64())).take(pa.array(t_sorted)),
        "offsets": table.column("offsets").combine_chunks().take(pa.array(idx)),
        "lengths": table.column("lengths").combine_chunks().take(pa.array(idx)),
        "file": _coded(file[idx], names),
        "byte_offset": pa.array(table.column("byte_offset").to_numpy()[idx]),
        "nbytes": pa.array(table.column("nbytes").to_numpy()[idx]),
        "checksums": table.column("checksums").combine_chunks().take(pa.array(idx)),
        "writer_rank": pa.array(writer[idx].astype(np.int32)),
    }
    return Merged(pa.table([columns[c] for c in CATALOG_SCHEMA.names], names=CATALOG_SCHEMA.names), stats)


def _coded(codes: np.ndarray, values: Sequence[str]) -> pa.DictionaryArray:
    """``values[codes]`` as a dictionary array whose dictionary holds each string once."""
    encoded = pa.array(values, pa.string()).dictionary_encode()
    remap = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(remap[codes]), encoded.dictionary)


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
    table: pa.Table,
    codes: np.ndarray,
    tensors: int,
    offsets: np.ndarray,
    lengths: np.ndarray,
    files: pa.Array,
    by_box: np.ndarray | None = None,
) -> dict[str, int]:
    """The counts of :func:`row_stats`. ``by_box``: an order of the rows in which rows
    with equal (tensor, offsets) are adjacent (the catalog order), so only the rows
    of such runs need comparing in full; else one is sorted here."""
    file = files.to_numpy(zero_copy_only=False).astype(np.int64)
    byte_offset = table.column("byte_offset").to_numpy()
    nbytes = table.column("nbytes").to_numpy()
    box = [*(offsets[:, d] for d in range(offsets.shape[1])), *(lengths[:, d] for d in range(lengths.shape[1] - 1))]
    # Distinct stored fragments. Rows sharing (file, byte offset) are few (tied tensors,
    # empty items); only those are compared box for box. Writers place items at rising
    # offsets, so in report order equal pairs are usually adjacent already.
    within = _adjacent_order(file, byte_offset)
    order = within if within is not None else sort_index([file, byte_offset])
    group, rows = _runs([file, byte_offset], order)
    fragments = len(file) - len(rows)
    if len(rows):  # distinct boxes within each run of rows sharing (file, byte offset)
        fragments += len(_distinct([group, *(k[rows] for k in box)]))
    # Tensor bytes: each (tensor, box) once. Empty boxes add nothing, so only rows
    # holding bytes are compared.
    order = by_box if by_box is not None else sort_index([codes, *box])
    order = order[nbytes[order] > 0]
    group, rows = _runs([codes, *box[: offsets.shape[1]]], order)
    tensor_bytes = int(nbytes.sum()) - int(nbytes[rows].sum())
    if len(rows):
        tensor_bytes += int(nbytes[rows][_distinct([group, *(k[rows] for k in box[offsets.shape[1] :])])].sum())
    return {"tensors": tensors, "fragments": fragments, "tensor_bytes": tensor_bytes}


def _runs(keys: Sequence[np.ndarray], order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows whose ``keys`` equal those of a neighbour in ``order`` (an order in which
    equal keys are adjacent), and for each a run number (0, 1, ...: rows with equal keys
    share it). Comparing only within runs keeps the keys short (packed sorts)."""
    empty = np.zeros(0, dtype=np.int64)
    if len(order) < 2:
        return empty, empty
    same = np.ones(len(order) - 1, dtype=bool)
    for k in keys:
        s = k[order]
        same &= s[1:] == s[:-1]
    if not same.any():
        return empty, empty
    mark = np.zeros(len(order), dtype=bool)
    mark[1:] |= same
    mark[:-1] |= same
    starts = mark.copy()
    starts[1:] &= ~same  # the first row of each run
    run = np.cumsum(starts) - 1
    return run[mark].astype(np.int64), order[mark]


def _adjacent_order(file: np.ndarray, byte_offset: np.ndarray) -> np.ndarray | None:
    """The rows' own order when each file's rows are one run with non-decreasing byte
    offsets (then equal (file, offset) pairs are adjacent), else None."""
    n = len(file)
    if n < 2:
        return np.arange(n)
    step = file[1:] != file[:-1]
    if int(step.sum()) + 1 != int(np.count_nonzero(np.bincount(file))):  # file codes are 0, 1, ...
        return None
    if (np.diff(byte_offset)[~step] < 0).any():
        return None
    return np.arange(n)
