"""The coordinator's side of a commit: every writer's fragment rows, merged as columns.

Writers report their rows as Arrow tables (``WriterReport.rows``: a tensor index into
the rank's layout metadata, the box, where its bytes lie, their checksums). At 1,024
ranks x 2,000 tensors that is 2 M rows: they are concatenated, ordered and counted
with Arrow and numpy (sort indices), never one Python object per row, and encoded as
the catalog straight from those numpy columns (no Catalog is built on the way).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bcp.metadata import CATALOG_SCHEMA, FileEntry, FormatError, Fragment
from bcp.metadata.catalog import TensorTable
from bcp.metadata.catalog.arrow import rows_table as _table
from bcp.metadata.catalog.sections import encode
from bcp.metadata.catalog.sections import subset as _subset
from bcp.metadata.geometry import stable_order
from bcp.metadata.rows import Rows
from bcp.planning.local_layout import LayoutMeta, TensorPlan

#: The columns of a writer's report: a catalog row without what the coordinator
#: knows from the rank's layout metadata (``tensor`` indexes it) or from the report
#: itself (file, writer rank). About 60 bytes a row instead of 230.
REPORT_SCHEMA = pa.schema(
    [
        pa.field("tensor", pa.int32(), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("lengths", pa.list_(pa.int64()), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("checksums", pa.list_(pa.uint32()), nullable=False),
    ]
)


def report_rows(
    checksums: Mapping[tuple[int, int], list[int]],
    unique: Sequence[int],
    offsets: Sequence[int],
    source: Sequence[int],
    items: Sequence[Any],
    item_nbytes: Sequence[int],
) -> tuple[pa.Table, list[int]]:
    """A data file's fragment rows (REPORT_SCHEMA, one per item in item order) and its
    checksums in file order, from the writers' block checksums by (item, byte offset in
    it) of the items with bytes of their own (``unique``; ``source``: the item whose bytes
    each item's are, ``offsets``: where each lies in the file); ``items``: the write items
    (``tensor`` index, ``piece.box``)."""
    # an item's first piece's list as it is; an item written in several pieces (cut between
    # batches or chunks: a few) joined in order of their starts
    sums_of = {item: sums for (item, start), sums in checksums.items() if not start}
    later: dict[int, list[tuple[int, list[int]]]] = {}
    for (item, start), sums in [(key, sums) for key, sums in checksums.items() if key[1]]:
        later.setdefault(item, [(0, sums_of[item])] if item in sums_of else []).append((start, sums))
    for item, parts in later.items():
        parts.sort()
        sums_of[item] = [c for _start, part in parts for c in part]
    in_file = sorted(unique, key=offsets.__getitem__)
    file_sums = list(itertools.chain.from_iterable(map(sums_of.get, in_file, itertools.repeat(()))))
    boxes = [item.piece.box for item in items]
    rows = pa.table(
        [
            pa.array(np.fromiter((item.tensor for item in items), np.int32, len(items))),
            pa.array([b[0] for b in boxes], pa.list_(pa.int64())),
            pa.array([b[1] for b in boxes], pa.list_(pa.int64())),
            pa.array([offsets[s] for s in source], pa.int64()),
            pa.array(item_nbytes, pa.int64()),
            pa.array(list(map(sums_of.get, source, itertools.repeat(()))), pa.list_(pa.uint32())),
        ],
        schema=REPORT_SCHEMA,
    )
    return rows, file_sums


@dataclasses.dataclass(frozen=True)
class WriterReport:
    """What one rank wrote: its fragment rows as an Arrow table (REPORT_SCHEMA; the
    coordinator merges every rank's tables with no Python object per row), its data
    file (None: nothing to write) and its rank."""

    rows: pa.Table
    file: FileEntry | None
    rank: int = 0
    #: this rank's tensors by index, for :attr:`fragments` (kept here: never sent)
    tensors: Mapping[int, TensorPlan] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    #: an incremental save's: (rows, 16) uint8, each row's XXH3-128 (the catalog's ``digest``)
    digests: np.ndarray | None = None
    #: an incremental save's: per row, the data file of a sibling it refers to ("": ``file``)
    row_files: tuple[str, ...] | None = None
    #: the referenced files (``checkpoint`` set; their crc32c is computed at commit)
    references: tuple[FileEntry, ...] = ()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "tensors": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def catalog_rows(self) -> pa.Table:
        """The rows in CATALOG_SCHEMA's columns (on the writer, which knows its tensors)."""
        plans = [self.tensors[i] for i in self.rows.column("tensor").to_pylist()]
        n = len(plans)
        columns = {
            "fqn": pa.array([t.fqn for t in plans], pa.string()),
            "key_path": pa.array([t.key_path for t in plans], pa.string()),
            "dtype": pa.array([t.dtype for t in plans], pa.string()),
            "global_shape": pa.array([t.global_shape for t in plans], pa.list_(pa.int64())),
            "file": pa.array(self.paths(n), pa.string()),
            "writer_rank": pa.array(np.full(n, self.rank, np.int32)),
        }
        columns.update(
            {name: self.rows.column(name) for name in ("offsets", "lengths", "byte_offset", "nbytes", "checksums")}
        )
        return pa.table([columns[name] for name in CATALOG_SCHEMA.names], schema=CATALOG_SCHEMA)

    def paths(self, n: int) -> list[str]:
        """Each of ``n`` rows' data file path."""
        own = self.file.path if self.file is not None else ""
        if self.row_files is None:
            return [own] * n
        return [p or own for p in self.row_files]

    @property
    def fragments(self) -> list[Fragment]:
        """The rows as Fragment objects (for tests and tools; the save keeps the table)."""
        return self.fragments_of(self.catalog_rows())

    @staticmethod
    def fragments_of(table: pa.Table) -> list[Fragment]:
        """Rows in CATALOG_SCHEMA's columns (strings plain or dictionary-encoded) as Fragments."""
        table = table.select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        columns = [table.column(name).to_pylist() for name in CATALOG_SCHEMA.names]
        columns = [
            [tuple(v) for v in c] if isinstance(t, pa.ListType) else c
            for c, t in zip(columns, CATALOG_SCHEMA.types, strict=True)
        ]
        return [Fragment(*row) for row in zip(*columns, strict=True)]


def fragment_table(fragments: Sequence[Fragment]) -> pa.Table:
    """Fragment objects as a table in CATALOG_SCHEMA's columns."""
    return pa.table(
        {
            field.name: pa.array([getattr(f, field.name) for f in fragments], type=field.type)
            for field in CATALOG_SCHEMA
        },
        schema=CATALOG_SCHEMA,
    )


def padded_boxes(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A list<int64> column as an int64 (rows, max length + 1) matrix: the values,
    zero-padded on the right, then the length of each list (so [0] and [0, 0] differ)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    starts = array.offsets.to_numpy().astype(np.int64)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return _boxes(starts - starts[0], values)


def packed_key(keys: Sequence[np.ndarray]) -> np.ndarray | None:
    """``keys`` (int64 columns, most significant first) packed into one int64 per row,
    in the same order and with the same ties; None when there are no rows, a key is
    negative or together they need more than 63 bits."""
    n = len(keys[0])
    if not n or any(int(k.min()) < 0 for k in keys):
        return None
    bits = [int(k.max()).bit_length() for k in keys]
    if sum(bits) > 63:
        return None
    packed = np.zeros(n, dtype=np.int64)
    for k, b in zip(keys, bits, strict=True):
        packed <<= b
        packed |= k
    return packed


def sort_index(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Stable order of rows by ``keys`` (int64 columns, most significant first): one
    argsort of a packed int64 key when the columns fit in 63 bits, else np.lexsort."""
    packed = packed_key(keys)
    return np.lexsort(list(reversed(keys))) if packed is None else stable_order(packed)


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
    """Every writer's rows, the catalog's tensor table and file names, and the
    manifest's counts over the rows.

    ``rows`` are grouped by writer (ascending), each writer's rows in catalog order:
    the order the catalog's sections hold them in, so encoding slices, never gathers.
    ``catalog_order`` lists them in catalog order (save order, offsets, writer)."""

    tensors: TensorTable
    file_names: list[str]
    rows: Rows
    catalog_order: np.ndarray
    stats: dict[str, int]

    def catalog_bytes(self) -> bytes:
        """The catalog's bytes: those ``Catalog.from_table(self.table).to_arrow()`` gives,
        without decoding the rows back from Arrow and checking them row by row.

        Safe to skip: the rows are the writers' own (REPORT_SCHEMA tables this save's
        ranks produced), not read from storage. Of what ``Catalog.from_table`` checked,
        the column types and non-null strings hold by construction here, and every
        row agreeing with its tensor's dtype, shape and key path holds because those
        come from one table of tensors, not from the rows; its one real row check,
        offsets and lengths of equal length, :func:`merge_reports` keeps, and adds one
        (each box has its tensor's rank) that a reader would otherwise be first to
        make. Tiling was never checked at commit: the save's plan checks it."""
        return encode(self.tensors, self.file_names, self.rows)

    @functools.cached_property
    def table(self) -> pa.Table:
        """The rows in catalog order as a table in CATALOG_SCHEMA's columns, strings
        dictionary-encoded (built on demand: tests and tools; the commit needs none)."""
        return _table(self.tensors, self.file_names, _subset(self.rows, self.catalog_order))


def merge_reports(reports: Sequence[WriterReport], metas: Sequence[LayoutMeta], order: Sequence[str]) -> Merged:
    """Every writer's rows, ordered for the catalog (by writer, then the tensors' save
    order (``order``: FQNs), then the box offsets), and the manifest's counts.

    ``metas[r]`` is rank r's layout metadata: report rows name a tensor by its index
    there. The plan checked that ranks agree on each tensor's key path, dtype and shape,
    so the per-tensor columns come from one table of tensors, not from every row."""
    known, to_global = _tensor_info(metas, order)
    writing = [r for r in reports if r.rows.num_rows]
    if not writing:
        return Merged(TensorTable(), [], Rows.empty(), np.zeros(0, np.int64), _no_rows())
    rows = _concat(writing, [to_global[id(metas[r.rank])] for r in writing])
    offsets, lengths = _box_columns(rows.coord_starts, rows.offsets), _box_columns(rows.coord_starts, rows.lengths)
    _check_ranks(rows, offsets[-1], known)
    # one int64 per row for (tensor, offsets): equal keys are equal boxes of one tensor
    # (so of one rank, checked above): catalog order, and the counts compare only it
    key = packed_key([rows.tensor, *offsets[:-1]])
    writer = rows.writer - int(rows.writer.min())
    by_writer = sort_index([writer, key] if key is not None else [writer, rows.tensor, *offsets[:-1]])
    if not _is_identity(by_writer):
        rows = _subset(rows, by_writer)
        offsets, lengths = [c[by_writer] for c in offsets], [c[by_writer] for c in lengths]
        key = key[by_writer] if key is not None else None
    # stable, so rows of one (tensor, offsets) stay in writer order: the catalog order
    catalog_order = stable_order(key) if key is not None else sort_index([rows.tensor, *offsets[:-1]])
    present = np.bincount(rows.tensor, minlength=len(order)) > 0
    stats = _stats(
        rows.tensor,
        int(present.sum()),
        offsets,
        lengths,
        rows.file,
        rows.byte_offset,
        rows.nbytes,
        catalog_order,
        box_key=key,
    )
    infos = list(map(known.__getitem__, np.flatnonzero(present).tolist()))
    assert None not in infos, "every row's tensor is in its rank's layout metadata"
    tensors = TensorTable.of_distinct(infos)  # type: ignore[arg-type]  # none is None (above); names distinct (``order``)
    names = _file_paths(writing)
    index: dict[str, int] = {}  # each name once, in order of first use (as Arrow's dictionary_encode)
    remap = np.array([index.setdefault(n, len(index)) for n in names], dtype=np.int32)
    rows = dataclasses.replace(
        rows, tensor=((np.cumsum(present) - 1)[rows.tensor]).astype(np.int32), file=remap[rows.file]
    )
    return Merged(tensors, list(index), rows, catalog_order, stats)


def _file_paths(writing: Sequence[WriterReport]) -> list[str]:
    """The paths :func:`_concat`'s file codes stand for, in code order."""
    if any(r.row_files is not None or r.digests is not None for r in writing):
        paths = {r.file.path: None for r in writing if r.file is not None}
        for r in writing:
            paths.update(dict.fromkeys(p for p in r.row_files or () if p))
        return list(paths)
    return [r.file.path if r.file is not None else "" for r in writing]


TensorInfo = tuple[str, str, str, tuple[int, ...]]


def _tensor_info(
    metas: Sequence[LayoutMeta], order: Sequence[str]
) -> tuple[list[TensorInfo | None], dict[int, np.ndarray]]:
    """(fqn, key path, dtype, shape) by save-order position, and for each distinct
    layout metadata (by id) its tensors' positions."""
    position = {name: i for i, name in enumerate(order)}
    known: list[TensorInfo | None] = [None] * len(order)
    to_global: dict[int, np.ndarray] = {}
    for meta in {id(m): m for m in metas}.values():
        ids = np.fromiter(map(position.__getitem__, meta.fqns), np.int64, len(meta.fqns))
        to_global[id(meta)] = ids
        infos = zip(meta.fqns, meta.key_paths, meta.dtypes, map(tuple, meta.shapes), strict=True)
        if len(to_global) == 1 and len(ids) == len(order) and (ids == np.arange(len(ids))).all():
            known = list(infos)  # the first rank's tensors in save order (one rank, the usual): as they are
            continue
        for g, info in zip(ids.tolist(), infos, strict=True):
            if known[g] is None:
                known[g] = info
    return known, to_global


def _concat(writing: Sequence[WriterReport], to_global: Sequence[np.ndarray]) -> Rows:
    """The reports' rows back to back as numpy columns: ``tensor`` holds save-order
    positions, ``file`` the report's index in ``writing``, ``writer`` its rank."""
    table = pa.concat_tables([r.rows for r in writing])
    coord_starts, offsets = _listed(table.column("offsets"), np.int64)
    len_starts, lengths = _listed(table.column("lengths"), np.int64)
    if not np.array_equal(coord_starts, len_starts):
        i = int(np.flatnonzero(coord_starts != len_starts)[0]) - 1
        raise FormatError(f"commit: fragment row {i}: offsets and lengths differ in length")
    sum_starts, sums = _listed(table.column("checksums"), np.uint32)
    sizes = np.array([r.rows.num_rows for r in writing], dtype=np.int64)
    file = np.repeat(np.arange(len(writing), dtype=np.int32), sizes)
    digests = None
    if any(r.row_files is not None or r.digests is not None for r in writing):
        # an incremental save: rows may name other checkpoints' files, and carry digests
        code = {p: i for i, p in enumerate(_file_paths(writing))}
        file = np.concatenate([np.array([code[p] for p in r.paths(r.rows.num_rows)], np.int32) for r in writing])
        digests = np.concatenate(
            [r.digests if r.digests is not None else np.zeros((r.rows.num_rows, 16), np.uint8) for r in writing]
        )
    return Rows(
        tensor=np.concatenate([g[r.rows.column("tensor").to_numpy()] for r, g in zip(writing, to_global, strict=True)]),
        coord_starts=coord_starts,
        offsets=offsets,
        lengths=lengths,
        byte_offset=_column(table, "byte_offset", np.int64),
        nbytes=_column(table, "nbytes", np.int64),
        file=file,
        writer=np.repeat(np.array([r.rank for r in writing], dtype=np.int32), sizes),
        sum_starts=sum_starts,
        sums=sums,
        digests=digests,
    )


def _listed(column: pa.ChunkedArray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (per-row starts from 0, int64; flat values)."""
    array = column.combine_chunks()
    starts = array.offsets.to_numpy().astype(np.int64)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return starts - starts[0], values


def _column(table: pa.Table, name: str, dtype: type) -> np.ndarray:
    return table.column(name).combine_chunks().to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _check_ranks(rows: Rows, ndim: np.ndarray, known: Sequence[TensorInfo | None]) -> None:
    """Every box (``ndim``: its dimensions) has as many dimensions as its tensor: a
    writer bug that broke this would commit a catalog no reader accepts (the one row
    check ``Catalog.from_table`` made at commit, offsets against lengths, is in
    :func:`_concat`)."""
    t_ndim = np.array([len(k[3]) if k is not None else -1 for k in known], dtype=np.int64)
    bad = ndim != t_ndim[rows.tensor]
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        info = known[int(rows.tensor[i])]
        name = info[0] if info is not None else "?"
        raise FormatError(
            f"commit: rank {int(rows.writer[i])} reported a box of {int(ndim[i])} dimension(s) "
            f"for {name!r} of {int(t_ndim[rows.tensor[i]])}"
        )


def _is_identity(order: np.ndarray) -> bool:
    return bool((order == np.arange(len(order))).all())


def _boxes(starts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Flat list values with per-row ``starts`` as :func:`padded_boxes` gives them."""
    ndim = np.diff(starts)
    n = len(ndim)
    width = int(ndim.max()) if n else 0
    out = np.zeros((n, width + 1), dtype=np.int64)
    out[:, width] = ndim
    if len(values):
        if int(ndim.min()) == width:  # one rank of tensor: a plain reshape
            out[:, :width] = values[: n * width].reshape(n, width)
        else:
            of_row = np.repeat(ndim, ndim)  # each value's list length
            for d in np.unique(ndim).tolist():
                if d:
                    out[ndim == d, :d] = values[of_row == d].reshape(-1, d)
    return out


def _box_columns(starts: np.ndarray, values: np.ndarray) -> list[np.ndarray]:
    """The columns of :func:`_boxes` (the last: each list's length); views into
    ``values`` when every list has the same length, not a padded copy."""
    ndim = np.diff(starts)
    n = len(ndim)
    width = int(ndim.max()) if n else 0
    if n and int(ndim.min()) == width:
        return [*(values[d : n * width : width] for d in range(width)), ndim]
    return list(_boxes(starts, values).T)


def row_stats(table: pa.Table) -> dict[str, int]:
    """The manifest's counts over the rows (vectorised): distinct tensors; distinct
    stored fragments (file, byte offset, box: a tied tensor's row shares its target's
    bytes); tensor bytes counting each (tensor, box) once."""
    if table.num_rows == 0:
        return _no_rows()
    fqn = table.column("fqn").combine_chunks().dictionary_encode()
    codes = fqn.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = list(padded_boxes(table.column("offsets")).T)
    lengths = list(padded_boxes(table.column("lengths")).T)
    file = table.column("file").combine_chunks().dictionary_encode().indices
    return _stats(
        codes,
        len(fqn.dictionary),
        offsets,
        lengths,
        file.to_numpy(zero_copy_only=False).astype(np.int64),
        _column(table, "byte_offset", np.int64),
        _column(table, "nbytes", np.int64),
    )


def _no_rows() -> dict[str, int]:
    return {"tensors": 0, "fragments": 0, "tensor_bytes": 0}


def _stats(
    codes: np.ndarray,
    tensors: int,
    offsets: Sequence[np.ndarray],
    lengths: Sequence[np.ndarray],
    file: np.ndarray,
    byte_offset: np.ndarray,
    nbytes: np.ndarray,
    by_box: np.ndarray | None = None,
    *,
    box_key: np.ndarray | None = None,
) -> dict[str, int]:
    """The counts of :func:`row_stats` (``offsets``, ``lengths``: the columns of
    :func:`padded_boxes`; ``file``: a code per row, 0, 1, ...). ``by_box``: an order of
    the rows in which rows with equal (tensor, offsets) are adjacent (the catalog
    order), so only the rows of such runs need comparing in full; else one is sorted
    here. ``box_key``: one int64 per row, equal exactly when (tensor, offsets) are."""
    nd = len(offsets)
    box = [*offsets, *lengths[:-1]]
    # Distinct stored fragments. Rows sharing (file, byte offset) are few (tied tensors,
    # empty items); only those are compared box for box. Writers place items at rising
    # offsets, so in report order equal pairs are usually adjacent already.
    order = None if _adjacent(file, byte_offset) else sort_index([file, byte_offset])
    group, rows = _runs([file, byte_offset], order)
    fragments = len(file) - len(rows)
    if len(rows):  # distinct boxes within each run of rows sharing (file, byte offset)
        fragments += len(_distinct([group, *(k[rows] for k in box)]))
    # Tensor bytes: each (tensor, box) once. Empty boxes add nothing, so only rows
    # holding bytes are compared.
    by_box = by_box if by_box is not None else sort_index([codes, *box])
    same_box = [box_key] if box_key is not None else [codes, *box[:nd]]
    group, rows = _runs(same_box, by_box[nbytes[by_box] > 0])
    tensor_bytes = int(nbytes.sum()) - int(nbytes[rows].sum())
    if len(rows):
        tensor_bytes += int(nbytes[rows][_distinct([group, *(k[rows] for k in box[nd:])])].sum())
    return {"tensors": tensors, "fragments": fragments, "tensor_bytes": tensor_bytes}


def _runs(keys: Sequence[np.ndarray], order: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The rows whose ``keys`` equal those of a neighbour in ``order`` (an order in which
    equal keys are adjacent; None: the rows' own), and for each a run number (0, 1,
    ...: rows with equal keys share it). Comparing only within runs keeps the keys
    short (packed sorts)."""
    empty = np.zeros(0, dtype=np.int64)
    n = len(keys[0]) if order is None else len(order)
    if n < 2:
        return empty, empty
    same = np.ones(n - 1, dtype=bool)
    for k in keys:
        s = k if order is None else k[order]
        same &= s[1:] == s[:-1]
    if not same.any():
        return empty, empty
    mark = np.zeros(n, dtype=bool)
    mark[1:] |= same
    mark[:-1] |= same
    starts = mark.copy()
    starts[1:] &= ~same  # the first row of each run
    at = np.flatnonzero(mark)
    run = np.cumsum(starts[at]) - 1
    return run.astype(np.int64), at if order is None else order[at]


def _adjacent(file: np.ndarray, byte_offset: np.ndarray) -> bool:
    """Whether each file's rows are one run with non-decreasing byte offsets (then
    equal (file, offset) pairs are adjacent in the rows' own order)."""
    n = len(file)
    if n < 2:
        return True
    step = file[1:] != file[:-1]
    if int(step.sum()) + 1 != int(np.count_nonzero(np.bincount(file))):  # file codes are 0, 1, ...
        return False
    return not (np.diff(byte_offset)[~step] < 0).any()
