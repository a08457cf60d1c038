"""The fragment catalog: one row per stored fragment of a global tensor (fragments.arrow).

Pure data: knows the format, not torch, not storage. The engine builds
:class:`Fragment` rows while saving and asks the :class:`Catalog` where bytes live
while loading.
"""

from __future__ import annotations

import dataclasses
import math
import struct
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

    def __init__(self, table: pa.Table, where: str) -> None:
        self._table, self._where = table, where
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
            sub = self._table.take(pa.array(rows))
            entry = _entry(fqn, _fragments(sub))
            ndim = len(entry.global_shape)
            offs = _flat_values(sub.column("offsets")).reshape(len(rows), ndim)
            lens = _flat_values(sub.column("lengths")).reshape(len(rows), ndim)
            problem = tiling_problem(entry.global_shape, offs, lens)
            if problem is not None:
                raise FormatError(f"{self._where}: tensor {fqn!r}: {problem}")
            self._cache[fqn] = entry
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
    def from_table(cls, table: pa.Table, *, where: str = "catalog") -> Catalog:
        """A catalog over rows already in Arrow form (a save's fragment reports, in
        CATALOG_SCHEMA's columns): no Fragment objects are built. The rows are the
        writer's own, not read from storage; ``where`` names them in errors."""
        missing = [n for n in CATALOG_SCHEMA.names if n not in table.column_names]
        if missing:
            raise ValueError(f"{where}: missing column(s) {', '.join(missing)}")
        return cls._from_table(table.select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA), where)

    @classmethod
    def _from_table(cls, table: pa.Table, where: str) -> Catalog:
        self = cls.__new__(cls)
        self._fragments, self._table = None, table
        self.tensors = _LazyTensors(table, where)
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
        columns = []
        for field in CATALOG_SCHEMA:
            if self._table is not None:
                array = self._table.column(field.name).combine_chunks()
                if isinstance(array.type, pa.DictionaryType):
                    array = array.cast(field.type)
            else:
                array = pa.array([getattr(f, field.name) for f in self.fragments], type=field.type)
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
        """Decode and validate catalog bytes (``where`` names the file in errors).

        Untrusted input: the Arrow messages are bounded before anything is decompressed
        (:func:`check_ipc_budget`), every row is validated, and every malformed input
        raises :class:`FormatError`, never an Arrow, arithmetic or lookup error."""
        if checksum_block_bytes <= 0:
            raise FormatError(f"{where}: checksum block size {checksum_block_bytes} is not positive")
        try:
            return cls._decode(data, where, checksum_block_bytes)
        except FormatError:
            raise
        except (pa.ArrowException, ArithmeticError, LookupError, TypeError, ValueError, RecursionError, EOFError) as e:
            raise FormatError(f"{where}: malformed catalog: {type(e).__name__}: {e}") from e

    @classmethod
    def _decode(cls, data: bytes, where: str, checksum_block_bytes: int) -> Catalog:
        budget = decode_budget(len(data))
        check_ipc_budget(data, where=where, budget=budget)
        try:
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
            table.validate(full=True)
        except (pa.ArrowException, OSError, EOFError) as e:
            raise FormatError(f"{where}: not a readable Arrow IPC file: {e}") from e
        missing = [n for n in CATALOG_SCHEMA.names if n not in table.column_names]
        if missing:
            raise FormatError(f"{where}: missing column(s) {', '.join(missing)}")
        table = table.select(CATALOG_SCHEMA.names)
        _check_expansion(table, where=where, budget=budget)
        try:
            table = table.cast(CATALOG_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise FormatError(f"{where}: columns do not have the catalog types: {e}") from e
        if table.num_rows and any(table.column(n).null_count for n in CATALOG_SCHEMA.names):
            raise FormatError(f"{where}: null values in the catalog")
        _validate_table(table, where=where, checksum_block_bytes=checksum_block_bytes)
        catalog = cls._from_table(table, where)
        _check_consistent(table, where)
        return catalog

    def check_files(self, file_sizes: Mapping[str, int], *, where: str) -> None:
        """Raise FormatError unless every fragment names a file of ``file_sizes`` (the
        manifest's data files: path -> bytes) and its bytes lie inside that file.
        With this, no read planned from the catalog can ask for more bytes than the
        manifest declares (vectorised; one pass over the catalog)."""
        if self._table is None:
            rows = [(f.fqn, f.file, f.byte_offset, f.nbytes) for f in self.fragments]
            for i, (fqn, file, off, n) in enumerate(rows):
                _check_in_file(where, i, fqn, file, off, n, file_sizes.get(file))
            return
        table = self._table
        if table.num_rows == 0:
            return
        files = table.column("file").combine_chunks().dictionary_encode()
        names = files.dictionary.to_pylist()
        declared = np.array([file_sizes.get(n, -1) for n in names], dtype=np.int64)
        size = declared[files.indices.to_numpy(zero_copy_only=False)]
        off = table.column("byte_offset").to_numpy()
        n = table.column("nbytes").to_numpy()
        bad = (size < 0) | (off > size - n)  # off, n >= 0 (validated), so size - n cannot overflow
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = {c: table.column(c)[i].as_py() for c in ("fqn", "file", "byte_offset", "nbytes")}
            fsize = file_sizes.get(row["file"])
            _check_in_file(where, i, row["fqn"], row["file"], row["byte_offset"], row["nbytes"], fsize)


def _check_in_file(where: str, i: int, fqn: str, file: str, off: int, n: int, size: int | None) -> None:
    if size is None or size < 0:
        raise FormatError(f"{where} row {i} ({fqn!r}): data file {file!r} is not among the manifest's data files")
    if off > size - n:
        raise FormatError(
            f"{where} row {i} ({fqn!r}): bytes [{off}, {off + n}) lie outside data file {file!r}, "
            f"which the manifest says holds {size} bytes"
        )


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


#: Largest tensor (and fragment) in bytes the format accepts: element counts times
#: item sizes are computed in int64, and this keeps every such product exact.
MAX_TENSOR_BYTES = 1 << 62


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


def _validate_table(table: pa.Table, *, where: str, checksum_block_bytes: int) -> None:
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
        dtypes = table.column("dtype").combine_chunks().dictionary_encode()
        known = np.array([itemsize_or_zero(d) for d in dtypes.dictionary.to_pylist()], dtype=np.int64)
        sizes = known[dtypes.indices.to_numpy(zero_copy_only=False)]
        nonneg = ~np.repeat(bad, ndim)
        numel, numel_f = _row_products(np.where(nonneg, lens, 0), row_of, n)
        _total, total_f = _row_products(np.where(nonneg, shape, 0), row_of, n)
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
    if math.prod(f.global_shape) * size >= MAX_TENSOR_BYTES:
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


# -- tiling ------------------------------------------------------------------------------

#: The corner test handles at most this many box corners (memory: 8 bytes each per dimension).
_MAX_CORNERS = 1 << 22
#: The sweep fallback compares at most this many candidate pairs before giving up.
_MAX_PAIRS = 1 << 26


def tiling_problem(shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> str | None:
    """Why the boxes (rows of ``offsets`` and ``lengths``, int64, each already inside
    ``shape``) do not tile ``shape`` exactly, or None when they do. Identical boxes
    count once (replicas); empty boxes are ignored.

    Exact and vectorised. The signed corners of a box (+1/-1 by the parity of the
    ends chosen) are its indicator's finite difference; the boxes cover every element
    exactly once iff their corners, summed, equal those of the whole tensor. Cost
    O(F 2^k log) for F boxes cut along k dimensions (1-2 for real layouts); dimensions
    every box spans fully do not count. Past that, a sort-and-sweep on the dimension
    with the fewest candidate pairs checks disjointness (O(F log F + pairs)).
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    total = math.prod(shape)
    if ndim == 0 or total == 0:
        return None  # a 0-d tensor has one possible box; an empty one holds only empty boxes
    offsets, lengths = offsets.reshape(-1, ndim), lengths.reshape(-1, ndim)
    live = (lengths > 0).all(axis=1)
    if not live.all():
        offsets, lengths = offsets[live], lengths[live]
    partial = (offsets != 0) | (lengths != np.array(shape, dtype=np.int64))
    cut = np.flatnonzero(partial.any(axis=0)).tolist()
    if len(cut) == 1:  # the usual layout (a shard along one dimension): intervals that must abut
        (k,) = cut
        start, end = offsets[:, k], offsets[:, k] + lengths[:, k]
        if (shape[k] + 1) ** 2 < 1 << 62:
            key = np.unique(start * (shape[k] + 1) + end)
            start, end = key // (shape[k] + 1), key % (shape[k] + 1)
        else:
            pairs = np.unique(np.stack([start, end], axis=1), axis=0)
            start, end = pairs[:, 0], pairs[:, 1]
        if start[0] == 0 and end[-1] == shape[k] and (end[:-1] == start[1:]).all():
            return None
    boxes = np.unique(np.concatenate([offsets, lengths], axis=1), axis=0)  # replicas count once
    offs, lens = boxes[:, :ndim], boxes[:, ndim:]
    covered = sum(np.prod(lens, axis=1).tolist())  # each count fits int64 (rows validated); the sum is exact
    if covered != total:
        what = "some part is missing" if covered < total else "they overlap"
        return f"its fragments hold {covered} elements of its {total} (shape {list(shape)}): {what}"
    if len(cut) <= 1:
        ok: bool | None = len(cut) == 0 and len(offs) == 1  # one interval layout failed above: overlap
    else:
        offs, lens, dims = offs[:, cut], lens[:, cut], tuple(shape[k] for k in cut)
        small = len(offs) << len(cut) <= _MAX_CORNERS
        ok = _corners_match(dims, offs, lens) if small else _sweep_disjoint(offs, lens)
    if ok is None:
        return f"its {len(offs)} fragments are too irregular to check for overlap cheaply"
    return None if ok else "its fragments overlap and leave a hole (they do not tile the tensor)"


def _corners_match(shape: tuple[int, ...], offs: np.ndarray, lens: np.ndarray) -> bool:
    k = len(shape)
    bits = (np.arange(1 << k)[:, None] >> np.arange(k)[None, :]) & 1  # (2^k, k): end chosen?
    signs = np.where(bits.sum(axis=1) % 2 == 0, 1, -1)
    corners = (offs[None, :, :] + bits[:, None, :] * lens[None, :, :]).reshape(-1, k)
    weights = np.repeat(signs, len(offs))
    whole = bits * np.array(shape, dtype=np.int64)  # the tensor's own corners, subtracted
    corners = np.concatenate([corners, whole])
    weights = np.concatenate([weights, -signs])
    radix = 1
    for s in shape:
        radix *= s + 1
    if radix < 1 << 62:  # one int64 key per point
        mult = np.cumprod([1, *[s + 1 for s in shape[:-1]]]).astype(np.int64)
        keys = corners @ mult
        _uniq, inverse = np.unique(keys, return_inverse=True)
    else:
        _uniq, inverse = np.unique(corners, axis=0, return_inverse=True)
    sums = np.bincount(inverse.reshape(-1), weights=weights)
    return not sums.any()


def _sweep_disjoint(offs: np.ndarray, lens: np.ndarray) -> bool | None:
    """Whether the boxes are pairwise disjoint; None past _MAX_PAIRS candidate pairs.
    Sorted by start on one dimension, box i can only meet the boxes before it whose
    running maximum end exceeds its start: a window, found with searchsorted."""
    best: tuple[int, int, np.ndarray, np.ndarray] | None = None
    for k in range(offs.shape[1]):
        order = np.argsort(offs[:, k], kind="stable")
        start = offs[order, k]
        reach = np.maximum.accumulate(start + lens[order, k])
        first = np.searchsorted(reach, start, side="right")
        width = np.arange(len(start)) - first
        pairs = int(np.clip(width, 0, None).sum())
        if best is None or pairs < best[0]:
            best = (pairs, k, order, first)
    assert best is not None
    pairs, _k, order, first = best
    if pairs > _MAX_PAIRS:
        return None
    width = np.clip(np.arange(len(order)) - first, 0, None)
    o, n = offs[order], lens[order]
    rows = np.flatnonzero(width)
    if not len(rows):
        return True
    cum = np.cumsum(width[rows])
    done = 0
    for end in np.searchsorted(cum, np.arange(1 << 20, int(cum[-1]) + (1 << 20), 1 << 20), side="right").tolist():
        end = max(end, done + 1) if done < len(rows) else done
        mine = rows[done:end]
        done = end
        if not len(mine):
            continue
        w = width[mine]
        a = np.repeat(mine, w)
        step = np.arange(len(a)) - np.repeat(np.cumsum(w) - w, w)
        b = np.repeat(first[mine], w) + step
        if (np.maximum(o[a], o[b]) < np.minimum(o[a] + n[a], o[b] + n[b])).all(axis=1).any():
            return False
    return True


def boxes_cover_exactly(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether the (offsets, lengths) boxes tile ``shape`` with no gap and no overlap,
    counting identical boxes once (replicas). Boxes outside ``shape`` do not tile it."""
    shape = tuple(shape)
    ndim = len(shape)
    for o, n in boxes:
        if len(o) != ndim or len(n) != ndim:
            return False
        if any(a < 0 or x < 0 or a + x > s for a, x, s in zip(o, n, shape, strict=True)):
            return False
    if not boxes:
        return math.prod(shape) == 0
    offs = np.array([list(o) for o, _n in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    lens = np.array([list(n) for _o, n in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return tiling_problem(shape, offs, lens) is None


# -- bounded decoding ----------------------------------------------------------------------

#: Decoding may use at most this many bytes of Arrow buffers per byte of the catalog
#: file, and never less than DECODE_FLOOR_BYTES. bcp's own catalogs decode to about
#: 3-15x their file size; a decompression bomb reaches thousands.
DECODE_RATIO = 256
DECODE_FLOOR_BYTES = 64 << 20


def decode_budget(file_bytes: int) -> int:
    """Most bytes that decoding a catalog of ``file_bytes`` may allocate (buffers,
    decompressed, with dictionary strings expanded)."""
    return max(DECODE_FLOOR_BYTES, DECODE_RATIO * file_bytes)


class _Flat:
    """Just enough FlatBuffers to read the Arrow IPC footer and message headers;
    every read is bounds-checked (a FormatError, never an IndexError)."""

    def __init__(self, buf: bytes, where: str) -> None:
        self.buf, self.where = buf, where

    def _get(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.buf):
            raise FormatError(f"{self.where}: Arrow metadata points outside itself (offset {pos})")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def root(self) -> int:
        return self._get("<I", 0)

    def field(self, table: int, index: int) -> int | None:
        """Position of field ``index`` of the table at ``table``, None when absent."""
        vtable = table - self._get("<i", table)
        vsize = self._get("<H", vtable)
        if 4 + 2 * index + 2 > vsize:
            return None
        off = self._get("<H", vtable + 4 + 2 * index)
        return table + off if off else None

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        pos = self.field(table, index)
        return default if pos is None else self._get(fmt, pos)

    def ref(self, table: int, index: int) -> int | None:
        """The table, vector or union a field points to."""
        pos = self.field(table, index)
        return None if pos is None else pos + self._get("<I", pos)

    def structs(self, table: int, index: int, size: int, fmts: str) -> list[tuple[int, ...]]:
        """A vector of structs, each unpacked with ``fmts`` (little-endian)."""
        vec = self.ref(table, index)
        if vec is None:
            return []
        count = self._get("<I", vec)
        if vec + 4 + count * size > len(self.buf):
            raise FormatError(f"{self.where}: Arrow metadata vector of {count} entries overruns its buffer")
        return [struct.unpack_from("<" + fmts, self.buf, vec + 4 + i * size) for i in range(count)]


_MESSAGE_SCHEMA, _MESSAGE_DICTIONARY, _MESSAGE_RECORDS = 1, 2, 3


def check_ipc_budget(data: bytes, *, where: str, budget: int) -> None:
    """Refuse an Arrow IPC file whose batches would decode to more than ``budget``
    bytes, before anything is decompressed.

    Reads the footer and the header of every message it lists (the blocks the Arrow
    reader will decode): row and element counts of every array, and each buffer's
    size, where compressed buffers declare their decompressed size in their first 8
    bytes (Arrow's format). Files that are not Arrow IPC files are left to the Arrow
    reader to reject."""
    if len(data) < 18 or data[:6] != b"ARROW1" or data[-6:] != b"ARROW1":
        return  # not an IPC file: open_file says so
    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    if not 0 < footer_len <= len(data) - 18:
        raise FormatError(f"{where}: Arrow footer length {footer_len} is impossible for a {len(data)}-byte file")
    footer = _Flat(data[len(data) - 10 - footer_len : len(data) - 10], where)
    root = footer.root()
    block = "qi4xq"  # offset, metadata length, padding, body length
    blocks = footer.structs(root, 2, 24, block) + footer.structs(root, 3, 24, block)
    used = 0
    view = pa.py_buffer(data)
    for offset, _meta_len, body_len in blocks:
        if not 0 <= offset < len(data) or not 0 <= body_len <= len(data):
            raise FormatError(f"{where}: Arrow block at offset {offset} lies outside the file")
        try:
            message = pa.ipc.read_message(pa.BufferReader(view.slice(offset)))
        except (pa.ArrowException, OSError, EOFError) as e:
            raise FormatError(f"{where}: unreadable Arrow message at offset {offset}: {e}") from e
        head = _Flat(message.metadata.to_pybytes(), where)
        m = head.root()
        kind = head.scalar(m, 1, "<B")
        batch = head.ref(m, 2)
        if batch is None or kind not in (_MESSAGE_DICTIONARY, _MESSAGE_RECORDS):
            continue
        if kind == _MESSAGE_DICTIONARY:
            batch = head.ref(batch, 1)
            if batch is None:
                continue
        length = head.scalar(batch, 0, "<q")
        nodes = head.structs(batch, 1, 16, "qq")
        buffers = head.structs(batch, 2, 16, "qq")
        compressed = head.ref(batch, 3) is not None
        body = message.body
        if length < 0 or any(n < 0 or nulls < 0 for n, nulls in nodes):
            raise FormatError(f"{where}: negative length in the Arrow message at offset {offset}")
        # every array element costs at least a byte of some buffer once decoded (and 8
        # for the columns a reader casts to int64): count them, then the buffers
        used += 8 * (length + sum(n for n, _nulls in nodes))
        for b_off, b_len in buffers:
            if b_off < 0 or b_len < 0 or b_off + b_len > body.size:
                raise FormatError(f"{where}: Arrow buffer [{b_off}, {b_off + b_len}) outside its message body")
            if compressed and b_len >= 8:
                declared = struct.unpack_from("<q", body, b_off)[0]
                if declared < -1:
                    raise FormatError(f"{where}: negative decompressed size {declared} in the Arrow message")
                used += b_len - 8 if declared == -1 else declared
            else:
                used += b_len
        if used > budget:
            raise FormatError(
                f"{where}: the catalog would decode to more than {budget} bytes from {len(data)} "
                "(a decompression bomb, or a catalog far larger than its file); refusing it"
            )


def _check_expansion(table: pa.Table, *, where: str, budget: int) -> None:
    """Refuse dictionary-encoded string columns that would expand past ``budget`` bytes
    when decoded to one string per row (a long value repeated by a million indices
    compresses to nothing). Computed from the value lengths, without expanding."""
    total = 0
    for column in table.columns:
        if not pa.types.is_dictionary(column.type):
            continue
        for chunk in column.chunks:
            values = chunk.dictionary
            if not (pa.types.is_string(values.type) or pa.types.is_binary(values.type)):
                continue
            lengths = pa.compute.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            indices = chunk.indices.fill_null(0).to_numpy(zero_copy_only=False)
            total += int(lengths[indices].sum()) if len(lengths) else 0
            if total > budget:
                raise FormatError(
                    f"{where}: dictionary-encoded strings would expand to more than {budget} bytes; refusing it"
                )
