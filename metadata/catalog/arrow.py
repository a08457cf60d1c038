"""Catalog rows <-> Arrow: the columns of CATALOG_SCHEMA, built from and bound to numpy rows.

One place for the encoding (dictionary-encoded strings, list columns from flat
values and starts, zstd IPC files) and for its inverse (casting a table to the
catalog's types, mapping its strings to codes, binding its rows to a tensor table),
so that v1 files, v2 sections and a save's own reports all use the same code. No
checks beyond types and agreement with the tensor table: :mod:`.validate` does those.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bcp.metadata.catalog.tensors import CATALOG_SCHEMA, TensorTable
from bcp.metadata.format_errors import FormatError
from bcp.metadata.rows import DIGEST_COLUMN, DIGEST_TYPE, Rows, digest_array


def ipc_file(table: pa.Table) -> bytes:
    """``table`` as one Arrow IPC file with zstd-compressed buffers: a v1 catalog, a
    v2 section and each part of a v2 head are written this way."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _list_array(starts: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
    if len(values) >= 1 << 31:
        raise ValueError("catalog list column too long for one Arrow batch")
    return pa.ListArray.from_arrays(
        pa.array(starts.astype(np.int32)), pa.array(values, type=type_.value_type), type=type_
    )


def rows_table(tensors: TensorTable, file_names: Sequence[str], rows: Rows, version: str = "1") -> pa.Table:
    """Rows in CATALOG_SCHEMA's columns, strings dictionary-encoded; the dictionaries
    hold only the tensors and files these rows name, each value once."""
    arrays = tensors.arrays
    present = np.bincount(rows.tensor, minlength=len(tensors)) > 0
    kept = np.flatnonzero(present)
    t = (np.cumsum(present) - 1)[rows.tensor]  # codes into the kept tensors
    every = len(kept) == len(tensors)  # (a save's commit: Arrow arrays kept with the table, taken whole)
    names = tensors.name_array if every else tensors.name_array.take(pa.array(kept))
    kp_kept, kp_codes = np.unique(arrays.kp[kept], return_inverse=True)
    dt_kept, dt_codes = np.unique(arrays.dt[kept], return_inverse=True)
    kp_values = _taken(arrays.key_path_array, kp_kept)
    dt_values = _taken(arrays.dtype_array, dt_kept)
    f_present = np.bincount(rows.file, minlength=len(file_names)) > 0
    files = [file_names[i] for i in np.flatnonzero(f_present).tolist()]
    f = (np.cumsum(f_present) - 1)[rows.file]
    row_t = kept[t]  # the rows' tensors in the whole table
    row_ndim = arrays.ndim[row_t]
    shape_starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(row_ndim)])
    pos = np.repeat(arrays.starts[:-1][row_t] - shape_starts[:-1], row_ndim) + np.arange(
        int(shape_starts[-1]), dtype=np.int64
    )
    schema = CATALOG_SCHEMA
    columns = [
        pa.DictionaryArray.from_arrays(pa.array(t, pa.int32()), names),
        pa.DictionaryArray.from_arrays(pa.array(kp_codes.reshape(-1)[t], pa.int32()), kp_values),
        pa.DictionaryArray.from_arrays(pa.array(dt_codes.reshape(-1)[t], pa.int32()), dt_values),
        _list_array(shape_starts, arrays.shape[pos], schema.field("global_shape").type),
        _list_array(rows.coord_starts, rows.offsets, schema.field("offsets").type),
        _list_array(rows.coord_starts, rows.lengths, schema.field("lengths").type),
        pa.DictionaryArray.from_arrays(pa.array(f, pa.int32()), pa.array(files, pa.string())),
        pa.array(rows.byte_offset, pa.int64()),
        pa.array(rows.nbytes, pa.int64()),
        _list_array(rows.sum_starts, rows.sums, schema.field("checksums").type),
        pa.array(rows.writer, pa.int32()),
    ]
    names = list(schema.names)
    if rows.digests is not None:  # the optional column: only catalogs of incremental saves carry it
        columns.append(digest_array(rows.digests))
        names.append(DIGEST_COLUMN)
    table = pa.Table.from_arrays(columns, names=names)
    return table.replace_schema_metadata({"bcp.catalog.version": version})


def _taken(values: pa.Array, codes: np.ndarray) -> pa.Array:
    """``values[codes]`` (sorted distinct codes): ``values`` itself when they are all of it."""
    return values if len(codes) == len(values) else values.take(pa.array(codes))


def catalog_columns(names: Sequence[str]) -> list[str]:
    """The columns of CATALOG_SCHEMA, then ``digest`` when ``names`` has it."""
    return [*CATALOG_SCHEMA.names, *([DIGEST_COLUMN] if DIGEST_COLUMN in names else [])]


