"""The fragment catalog: one row per stored fragment of a global tensor (fragments.arrow).

Pure data: knows the format, not torch, not storage. The engine builds
:class:`Fragment` rows while saving and asks the :class:`Catalog` where bytes live
while loading.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute  # binds pa.compute

from .dtypes import itemsize
from .errors import FormatError

CATALOG_SCHEMA = pa.schema(
    [
        pa.field("fqn", pa.string(), nullable=False),
        pa.field("key_path", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("global_shape", pa.list_(pa.int64()), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("lengths", pa.list_(pa.int64()), nullable=False),
        pa.field("file", pa.string(), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("checksums", pa.list_(pa.uint32()), nullable=False),
        pa.field("writer_rank", pa.int32(), nullable=False),
    ],
    metadata={"bcp.catalog.version": "1"},
)


@dataclasses.dataclass(frozen=True, slots=True)
class Fragment:
    """A box of a global tensor stored as row-major bytes at ``file[byte_offset:+nbytes]``."""

    fqn: str
    #: JSON list of [container-kind, key] pairs locating the tensor in the nested state.
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    #: Start of the box in each dimension of the global tensor.
    offsets: tuple[int, ...]
    #: Extent of the box in each dimension.
    lengths: tuple[int, ...]
    #: Data object key, relative to the checkpoint root.
    file: str
    byte_offset: int
    nbytes: int
    #: CRC32C of each checksum block of the fragment's bytes (block size in the manifest).
    checksums: tuple[int, ...]
    writer_rank: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """Everything the catalog knows about one global tensor."""

    fqn: str
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    fragments: tuple[Fragment, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * itemsize(self.dtype)


def _entry(fqn: str, frags: list[Fragment]) -> TensorEntry:
    first = frags[0]
    for f in frags[1:]:
        if (f.dtype, f.global_shape, f.key_path) != (first.dtype, first.global_shape, first.key_path):
            raise FormatError(
                f"catalog: fragments of {fqn!r} disagree on dtype/shape/path: "
                f"{first.dtype}{list(first.global_shape)} vs {f.dtype}{list(f.global_shape)}"
            )
    return TensorEntry(fqn, first.key_path, first.dtype, first.global_shape, tuple(frags))


class _LazyTensors(Mapping):
    """fqn -> TensorEntry over an Arrow table: rows become Python objects only for the
    tensors a reader asks for (a rank loading its shards of a 4,096-rank checkpoint
    touches a small part of the catalog)."""

    def __init__(self, table: pa.Table) -> None:
        self._table = table
        fqn = table.column("fqn").combine_chunks()
        if not isinstance(fqn.type, pa.DictionaryType):
            fqn = fqn.dictionary_encode()
        codes = fqn.indices.to_numpy(zero_copy_only=False)
        names = fqn.dictionary.to_pylist()
        order = np.argsort(codes, kind="stable")
        starts = np.searchsorted(codes[order], np.arange(len(names) + 1))
        first_row = {int(c): int(order[starts[c]]) for c in range(len(names)) if starts[c] < starts[c + 1]}
        # fqn -> row indices, in the order tensors first appear in the file
        self._rows = {names[c]: order[starts[c] : starts[c + 1]] for c in sorted(first_row, key=first_row.__getitem__)}
        self._cache: dict[str, TensorEntry] = {}

    def __getitem__(self, fqn: str) -> TensorEntry:
        entry = self._cache.get(fqn)
        if entry is None:
            rows = self._rows[fqn]  # KeyError for an unknown tensor, as a dict would
            entry = self._cache[fqn] = _entry(fqn, _fragments(self._table.take(pa.array(rows))))
        return entry

    def __iter__(self):
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._rows


class Catalog:
    """All fragments of a checkpoint, indexed by tensor (``tensors``: fqn -> TensorEntry)."""

    def __init__(self, fragments: Iterable[Fragment]) -> None:
        self._fragments: list[Fragment] | None = list(fragments)
        self._table: pa.Table | None = None
        grouped: dict[str, list[Fragment]] = {}
        for f in self._fragments:
            grouped.setdefault(f.fqn, []).append(f)
        self.tensors: Mapping[str, TensorEntry] = {fqn: _entry(fqn, frags) for fqn, frags in grouped.items()}

    @classmethod
    def _from_table(cls, table: pa.Table) -> Catalog:
        self = cls.__new__(cls)
        self._fragments, self._table = None, table
        self.tensors = _LazyTensors(table)
        return self

    @property
    def fragments(self) -> list[Fragment]:
        if self._fragments is None:
            self._fragments = _fragments(self._table)
        return self._fragments

    def __len__(self) -> int:
        if self._fragments is None and self._table is not None:
            return self._table.num_rows
        return len(self.fragments)

    # -- Arrow IPC -----------------------------------------------------------------------

    def to_arrow(self) -> bytes:
        """Arrow IPC file bytes: string columns dictionary-encoded, buffers zstd-compressed
        (about 15 bytes per fragment for FSDP-like catalogs, 14x less than plain)."""
        frags = self.fragments
        columns = []
        for field in CATALOG_SCHEMA:
            values = [getattr(f, field.name) for f in frags]
            array = pa.array(values, type=field.type)
            if field.name in _DICTIONARY_COLUMNS:
                array = array.dictionary_encode()
            columns.append(array)
        table = pa.Table.from_arrays(columns, names=CATALOG_SCHEMA.names)
        table = table.replace_schema_metadata(CATALOG_SCHEMA.metadata)
        sink = pa.BufferOutputStream()
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_arrow(cls, data: bytes, *, where: str, checksum_block_bytes: int) -> Catalog:
        try:
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{where}: not a readable Arrow IPC file: {e}") from e
        missing = [n for n in CATALOG_SCHEMA.names if n not in table.column_names]
        if missing:
            raise FormatError(f"{where}: missing column(s) {', '.join(missing)}")
        try:
            table = table.select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise FormatError(f"{where}: columns do not have the catalog types: {e}") from e
        if table.num_rows and any(table.column(n).null_count for n in CATALOG_SCHEMA.names):
            raise FormatError(f"{where}: null values in the catalog")
        _validate_table(table, where=where, checksum_block_bytes=checksum_block_bytes)
        catalog = cls._from_table(table)
        _check_consistent(table, where)
        return catalog


def _fragments(table: pa.Table) -> list[Fragment]:
    cols = [table.column(name).to_pylist() for name in CATALOG_SCHEMA.names]
    for i, name in enumerate(CATALOG_SCHEMA.names):
        if name in _TUPLE_COLUMNS:
            cols[i] = [tuple(v) for v in cols[i]]
    return [Fragment(*row) for row in zip(*cols, strict=True)]


def _check_consistent(table: pa.Table, where: str) -> None:
    """Every fragment of one tensor agrees on dtype, shape and key path (vectorised)."""
    if table.num_rows == 0:
        return
    keys = pa.table(
        {
            "fqn": table.column("fqn"),
            "dtype": table.column("dtype"),
            "key_path": table.column("key_path"),
            "shape": pa.compute.binary_join(pa.compute.cast(table.column("global_shape"), pa.list_(pa.string())), ","),
        }
    )
    distinct = keys.group_by(["fqn", "dtype", "key_path", "shape"]).aggregate([])
    if distinct.num_rows != keys.group_by(["fqn"]).aggregate([]).num_rows:
        counts = distinct.group_by(["fqn"]).aggregate([([], "count_all")])
        fqn = counts.filter(pa.compute.greater(counts.column("count_all"), 1)).column("fqn")[0].as_py()
        raise FormatError(f"{where}: fragments of {fqn!r} disagree on dtype/shape/path")


_DICTIONARY_COLUMNS = frozenset({"fqn", "key_path", "dtype", "file"})
_TUPLE_COLUMNS = frozenset({"global_shape", "offsets", "lengths", "checksums"})


def _validate_table(table: pa.Table, *, where: str, checksum_block_bytes: int) -> None:
    """Vectorised form of validate_fragment over every row; the error names the first bad row."""
    n = table.num_rows
    if n == 0:
        return

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(name).combine_chunks()
        return col.values.to_numpy(zero_copy_only=False), np.diff(col.offsets.to_numpy())

    shape, ndim = flat("global_shape")
    offs, n_off = flat("offsets")
    lens, n_len = flat("lengths")
    bad = (n_off != ndim) | (n_len != ndim)
    if not bad.any():
        row_of = np.repeat(np.arange(n), ndim)
        outside = (offs < 0) | (lens < 0) | (shape < 0) | (offs + lens > shape)
        bad = np.zeros(n, bool)
        np.logical_or.at(bad, row_of[outside], True)
        sizes = np.array([itemsize_or_zero(d) for d in table.column("dtype").to_pylist()], dtype=np.int64)
        numel = np.ones(n, dtype=np.int64)
        np.multiply.at(numel, row_of, lens)
        nbytes = table.column("nbytes").to_numpy()
        bad |= (sizes == 0) | (nbytes != numel * sizes) | (table.column("byte_offset").to_numpy() < 0)
        _sums, n_sums = flat("checksums")
        bad |= n_sums != -(-nbytes // checksum_block_bytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        row = {name: table.column(name)[i].as_py() for name in CATALOG_SCHEMA.names}
        for name in _TUPLE_COLUMNS:
            row[name] = tuple(row[name])
        validate_fragment(Fragment(**row), where=f"{where} row {i}", checksum_block_bytes=checksum_block_bytes)
        raise FormatError(f"{where} row {i} ({row['fqn']!r}): inconsistent fragment")


def itemsize_or_zero(dtype: str) -> int:
    try:
        return itemsize(dtype)
    except ValueError:
        return 0


def validate_fragment(f: Fragment, *, where: str, checksum_block_bytes: int) -> None:
    """Raise FormatError unless the row is self-consistent (box inside the tensor,
    byte count matching the box, one checksum per block)."""
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
    if f.nbytes != math.prod(f.lengths) * size:
        raise FormatError(f"{where} ({f.fqn!r}): nbytes {f.nbytes} does not match box {list(f.lengths)} of {f.dtype}")
    if f.byte_offset < 0:
        raise FormatError(f"{where} ({f.fqn!r}): negative byte offset {f.byte_offset}")
    blocks = -(-f.nbytes // checksum_block_bytes)
    if len(f.checksums) != blocks:
        raise FormatError(f"{where} ({f.fqn!r}): {len(f.checksums)} checksums for {blocks} blocks")


def boxes_cover_exactly(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether the (offsets, lengths) boxes tile ``shape`` with no gap and no overlap,
    counting identical boxes once (replicas)."""
    unique = {(tuple(o), tuple(n)) for o, n in boxes}
    total = math.prod(shape)
    if sum(math.prod(n) for _o, n in unique) != total:
        return False
    items = sorted(unique)
    for i, (oa, na) in enumerate(items):
        for ob, nb in items[i + 1 :]:
            if (
                all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(oa, na, ob, nb, strict=True))
                and math.prod(na) != 0
                and math.prod(nb) != 0
            ):
                return False
    return True
