"""Catalog v2 on storage: sections of rows per run of writers, then a small head.

Layout of fragments.arrow (FORMAT.md, "Catalog v2")::

    section 0 | section 1 | ... | section S-1 | head | trailer (24 bytes)

Each section is a self-contained Arrow IPC file of catalog rows (CATALOG_SCHEMA,
version "2") written by a run of consecutive writer ranks. The head holds the tensor
table (save order), the section table (where each section lies, its CRC32C, rows and
writers) and the span index: for every (section, tensor with rows in it), the first
and last flat element index that section's fragments of that tensor cover. A box can
only meet a fragment whose flat span meets the box's own flat span, so a reader that
wants some boxes reads only the sections whose spans meet theirs: exact-conservative
for any layout, integers only.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from .catalog import (
    MAX_TENSOR_BYTES,
    TensorTable,
    _codes,
    _ipc_file,
    _table,
    check_ipc_budget,
    itemsize_or_zero,
    read_ipc_columns,
)
from .checksum import crc32c
from .errors import FormatError
from .rows import Rows

VERSION = "2"
MAGIC = b"BCPCAT2\x00"
#: head length (u64), head CRC32C (u32), reserved (u32, 0), magic (8 bytes)
TRAILER = struct.Struct("<QII8s")
#: head: its three parts' lengths (u64 each), then the parts (Arrow IPC files)
HEAD_PREFIX = struct.Struct("<QQQ")
#: a section holds at least this many rows unless the whole catalog is smaller
MIN_SECTION_ROWS = 4096
#: (first, last) of a (section, tensor) whose fragments there are all empty
EMPTY_SPAN = (0, -1)

TENSORS_SCHEMA = pa.schema(
    [
        pa.field("fqn", pa.string(), nullable=False),
        pa.field("key_path", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("global_shape", pa.list_(pa.int64()), nullable=False),
    ],
    metadata={"bcp.catalog.version": VERSION, "bcp.catalog.part": "tensors"},
)
SECTIONS_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("length", pa.int64(), nullable=False),
        pa.field("crc32c", pa.uint32(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("first_writer", pa.int32(), nullable=False),
        pa.field("last_writer", pa.int32(), nullable=False),
    ],
    metadata={"bcp.catalog.version": VERSION, "bcp.catalog.part": "sections"},
)
SPANS_SCHEMA = pa.schema(
    [
        pa.field("section", pa.int32(), nullable=False),
        pa.field("tensor", pa.int32(), nullable=False),
        pa.field("first", pa.int64(), nullable=False),
        pa.field("last", pa.int64(), nullable=False),
    ],
    metadata={"bcp.catalog.version": VERSION, "bcp.catalog.part": "spans"},
)


def is_v2(data_tail: bytes) -> bool:
    """Whether catalog bytes ending with ``data_tail`` are a v2 catalog (v1 is one
    Arrow IPC file, ending with ``ARROW1``)."""
    return len(data_tail) >= TRAILER.size and data_tail[-len(MAGIC) :] == MAGIC


def section_count(rows: int, writers: int) -> int:
    """Sections for ``rows`` rows by ``writers`` writers: about sqrt(2 x writers), so
    that the index plus two sections stays small, with at least MIN_SECTION_ROWS rows
    each (one section for small saves), never more than writers."""
    if rows == 0 or writers <= 1:
        return 1
    return max(1, min(writers, rows // MIN_SECTION_ROWS, round(math.sqrt(2 * writers))))


# -- spans -----------------------------------------------------------------------------


def flat_spans(
    tensor: np.ndarray, coord_starts: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, tensors: TensorTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each box (rows of flat ``offsets``/``lengths`` with ``coord_starts``, box i a
    box of tensor ``tensor[i]``): (first flat index, last flat index, non-empty). The
    flat span of a box contains every element of it, so two boxes that share an
    element have meeting spans. Boxes must lie inside their tensors (validated rows);
    a box with another number of dimensions than its tensor counts as empty (only a
    writer given such rows meets one: readers refuse them before)."""
    n = len(tensor)
    stride, t_starts = tensors.arrays.strides, tensors.arrays.starts
    counts = np.diff(coord_starts)
    fits = counts == tensors.arrays.ndim[tensor]
    if not fits.all():
        keep = np.repeat(fits, counts)
        first, last, live = flat_spans(
            tensor[fits],
            np.concatenate([[0], np.cumsum(counts[fits])]),
            offsets[coord_starts[0] : coord_starts[-1]][keep],
            lengths[coord_starts[0] : coord_starts[-1]][keep],
            tensors,
        )
        out = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
        out[0][fits], out[1][fits], out[2][fits] = first, last, live
        return out
    base = coord_starts[0]
    d = _uniform(coord_starts)
    if d is not None:  # every box has d dimensions: matrices, row sums
        return _flat_spans_uniform(tensor, offsets[base : base + n * d], lengths[base : base + n * d], d, tensors)
    step = np.arange(int(coord_starts[-1]) - int(coord_starts[0]), dtype=np.int64) - np.repeat(
        coord_starts[:-1] - coord_starts[0], counts
    )
    row_of = np.repeat(np.arange(n), counts)
    s = stride[t_starts[tensor[row_of]] + step]
    o = offsets[base : base + len(step)]
    ln = lengths[base : base + len(step)]
    first = np.zeros(n, dtype=np.int64)
    last = np.zeros(n, dtype=np.int64)
    np.add.at(first, row_of, o * s)
    np.add.at(last, row_of, (o + ln - 1) * s)
    live = np.ones(n, dtype=bool)
    live[row_of[ln <= 0]] = False
    return first, last, live