def cast_columns(table: pa.Table, where: str) -> pa.Table:
    """The columns in CATALOG_SCHEMA's types, except that dictionary-encoded string
    columns stay encoded (decoding them costs a string per row); the optional
    ``digest`` column kept when present, which must be fixed_size_binary(16) as stored
    (a digest is never converted from another type)."""
    columns = []
    for field in CATALOG_SCHEMA:
        col = table.column(field.name)
        try:
            if pa.types.is_dictionary(col.type) and field.type == pa.string():
                if not pa.types.is_string(col.type.value_type):
                    col = col.cast(pa.dictionary(col.type.index_type, pa.string()))
            elif col.type != field.type:
                col = col.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise FormatError(f"{where}: columns do not have the catalog types: {e}") from e
        columns.append(col)
    names = list(CATALOG_SCHEMA.names)
    if DIGEST_COLUMN in table.column_names:
        col = table.column(DIGEST_COLUMN)
        if col.type != DIGEST_TYPE:
            raise FormatError(f"{where}: column {DIGEST_COLUMN!r} is {col.type}; expected {DIGEST_TYPE}")
        if col.null_count:
            raise FormatError(f"{where}: column {DIGEST_COLUMN!r} has null values (it has none or a digest per row)")
        columns.append(col)
        names.append(DIGEST_COLUMN)
    return pa.Table.from_arrays(columns, names=names)


def has_nulls(column: pa.ChunkedArray | pa.Array) -> bool:
    """Whether a column holds a null at any depth: a list column's own rows and the
    elements inside its lists (a null element reads as NaN in numpy, which every
    range check lets through)."""
    if column.null_count:
        return True
    if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
        return False
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return has_nulls(array.flatten())


def string_codes(column: pa.ChunkedArray, where: str) -> tuple[np.ndarray, list[str]]:
    """Per-row codes of a string column and the distinct strings they index (a
    dictionary's repeated values merged): the strings are decoded once each."""
    chunks = [c if pa.types.is_dictionary(c.type) else c.dictionary_encode() for c in column.chunks]
    parts: list[np.ndarray] = []
    index: dict[str, int] = {}
    for chunk in chunks:
        words = chunk.dictionary.to_pylist()
        if None in words:  # one C pass (a generator step per word was 4 per tensor of a load)
            raise FormatError(f"{where}: null values in the catalog")
        indices = chunk.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        if not index:  # the first chunk: one dict built in C, then checked for repeated words
            index = dict(zip(words, range(len(words)), strict=True))
            if len(index) == len(words):
                parts.append(indices if len(words) else np.zeros(len(chunk), np.int64))
                continue
            index = {}
        remap = np.fromiter((index.setdefault(w, len(index)) for w in words), np.int64, len(words))
        parts.append(remap[indices] if len(words) else np.zeros(len(chunk), np.int64))
    values = list(index)
    codes = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return codes, values


