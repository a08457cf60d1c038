"""Reading a v2 catalog's head, checked before any section is trusted.

The head is the small part of a v2 catalog every loading rank reads (its tensor
table, section table and span index; layout in :mod:`.sections`). It comes from
storage: every length, offset, index and span is checked here, under the decode
budget, so that the sections it points to can be fetched and checked on their own.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pyarrow as pa

from bcp.metadata.catalog.arrow import has_nulls, read_ipc_columns, string_codes
from bcp.metadata.catalog.budget import check_ipc_budget
from bcp.metadata.catalog.sections import HEAD_PREFIX, SECTIONS_SCHEMA, SPANS_SCHEMA, TENSORS_SCHEMA
from bcp.metadata.catalog.spans import EMPTY_SPAN
from bcp.metadata.catalog.tensors import MAX_TENSOR_BYTES, TensorArrays, TensorTable, first_seen, suffix_products
from bcp.metadata.catalog.validate import itemsize_or_zero
from bcp.metadata.checksum import crc32c
from bcp.metadata.format_errors import FormatError


@dataclasses.dataclass
class Head:
    """A v2 catalog's head, validated: tensor table, section table, span index."""

    tensors: TensorTable
    #: where the sections end (the head's first byte)
    head_offset: int
    sec_offset: np.ndarray  # (S,) int64
    sec_length: np.ndarray  # (S,) int64
    sec_crc: np.ndarray  # (S,) uint32
    sec_rows: np.ndarray  # (S,) int64
    sec_first_writer: np.ndarray  # (S,) int32
    sec_last_writer: np.ndarray  # (S,) int32
    span_section: np.ndarray  # (P,) int64, ascending with span_tensor
    span_tensor: np.ndarray  # (P,) int64
    span_first: np.ndarray  # (P,) int64
    span_last: np.ndarray  # (P,) int64
    #: bytes of buffers decoding the head took (counts against the catalog's budget)
    used: int

    @property
    def sections(self) -> int:
        return len(self.sec_offset)

    def spans_of(self, section: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = np.searchsorted(self.span_section, [section, section + 1])
        return self.span_tensor[lo:hi], self.span_first[lo:hi], self.span_last[lo:hi]

    def sections_of_tensors(self) -> tuple[np.ndarray, np.ndarray]:
        """(order, starts): span rows sorted by tensor, and each tensor's range in them."""
        order = np.argsort(self.span_tensor, kind="stable")
        starts = np.searchsorted(self.span_tensor[order], np.arange(len(self.tensors) + 1))
        return order, starts


def decode_head(head: bytes, head_offset: int, head_crc: int, *, where: str, budget: int) -> Head:
    """Validate and decode the head (its bytes, where it starts, the trailer's CRC32C)."""
    if crc32c(head) != head_crc:
        raise FormatError(
            f"{where}: catalog head fails its CRC32C (stored {head_crc:#010x}, read {crc32c(head):#010x})"
        )
    if len(head) < HEAD_PREFIX.size:
        raise FormatError(f"{where}: catalog head of {len(head)} bytes is too short")
    lengths = HEAD_PREFIX.unpack_from(head, 0)
    if sum(lengths) != len(head) - HEAD_PREFIX.size:
        raise FormatError(f"{where}: catalog head parts of {list(lengths)} bytes do not fill its {len(head)} bytes")
    tables, pos, used = [], HEAD_PREFIX.size, 0
    for n, schema in zip(lengths, (TENSORS_SCHEMA, SECTIONS_SCHEMA, SPANS_SCHEMA), strict=True):
        part = head[pos : pos + n]
        pos += n
        name = schema.metadata[b"bcp.catalog.part"].decode()
        used += check_ipc_budget(part, where=f"{where} (head, {name})", budget=budget - used)
        tables.append(_read_table(part, schema, f"{where} (head, {name})"))
    t_table, s_table, p_table = tables
    tensors = tensor_table(t_table, where)

    def col(table: pa.Table, name: str, dtype: type) -> np.ndarray:
        return table.column(name).combine_chunks().to_numpy(zero_copy_only=False).astype(dtype)

    off, length = col(s_table, "offset", np.int64), col(s_table, "length", np.int64)
    first_w, last_w = col(s_table, "first_writer", np.int32), col(s_table, "last_writer", np.int32)
    rows = col(s_table, "rows", np.int64)
    if len(off) == 0:
        raise FormatError(f"{where}: catalog head lists no sections")
    ends = off + length
    # sections tile [0, head_offset) in order: inside the file, non-overlapping, nothing else in between
    if off[0] != 0 or ends[-1] != head_offset or (off[1:] != ends[:-1]).any() or (length <= 0).any():
        raise FormatError(
            f"{where}: catalog sections do not fill bytes [0, {head_offset}) in order without overlap "
            f"(offsets {off[:8].tolist()}..., lengths {length[:8].tolist()}...)"
        )
    if (rows < 0).any() or (first_w > last_w).any() or (last_w[:-1] >= first_w[1:]).any():
        raise FormatError(f"{where}: catalog section table has negative rows or writer runs out of order")
    sec, ten = col(p_table, "section", np.int64), col(p_table, "tensor", np.int64)
    lo, hi = col(p_table, "first", np.int64), col(p_table, "last", np.int64)
    if len(sec) and ((sec < 0).any() or (sec >= len(off)).any() or (ten < 0).any() or (ten >= len(tensors)).any()):
        raise FormatError(f"{where}: catalog span index names a section or tensor that does not exist")
    key = sec * max(len(tensors), 1) + ten
    if len(key) > 1 and (np.diff(key) <= 0).any():
        raise FormatError(f"{where}: catalog span index is not in (section, tensor) order without repeats")
    numel = tensors.arrays.numel if len(tensors) else np.zeros(1, np.int64)  # < 2**62 (checked)
    empty = (lo == EMPTY_SPAN[0]) & (hi == EMPTY_SPAN[1])
    if len(sec) and (~empty & ((lo < 0) | (lo > hi) | (hi >= numel[ten]))).any():
        raise FormatError(f"{where}: catalog span index holds a span outside its tensor")
    return Head(
        tensors,
        head_offset,
        off,
        length,
        col(s_table, "crc32c", np.uint32),
        rows,
        first_w,
        last_w,
        sec,
        ten,
        lo,
        hi,
        used,
    )


def _read_table(data: bytes, schema: pa.Schema, where: str) -> pa.Table:
    table = read_ipc_columns(data, schema.names, where)
    columns = []
    for field in schema:
        c = table.column(field.name)
        try:
            if not (pa.types.is_dictionary(c.type) and field.type == pa.string()):
                c = c.cast(field.type)
            elif not pa.types.is_string(c.type.value_type):
                c = c.cast(pa.dictionary(c.type.index_type, pa.string()))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise FormatError(f"{where}: columns do not have the expected types: {e}") from e
        if has_nulls(c):
            raise FormatError(f"{where}: null values")
        columns.append(c)
    return pa.Table.from_arrays(columns, names=schema.names)


def tensor_table(table: pa.Table, where: str) -> TensorTable:
    """The tensor table from its columns in a few numpy passes (a head of 10,000 tensors
    decoded without a Python loop over tensors or dimensions); every name distinct,
    every dtype known, no dimension negative, no tensor of MAX_TENSOR_BYTES or more.
    Each name is decoded once (the rows of the sections are matched against the kept
    Arrow column, :func:`.arrow.vocab_codes`, not decoded again)."""
    n = table.num_rows
    names, index, name_array = _names(table.column("fqn"), where)
    kp_codes, kp_values = string_codes(table.column("key_path"), where)
    dt_codes, dt_values = string_codes(table.column("dtype"), where)
    shape_col = table.column("global_shape").combine_chunks()
    starts = shape_col.offsets.to_numpy().astype(np.int64)
    flat = shape_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    starts -= starts[0]
    if (flat < 0).any():
        raise FormatError(f"{where}: the catalog's tensor table holds a negative dimension")
    sizes = np.array([itemsize_or_zero(d) for d in dt_values], dtype=np.int64)
    if n and (sizes[dt_codes] == 0).any():
        i = int(np.flatnonzero(sizes[dt_codes] == 0)[0])
        raise FormatError(f"{where}: tensor {names[i]!r}: unknown dtype {dt_values[dt_codes[i]]!r}")
    arrays = TensorArrays(np.diff(starts), flat, first_seen(kp_codes, kp_values), first_seen(dt_codes, dt_values))
    # numel saturates at MAX_TENSOR_BYTES, exact below: as float, the product Python would round;
    # the empty dims counted as 1, as torch computes strides ([0, 2**62, 2**62] overflows them)
    spans = suffix_products(arrays.ndim, arrays.starts, np.maximum(flat, 1))[1]
    too_big = spans.astype(np.float64) * sizes[dt_codes].astype(np.float64) >= MAX_TENSOR_BYTES
    if too_big.any():
        i = int(np.flatnonzero(too_big)[0])
        raise FormatError(
            f"{where}: tensor {names[i]!r} is larger than {MAX_TENSOR_BYTES} bytes, the most the format allows "
            "(its dimensions' product, an empty one counted as 1, times its item size)"
        )
    key_paths, dtypes = _take(kp_values, kp_codes), _take(dt_values, dt_codes)
    return TensorTable.from_columns(names, key_paths, dtypes, arrays, index=index, name_array=name_array)


def _names(column: pa.ChunkedArray, where: str) -> tuple[list[str], dict[str, int], pa.Array]:
    """The tensor names (one Python string each, decoded in one C pass), name ->
    position, and the names as one Arrow string array; FormatError if one repeats."""
    if pa.types.is_dictionary(column.type):  # a writer of ours writes plain strings; others may not
        if any(chunk.dictionary.null_count for chunk in column.chunks):  # even a word no row uses
            raise FormatError(f"{where}: null values in the catalog")
        column = column.cast(pa.string())
    array = column.combine_chunks()  # a plain column's nulls: _read_table refused them
    names = array.to_pylist()
    index = dict(zip(names, range(len(names)), strict=True))
    if len(index) != len(names):
        counts = collections.Counter(names)  # in order of first use: the first name that repeats
        twice = next(name for name, count in counts.items() if count > 1)
        raise FormatError(f"{where}: the catalog's tensor table names tensor {twice!r} twice")
    return names, index, array


def _take(values: list[str], codes: np.ndarray) -> list[str]:
    """``[values[c] for c in codes]`` in one numpy gather (the strings shared, not copied)."""
    if len(codes) == len(values) and (codes == np.arange(len(codes))).all():
        return list(values)  # each value once, in order: a distinct key path a tensor
    words = np.empty(len(values), dtype=object)
    words[:] = values
    return words[codes].tolist()
