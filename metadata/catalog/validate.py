"""Checks on untrusted catalog rows, and the one path by which stored rows enter a catalog.

A catalog is read from storage that may be corrupt or hostile: every row must be
self-consistent (box inside its tensor, bytes matching the box, one checksum per
block, sizes that keep int64 arithmetic exact) and inside a data file the manifest
declares. :func:`decode_rows` chains the decode budget (:mod:`.budget`), the Arrow
decoding (:mod:`.arrow`) and these checks, so no caller can skip one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from bcp.metadata.catalog.arrow import bind_rows, cast_columns, has_nulls, read_ipc_columns, string_codes
from bcp.metadata.catalog.budget import check_expansion, check_ipc_budget, decode_budget
from bcp.metadata.catalog.tensors import CATALOG_SCHEMA, MAX_TENSOR_BYTES, TensorTable
from bcp.metadata.dtypes import itemsize
from bcp.metadata.format_errors import FormatError
from bcp.metadata.rows import DIGEST_COLUMN, Fragment, Rows


def decode_rows(
    data: bytes,
    where: str,
    checksum_block_bytes: int,
    tensors: TensorTable,
    files: list[str],
    *,
    fixed: bool,
    budget: int | None = None,
) -> tuple[Rows, int]:
    """Decode and validate one Arrow IPC file of catalog rows (a v1 catalog, or one
    section of a v2 catalog): budget, types, nulls, every row, agreement with the
    tensor table (see :func:`bind_rows`). Returns the rows and the bytes of the budget
    (default: :func:`decode_budget` of the file) that decoding counted."""
    budget = decode_budget(len(data)) if budget is None else budget
    used = check_ipc_budget(data, where=where, budget=budget)
    table = read_ipc_columns(data, CATALOG_SCHEMA.names, where, optional=(DIGEST_COLUMN,))
    check_expansion(table, where=where, budget=budget)  # strings stay encoded: counted, not charged
    table = cast_columns(table, where)
    if table.num_rows and any(has_nulls(table.column(n)) for n in CATALOG_SCHEMA.names):
        raise FormatError(f"{where}: null values in the catalog")
    validate_table(table, where=where, checksum_block_bytes=checksum_block_bytes)
    return bind_rows(table, tensors, files, where=where, fixed=fixed), used


_TUPLE_COLUMNS = frozenset({"global_shape", "offsets", "lengths", "checksums"})


def _flat_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """The concatenated elements of a list column, honouring its offsets (a hostile
    file's offsets need not start at 0, so ``.values`` would misalign)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.flatten().to_numpy(zero_copy_only=False)


def _row_products(values: np.ndarray, row_of: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row products of non-negative int64 ``values``: (int64 products, float64
    products). The int64 ones are exact wherever the float ones are below 2**62."""
    exact = np.ones(n, dtype=np.int64)
    approx = np.ones(n, dtype=np.float64)
    with np.errstate(over="ignore"):
        np.multiply.at(exact, row_of, values)
        np.multiply.at(approx, row_of, values.astype(np.float64))
    return exact, approx


def validate_table(table: pa.Table, *, where: str, checksum_block_bytes: int) -> None:
    """Vectorised form of validate_fragment over every row; the error names the first
    bad row. Products that would overflow int64 are caught (in float64), not wrapped."""
    n = table.num_rows
    if n == 0:
        return

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(name).combine_chunks()
        return _flat_values(col), np.diff(col.offsets.to_numpy())

    shape, ndim = flat("global_shape")
    offs, n_off = flat("offsets")
    lens, n_len = flat("lengths")
    bad = (n_off != ndim) | (n_len != ndim)
    if not bad.any():
        row_of = np.repeat(np.arange(n), ndim)
        with np.errstate(over="ignore"):
            # shape >= 0 and lens >= 0 where this matters, so shape - lens cannot overflow
            outside = (offs < 0) | (lens < 0) | (shape < 0) | (offs > shape - lens)
        bad = np.bincount(row_of[outside], minlength=n) > 0
        dt_codes, dt_values = string_codes(table.column("dtype"), where)  # one itemsize lookup per distinct dtype
        known = np.array([itemsize_or_zero(d) for d in dt_values], dtype=np.int64)
        sizes = known[dt_codes]
        nonneg = ~np.repeat(bad, ndim)
        numel, numel_f = _row_products(np.where(nonneg, lens, 0), row_of, n)
        # the empty dims counted as 1, as torch computes strides ([0, 2**62, 2**62] overflows them)
        _total, total_f = _row_products(np.where(nonneg, np.maximum(shape, 1), 0), row_of, n)
        too_big = (numel_f * sizes >= MAX_TENSOR_BYTES) | (total_f * sizes >= MAX_TENSOR_BYTES)
        nbytes = table.column("nbytes").to_numpy()
        with np.errstate(over="ignore"):
            bad |= too_big | (sizes == 0) | (nbytes != numel * sizes) | (table.column("byte_offset").to_numpy() < 0)
        n_sums = np.diff(table.column("checksums").combine_chunks().offsets.to_numpy())
        bad |= n_sums != -(-nbytes // checksum_block_bytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        row = {name: table.column(name)[i].as_py() for name in CATALOG_SCHEMA.names}
        for name in _TUPLE_COLUMNS:
            row[name] = tuple(row[name])
        validate_fragment(Fragment(**row), where=f"{where} row {i}", checksum_block_bytes=checksum_block_bytes)
        raise FormatError(f"{where} row {i} ({row['fqn']!r}): inconsistent fragment")


def itemsize_or_zero(dtype: str) -> int:
    """The item size of ``dtype``, 0 for a name the format does not know (vectorised
    checks look sizes up per distinct dtype and refuse the zeros)."""
    try:
        return itemsize(dtype)
    except ValueError:
        return 0


def validate_fragment(f: Fragment, *, where: str, checksum_block_bytes: int) -> None:
    """Raise FormatError unless the row is self-consistent (box inside the tensor,
    byte count matching the box, one checksum per block, sizes below MAX_TENSOR_BYTES)."""
    if checksum_block_bytes <= 0:
        raise FormatError(f"{where}: checksum block size {checksum_block_bytes} is not positive")
    ndim = len(f.global_shape)
    if len(f.offsets) != ndim or len(f.lengths) != ndim:
        raise FormatError(f"{where} ({f.fqn!r}): box has {len(f.offsets)}/{len(f.lengths)} dims, tensor has {ndim}")
    for d, (o, n, s) in enumerate(zip(f.offsets, f.lengths, f.global_shape, strict=True)):
        if s < 0 or o < 0 or n < 0 or o + n > s:
            raise FormatError(f"{where} ({f.fqn!r}): dim {d} box [{o}, {o + n}) is outside size {s}")
    try:
        size = itemsize(f.dtype)
    except ValueError as e:
        raise FormatError(f"{where} ({f.fqn!r}): {e}") from None
    if math.prod(max(d, 1) for d in f.global_shape) * size >= MAX_TENSOR_BYTES:  # torch's strides
        raise FormatError(
            f"{where} ({f.fqn!r}): tensor {list(f.global_shape)} of {f.dtype} is larger than "
            f"{MAX_TENSOR_BYTES} bytes, the most the format allows"
        )
    if f.nbytes != math.prod(f.lengths) * size:
        raise FormatError(f"{where} ({f.fqn!r}): nbytes {f.nbytes} does not match box {list(f.lengths)} of {f.dtype}")
    if f.byte_offset < 0:
        raise FormatError(f"{where} ({f.fqn!r}): negative byte offset {f.byte_offset}")
    blocks = -(-f.nbytes // checksum_block_bytes)
    if len(f.checksums) != blocks:
        raise FormatError(f"{where} ({f.fqn!r}): {len(f.checksums)} checksums for {blocks} blocks")


def check_rows_in_files(
    rows: Rows, tensors: TensorTable, file_names: Sequence[str], file_sizes: Mapping[str, int], *, where: str
) -> None:
    """FormatError naming the first row whose bytes are not inside a declared file, or
    two rows of one tensor that share bytes of a file (its boxes are disjoint, so its
    bytes are too: 8,192 rows over one MiB declared 8 GiB, every checksum right)."""
    if len(rows) == 0:
        return
    declared = np.array([file_sizes.get(n, -1) for n in file_names], dtype=np.int64)
    size = declared[rows.file]
    off, n = rows.byte_offset, rows.nbytes
    bad = (size < 0) | (off > size - n)  # off, n >= 0 (validated), so size - n cannot overflow
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fqn, file = tensors.names[int(rows.tensor[i])], file_names[int(rows.file[i])]
        _check_in_file(where, i, fqn, file, int(off[i]), int(n[i]), file_sizes.get(file))
    _check_rows_disjoint(rows, tensors, file_names, where=where)


def _check_rows_disjoint(rows: Rows, tensors: TensorTable, file_names: Sequence[str], *, where: str) -> None:
    """One sort by (tensor, file, offset): a row meeting any earlier row of its tensor in
    its file meets the one just before it, or one just before that is the same row
    again (a replica of one box at the same bytes: harmless, so allowed)."""
    held = np.flatnonzero(rows.nbytes > 0)
    if len(held) < 2:
        return
    order = held[np.lexsort((rows.byte_offset[held], rows.file[held], rows.tensor[held]))]
    t, f, off, n = rows.tensor[order], rows.file[order], rows.byte_offset[order], rows.nbytes[order]
    clash = (t[1:] == t[:-1]) & (f[1:] == f[:-1]) & (off[1:] < off[:-1] + n[:-1])
    for k in np.flatnonzero(clash).tolist():
        first, second = int(order[k]), int(order[k + 1])
        if off[k] == off[k + 1] and n[k] == n[k + 1] and _box(rows, first) == _box(rows, second):
            continue
        raise FormatError(
            f"{where} rows {min(first, second)} and {max(first, second)} ({tensors.names[int(t[k])]!r}): two boxes of "
            f"one tensor stored in the same bytes of {file_names[int(f[k])]!r} (from {int(off[k + 1])})"
        )


def _box(rows: Rows, i: int) -> tuple[list[int], list[int]]:
    start, end = int(rows.coord_starts[i]), int(rows.coord_starts[i + 1])
    return rows.offsets[start:end].tolist(), rows.lengths[start:end].tolist()


def _check_in_file(where: str, i: int, fqn: str, file: str, off: int, n: int, size: int | None) -> None:
    if size is None or size < 0:
        raise FormatError(f"{where} row {i} ({fqn!r}): data file {file!r} is not among the manifest's data files")
    if off > size - n:
        raise FormatError(
            f"{where} row {i} ({fqn!r}): bytes [{off}, {off + n}) lie outside data file {file!r}, "
            f"which the manifest says holds {size} bytes"
        )