def vocab_codes(column: pa.ChunkedArray, vocab: pa.Array, where: str) -> np.ndarray:
    """Per-row codes into ``vocab`` (distinct strings) of a string column, -1 for a word
    not in it: matched in Arrow (a hash join in C), no Python string made per row or per
    dictionary word (the head decoded each tensor's strings once: its tensor table)."""
    parts: list[np.ndarray] = []
    for chunk in column.chunks:
        words = chunk.dictionary if pa.types.is_dictionary(chunk.type) else chunk
        if words.null_count:
            raise FormatError(f"{where}: null values in the catalog")
        if words.equals(vocab):  # the usual section of one writer run: every tensor, in table order
            codes = np.arange(len(words), dtype=np.int64)
        else:
            codes = pc.index_in(words, value_set=vocab).fill_null(-1).to_numpy().astype(np.int64)
        if words is not chunk:
            indices = chunk.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            codes = codes[indices] if len(codes) else np.full(len(chunk), -1, np.int64)
        parts.append(codes)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _given_codes(table: pa.Table, tensors: TensorTable, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's tensor, key path and dtype as codes into a given table (a v2 head's),
    -1 for a key path or dtype the table lacks: matched in Arrow, the head decoded the
    strings (:func:`vocab_codes`); FormatError naming the first row whose tensor is unknown."""
    arrays = tensors.arrays
    local = vocab_codes(table.column("fqn"), tensors.name_array, where)
    if (local < 0).any():
        i = int(np.flatnonzero(local < 0)[0])
        name = table.column("fqn")[i].as_py()
        raise FormatError(f"{where} row {i}: tensor {name!r} is not in the catalog's tensor table")
    kp_row = vocab_codes(table.column("key_path"), arrays.key_path_array, where)
    dt_row = vocab_codes(table.column("dtype"), arrays.dtype_array, where)
    return local, kp_row, dt_row


def _added_codes(
    table: pa.Table, tensors: TensorTable, shape_starts: np.ndarray, shape_flat: np.ndarray, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """As :func:`_given_codes`, each tensor added to ``tensors`` as its first row
    describes it (a v1 catalog, a save's own rows)."""
    n = table.num_rows
    fqn_codes, fqn_values = string_codes(table.column("fqn"), where)
    kp_codes, kp_values = string_codes(table.column("key_path"), where)
    dt_codes, dt_values = string_codes(table.column("dtype"), where)
    first = np.full(len(fqn_values), n, dtype=np.int64)
    first[fqn_codes[::-1]] = np.arange(n - 1, -1, -1)  # the last write wins: each fqn's first row
    for r in np.sort(first[first < n]).tolist():
        s0, s1 = shape_starts[r], shape_starts[r + 1]
        shape = tuple(shape_flat[s0:s1].tolist())
        tensors.add(fqn_values[fqn_codes[r]], kp_values[kp_codes[r]], dt_values[dt_codes[r]], shape)
    local = np.array([tensors.index[v] for v in fqn_values], dtype=np.int64)[fqn_codes]
    arrays = tensors.arrays
    kp_row = np.array([arrays.key_paths.get(v, -1) for v in kp_values], dtype=np.int64)[kp_codes]
    dt_row = np.array([arrays.dtypes.get(v, -1) for v in dt_values], dtype=np.int64)[dt_codes]
    return local, kp_row, dt_row


def bind_rows(table: pa.Table, tensors: TensorTable, files: list[str], *, where: str, fixed: bool) -> Rows:
    """Rows of a (type-checked) table with tensor and file codes into ``tensors`` and
    ``files``, after checking that every row of a tensor agrees with the tensor table
    on dtype, shape and key path. ``fixed``: the tensor table is given (a v2 head), so
    an unknown tensor is an error; else tensors are added in order of first row."""
    n = table.num_rows
    file_codes, file_values = string_codes(table.column("file"), where)
    shape_col = table.column("global_shape").combine_chunks()
    shape_starts = shape_col.offsets.to_numpy().astype(np.int64)
    shape_starts -= shape_starts[0]
    shape_flat = shape_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    row_ndim = np.diff(shape_starts)
    if fixed:
        local, kp_row, dt_row = _given_codes(table, tensors, where)
    else:
        local, kp_row, dt_row = _added_codes(table, tensors, shape_starts, shape_flat, where)
    if n:
        arrays = tensors.arrays
        # every row against its tensor's entry in the table (codes in the table's vocabularies)
        t_ndim, t_flat, t_starts = arrays.ndim, arrays.shape, arrays.starts
        bad = (arrays.kp[local] != kp_row) | (arrays.dt[local] != dt_row)
        bad |= t_ndim[local] != row_ndim
        d = int(row_ndim[0])
        if not bad.any() and (row_ndim == d).all() and (t_ndim == d).all():  # one rank of tensor: matrices
            t_matrix = t_flat[: len(t_ndim) * d].reshape(len(t_ndim), d)
            bad = (shape_flat[: n * d].reshape(n, d) != t_matrix[local]).any(axis=1)
        else:
            count = np.where(bad, 0, row_ndim)
            total = int(count.sum())
            step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
            rows_rep = np.repeat(np.arange(n), count)
            differs = shape_flat[shape_starts[rows_rep] + step] != t_flat[t_starts[local[rows_rep]] + step]
            bad[rows_rep[differs]] = True
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            fqn = tensors.names[int(local[i])]
            raise FormatError(f"{where}: fragments of {fqn!r} disagree on dtype/shape/path")
    file_index = {name: i for i, name in enumerate(files)}
    for v in file_values:
        if v not in file_index:
            file_index[v] = len(files)
            files.append(v)
    file_map = np.array([file_index[v] for v in file_values], dtype=np.int32)
    return Rows.from_table(table, local, file_map[file_codes] if n else np.zeros(0, np.int32))


def read_ipc_columns(data: bytes, names: Sequence[str], where: str, optional: Sequence[str] = ()) -> pa.Table:
    """The columns ``names`` of an Arrow IPC file, then those of ``optional`` it has,
    fully validated by Arrow; a FormatError naming ``where`` when the file is
    unreadable or lacks a column of ``names``."""
    try:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, EOFError) as e:
        raise FormatError(f"{where}: not a readable Arrow IPC file: {e}") from e
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise FormatError(f"{where}: missing column(s) {', '.join(missing)}")
    return table.select([*names, *(n for n in optional if n in table.column_names)])
