"""Catalog v2 on storage: sections of rows per run of writers, then a small head (writing).

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

This module holds the layout's constants and schemas, recognises and reads the
trailer, and writes the layout; :mod:`.head` reads and checks the head, and
:mod:`.spans` computes the span index.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from bcp.metadata.catalog.arrow import ipc_file, rows_table
from bcp.metadata.catalog.spans import section_spans, uniform_width
from bcp.metadata.catalog.tensors import TensorTable, codes_of_first_use
from bcp.metadata.checksum import crc32c
from bcp.metadata.format_errors import FormatError
from bcp.metadata.geometry import stable_order
from bcp.metadata.rows import Rows

VERSION = "2"
MAGIC = b"BCPCAT2\x00"
#: head length (u64), head CRC32C (u32), reserved (u32, 0), magic (8 bytes)
TRAILER = struct.Struct("<QII8s")
#: head: its three parts' lengths (u64 each), then the parts (Arrow IPC files)
HEAD_PREFIX = struct.Struct("<QQQ")
#: a section holds at least this many rows unless the whole catalog is smaller
MIN_SECTION_ROWS = 4096

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


def section_count(rows: int, writers: int) -> int:
    """Sections for ``rows`` rows by ``writers`` writers: about sqrt(2 x writers), so
    that the index plus two sections stays small, with at least MIN_SECTION_ROWS rows
    each (one section for small saves), never more than writers."""
    if rows == 0 or writers <= 1:
        return 1
    return max(1, min(writers, rows // MIN_SECTION_ROWS, round(math.sqrt(2 * writers))))


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
        {}
        if grouped
        else {id(a): w for a in (rows.coord_starts, rows.sum_starts) if (w := uniform_width(a)) is not None}
    )
    for k in range(len(bounds) - 1):
        lo_w, hi_w = bounds[k], bounds[k + 1]
        lo_r, hi_r = int(row_bounds[lo_w]), int(row_bounds[hi_w])
        sub = _slice(rows, lo_r, hi_r) if grouped else subset(rows, order[lo_r:hi_r], widths)
        data = ipc_file(rows_table(tensors, file_names, sub, version=VERSION))
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
        digests=None if rows.digests is None else rows.digests[lo:hi],
    )


def subset(rows: Rows, idx: np.ndarray, widths: dict[int, int] | None = None) -> Rows:
    """Rows ``idx`` of ``rows`` (gathered; the writer's sections and a commit's merged
    rows are built with it). ``widths``: id of a starts array -> the number of
    values every row holds in it (see :func:`.spans.uniform_width`), for a faster gather."""
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
        digests=rows.take_digests(idx),
    )


def encode_head(
    tensors: TensorTable,
    sections: Sequence[tuple[int, int, int, int, int, int]],
    spans: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> bytes:
    ndim = np.fromiter(map(len, tensors.shapes), np.int64, len(tensors.shapes))
    shape_type = TENSORS_SCHEMA.field("global_shape").type
    t_table = pa.Table.from_arrays(
        [
            pa.array(tensors.names, pa.string()),
            _dict(tensors.key_paths),
            _dict(tensors.dtypes),
            pa.ListArray.from_arrays(
                pa.array(np.concatenate([np.zeros(1, np.int64), np.cumsum(ndim)]).astype(np.int32)),
                pa.array(np.fromiter(itertools.chain.from_iterable(tensors.shapes), np.int64), pa.int64()),
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
    parts = [ipc_file(t) for t in (t_table, s_table, p_table)]
    return HEAD_PREFIX.pack(*(len(p) for p in parts)) + b"".join(parts)


def _dict(values: Sequence[str]) -> pa.Array:
    """``values`` dictionary-encoded, each distinct string once in order of first use
    (from the table's lists, not its cached arrays, which a table edited in place would not follow)."""
    codes, index = codes_of_first_use(values)
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(list(index), pa.string()))