def _flat_spans_uniform(
    tensor: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, d: int, tensors: TensorTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`flat_spans` of n boxes of d dimensions each (boxes of their tensors' rank):
    the same integer sums, one dimension at a time instead of scattered adds."""
    n = len(tensor)
    first, last, live = np.zeros(n, np.int64), np.zeros(n, np.int64), np.ones(n, dtype=bool)
    base = tensors.arrays.starts[tensor]
    for k in range(d):
        s = tensors.arrays.strides[base + k]
        o, ln = offsets[k::d], lengths[k::d]
        first += o * s
        last += (o + ln - 1) * s
        live &= ln > 0
    return first, last, live


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")``; small non-negative keys are sorted as
    uint16 (a radix sort, same order)."""
    if len(keys) and int(keys.min()) >= 0 and int(keys.max()) < 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    return np.argsort(keys, kind="stable")


def section_spans(rows: Rows, tensors: TensorTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tensor, first, last) for every tensor with rows in ``rows``, ascending by tensor:
    the hull of its non-empty fragments' flat spans, EMPTY_SPAN when all are empty."""
    first, last, live = flat_spans(rows.tensor, rows.coord_starts, rows.offsets, rows.lengths, tensors)
    order = stable_order(rows.tensor)
    t = rows.tensor[order]
    if not len(t):
        z = np.zeros(0, np.int64)
        return z, z, z
    starts = np.flatnonzero(np.concatenate([[True], t[1:] != t[:-1]]))
    big = np.iinfo(np.int64).max
    lo = np.minimum.reduceat(np.where(live[order], first[order], big), starts)
    hi = np.maximum.reduceat(np.where(live[order], last[order], -1), starts)
    empty = hi < 0
    lo[empty], hi[empty] = EMPTY_SPAN
    return t[starts].astype(np.int64), lo, hi


# -- writing ---------------------------------------------------------------------------


def encode(tensors: TensorTable, file_names: Sequence[str], rows: Rows) -> bytes:
    """Catalog v2 bytes for ``rows``: sections by runs of writers, head, trailer.

    Only each writer's rows in order matter, not how writers interleave: rows already
    grouped by writer (a save's commit) give the same bytes, sliced instead of gathered."""
    grouped = _ascending(rows.writer)
    order = np.arange(len(rows)) if grouped else stable_order(rows.writer)  # by writer, save order inside
    writers, per_writer = np.unique(rows.writer[order], return_counts=True)
    count = section_count(len(rows), len(writers))
    cum = np.cumsum(per_writer)
    # cut after the writer where the running row count first reaches k/count of the rows
    cuts = np.unique(np.searchsorted(cum, (np.arange(1, count) * len(rows)) // count, side="left") + 1)
    bounds = [0, *[int(c) for c in cuts if 0 < c < len(writers)], len(writers)]
    parts: list[bytes] = []
    table_rows: list[tuple[int, int, int, int, int, int]] = []
    spans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    offset = 0
    row_bounds = np.concatenate([[0], cum])
    widths = (
        {} if grouped else {id(a): w for a in (rows.coord_starts, rows.sum_starts) if (w := _uniform(a)) is not None}
    )
    for k in range(len(bounds) - 1):
        lo_w, hi_w = bounds[k], bounds[k + 1]
        lo_r, hi_r = int(row_bounds[lo_w]), int(row_bounds[hi_w])
        sub = _slice(rows, lo_r, hi_r) if grouped else _subset(rows, order[lo_r:hi_r], widths)
        data = _ipc_file(_table(tensors, file_names, sub, version=VERSION))
        parts.append(data)
        first_w = int(writers[lo_w]) if len(writers) else 0
        last_w = int(writers[hi_w - 1]) if len(writers) else 0
        table_rows.append((offset, len(data), crc32c(data), len(sub), first_w, last_w))
        offset += len(data)
        t, a, b = section_spans(sub, tensors)
        spans.append((np.full(len(t), k, np.int32), t.astype(np.int32), a, b))
    head = encode_head(tensors, table_rows, spans)
    trailer = TRAILER.pack(len(head), crc32c(head), 0, MAGIC)
    return b"".join([*parts, head, trailer])


def _ascending(keys: np.ndarray) -> bool:
    """Whether ``keys`` never decrease (then a stable sort by them changes nothing)."""
    return len(keys) < 2 or bool((keys[1:] >= keys[:-1]).all())


def _slice(rows: Rows, lo: int, hi: int) -> Rows:
    """Rows ``lo:hi`` of ``rows`` (views, list starts rebased to 0)."""
    c0, c1 = int(rows.coord_starts[lo]), int(rows.coord_starts[hi])
    s0, s1 = int(rows.sum_starts[lo]), int(rows.sum_starts[hi])
    return Rows(
        tensor=rows.tensor[lo:hi],
        coord_starts=rows.coord_starts[lo : hi + 1] - c0,
        offsets=rows.offsets[c0:c1],
        lengths=rows.lengths[c0:c1],
        byte_offset=rows.byte_offset[lo:hi],
        nbytes=rows.nbytes[lo:hi],
        file=rows.file[lo:hi],
        writer=rows.writer[lo:hi],
        sum_starts=rows.sum_starts[lo : hi + 1] - s0,
        sums=rows.sums[s0:s1],
    )


def _uniform(starts: np.ndarray) -> int | None:
    """d when every row of a starts array holds d values, else None."""
    n = len(starts) - 1
    total = int(starts[-1] - starts[0]) if n >= 0 else 0
    if n <= 0 or total % n:
        return None
    d = total // n
    return d if bool((np.diff(starts) == d).all()) else None


def _subset(rows: Rows, idx: np.ndarray, widths: dict[int, int] | None = None) -> Rows:
    """Rows ``idx`` of ``rows``. ``widths``: id of a starts array -> the number of
    values every row holds in it (see :func:`_uniform`), for a faster gather."""
    widths = widths or {}

    def gather(starts: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = widths.get(id(starts))
        if d is not None:  # every row holds d values: a matrix gather
            n = len(starts) - 1
            block = values[int(starts[0]) : int(starts[0]) + n * d].reshape(n, d)[idx]
            return np.arange(len(idx) + 1, dtype=np.int64) * d, block.reshape(-1)
        counts = starts[idx + 1] - starts[idx]
        new = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        pos = np.repeat(starts[idx] - new[:-1], counts) + np.arange(int(new[-1]), dtype=np.int64)
        return new, values[pos]

    coord_starts, offs = gather(rows.coord_starts, rows.offsets)
    _same, lens = gather(rows.coord_starts, rows.lengths)
    sum_starts, sums = gather(rows.sum_starts, rows.sums)
    return Rows(
        tensor=rows.tensor[idx],
        coord_starts=coord_starts,
        offsets=offs,
        lengths=lens,
        byte_offset=rows.byte_offset[idx],
        nbytes=rows.nbytes[idx],
        file=rows.file[idx],
        writer=rows.writer[idx],
        sum_starts=sum_starts,
        sums=sums,
    )


def encode_head(
    tensors: TensorTable,
    sections: Sequence[tuple[int, int, int, int, int, int]],
    spans: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> bytes:
    ndim = np.array([len(s) for s in tensors.shapes], dtype=np.int64)
    shape_type = TENSORS_SCHEMA.field("global_shape").type
    t_table = pa.Table.from_arrays(
        [
            pa.array(tensors.names, pa.string()),
            _dict(tensors.key_paths),
            _dict(tensors.dtypes),
            pa.ListArray.from_arrays(
                pa.array(np.concatenate([np.zeros(1, np.int64), np.cumsum(ndim)]).astype(np.int32)),
                pa.array(np.fromiter((d for s in tensors.shapes for d in s), np.int64), pa.int64()),
                type=shape_type,
            ),
        ],
        names=TENSORS_SCHEMA.names,
    ).replace_schema_metadata(TENSORS_SCHEMA.metadata)
    s_table = pa.Table.from_arrays(
        [pa.array([row[i] for row in sections], f.type) for i, f in enumerate(SECTIONS_SCHEMA)], schema=SECTIONS_SCHEMA
    )
    cat = [np.concatenate([s[i] for s in spans]) if spans else np.zeros(0) for i in range(4)]
    p_table = pa.Table.from_arrays(
        [pa.array(c, f.type) for c, f in zip(cat, SPANS_SCHEMA, strict=True)], schema=SPANS_SCHEMA
    )
    parts = [_ipc_file(t) for t in (t_table, s_table, p_table)]
    return HEAD_PREFIX.pack(*(len(p) for p in parts)) + b"".join(parts)


def _dict(values: Sequence[str]) -> pa.Array:
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), np.int32, len(values))
    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(list(index), pa.string()))


# -- reading ---------------------------------------------------------------------------


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


def read_trailer(tail: bytes, file_size: int, where: str) -> tuple[int, int]:
    """(head offset, head CRC32C) from the last TRAILER.size bytes of a v2 catalog of
    ``file_size`` bytes, bounds-checked."""
    if file_size < TRAILER.size or len(tail) < TRAILER.size:
        raise FormatError(f"{where}: {file_size} bytes is too short for a v2 catalog")
    head_len, head_crc, reserved, magic = TRAILER.unpack(tail[-TRAILER.size :])
    if magic != MAGIC:
        raise FormatError(f"{where}: not a v2 catalog (trailer magic {magic!r})")
    if reserved != 0:
        raise FormatError(f"{where}: reserved trailer field is {reserved}, not 0")
    if not HEAD_PREFIX.size <= head_len <= file_size - TRAILER.size:
        raise FormatError(f"{where}: head length {head_len} is impossible for a {file_size}-byte catalog")
    return file_size - TRAILER.size - head_len, head_crc


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
    tensors = _tensor_table(t_table, where)

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
    numel = np.array([math.prod(s) for s in tensors.shapes] or [0], dtype=np.int64)  # < 2**62 (checked)
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
        if c.null_count:
            raise FormatError(f"{where}: null values")
        columns.append(c)
    return pa.Table.from_arrays(columns, names=schema.names)


def _tensor_table(table: pa.Table, where: str) -> TensorTable:
    fqn_codes, fqn_values = _codes(table.column("fqn"), where)
    kp_codes, kp_values = _codes(table.column("key_path"), where)
    dt_codes, dt_values = _codes(table.column("dtype"), where)
    if len(fqn_values) != table.num_rows:
        raise FormatError(f"{where}: the catalog's tensor table names a tensor twice")
    shape_col = table.column("global_shape").combine_chunks()
    starts = shape_col.offsets.to_numpy().astype(np.int64)
    flat = shape_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    starts -= starts[0]
    if (flat < 0).any():
        raise FormatError(f"{where}: the catalog's tensor table holds a negative dimension")
    sizes = np.array([itemsize_or_zero(d) for d in dt_values], dtype=np.int64)
    if table.num_rows and (sizes[dt_codes] == 0).any():
        i = int(np.flatnonzero(sizes[dt_codes] == 0)[0])
        raise FormatError(f"{where}: tensor {fqn_values[fqn_codes[i]]!r}: unknown dtype {dt_values[dt_codes[i]]!r}")
    tensors = TensorTable()
    for i, (f, k, d, s0, s1) in enumerate(
        zip(
            fqn_codes.tolist(),
            kp_codes.tolist(),
            dt_codes.tolist(),
            starts[:-1].tolist(),
            starts[1:].tolist(),
            strict=True,
        )
    ):
        shape = tuple(flat[s0:s1].tolist())
        if float(math.prod(shape)) * int(sizes[d]) >= MAX_TENSOR_BYTES:
            raise FormatError(f"{where}: tensor {fqn_values[f]!r} is larger than {MAX_TENSOR_BYTES} bytes")
        tensors.add(fqn_values[f], kp_values[k], dt_values[d], shape)
        assert tensors.index[fqn_values[f]] == i
    return tensors


Fetch = Callable[[int, int], bytes]
