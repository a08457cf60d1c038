"""Catalog rows held as numpy columns, and the per-tensor view over them.

A catalog of a large job has millions of rows; a loading rank needs a few of them per
tensor. Rows therefore stay in flat numpy arrays (one element per row, list columns as
flat values plus per-row starts), and a :class:`TensorEntry` holds one tensor's rows as
arrays. :class:`Fragment` objects are built only on demand, for the rows a caller asks
for (``entry.fragment(i)``) or for tools that want them all (``entry.fragments``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from bcp.metadata.dtypes import itemsize
from bcp.metadata.format_errors import FormatError


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
    #: XXH3-128 of the fragment's bytes (16 bytes, canonical big-endian form) when the
    #: catalog has the optional ``digest`` column (incremental saves); None otherwise.
    digest: bytes | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


#: Bytes of a fragment's digest (the catalog's optional ``digest`` column): XXH3-128.
DIGEST_BYTES = 16


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def digest_bytes(digests: np.ndarray | None, i: int) -> bytes | None:
    """Row ``i`` of a (F, 16) uint8 digest column as bytes, None without the column."""
    return None if digests is None else digests[i].tobytes()


def _digest_matrix(values: Sequence[bytes | None], where: str) -> np.ndarray | None:
    """(F, 16) uint8 of the digests of Fragment objects: None when none has one; a
    FormatError when only some do or one is not 16 bytes (a column has no nulls)."""
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present) or any(len(v) != DIGEST_BYTES for v in values if v is not None):
        i = next(i for i, v in enumerate(values) if v is None or len(v) != DIGEST_BYTES)
        raise FormatError(f"{where} row {i}: digest {values[i]!r} is not {DIGEST_BYTES} bytes (all rows or none)")
    return np.frombuffer(b"".join(values), np.uint8).reshape(-1, DIGEST_BYTES).copy()  # type: ignore[arg-type]


class TensorEntry:
    """Everything this catalog knows about one global tensor: its metadata and its
    fragment rows as numpy columns (row ``i`` of each array is fragment ``i``).

    For a catalog read in part (catalog v2, a rank fetching only some sections), the
    rows are those of the sections read; the caller's planner checks that they cover
    what it wants. Arrays are read-only (shared with the catalog's caches)."""

    __slots__ = (
        "_fragments",
        "_sum_starts",
        "_sum_values",
        "byte_offsets",
        "digests",
        "dtype",
        "file_names",
        "files",
        "fqn",
        "global_shape",
        "key_path",
        "lengths",
        "offsets",
        "sizes",
        "writer_ranks",
    )

    fqn: str
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    #: (F, ndim) int64: start of each fragment's box
    offsets: np.ndarray
    #: (F, ndim) int64: extent of each fragment's box
    lengths: np.ndarray
    #: (F,) int64: first byte of each fragment in its file
    byte_offsets: np.ndarray
    #: (F,) int64: bytes of each fragment
    sizes: np.ndarray
    #: (F,) int32: each fragment's file, a code into ``file_names``
    files: np.ndarray
    #: data file keys, shared by every entry of the catalog
    file_names: tuple[str, ...]
    #: (F,) int32
    writer_ranks: np.ndarray
    #: (F, 16) uint8: each fragment's XXH3-128 digest; None when the catalog has no
    #: ``digest`` column (never trusted for loading: the block checksums are)
    digests: np.ndarray | None

    def __init__(
        self,
        fqn: str,
        key_path: str,
        dtype: str,
        global_shape: tuple[int, ...],
        *,
        offsets: np.ndarray,
        lengths: np.ndarray,
        byte_offsets: np.ndarray,
        sizes: np.ndarray,
        files: np.ndarray,
        file_names: tuple[str, ...],
        writer_ranks: np.ndarray,
        checksum_starts: np.ndarray,
        checksum_values: np.ndarray,
        fragments: tuple[Fragment, ...] | None = None,
        read_only: bool = False,
        digests: np.ndarray | None = None,
    ) -> None:
        """``read_only``: every array is read-only already (views of a frozen gather),
        so none is frozen here (eight calls a tensor at 10,000 tensors)."""
        self.fqn, self.key_path, self.dtype, self.global_shape = fqn, key_path, dtype, global_shape
        self.file_names, self._fragments = file_names, fragments
        self.digests = digests if digests is None or read_only else _frozen(digests)
        arrays: tuple[np.ndarray, ...]
        if read_only:
            arrays = (offsets, lengths, byte_offsets, sizes, files, writer_ranks, checksum_starts, checksum_values)
        else:
            arrays = tuple(
                _frozen(a)
                for a in (offsets, lengths, byte_offsets, sizes, files, writer_ranks, checksum_starts, checksum_values)
            )
        (
            self.offsets,
            self.lengths,
            self.byte_offsets,
            self.sizes,
            self.files,
            self.writer_ranks,
            self._sum_starts,
            self._sum_values,
        ) = arrays

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * itemsize(self.dtype)

    @property
    def num_fragments(self) -> int:
        return len(self.byte_offsets)

    def checksums(self, i: int) -> tuple[int, ...]:
        """CRC32C of each checksum block of fragment ``i``."""
        return tuple(self._sum_values[self._sum_starts[i] : self._sum_starts[i + 1]].tolist())

    def fragment(self, i: int) -> Fragment:
        """Row ``i`` as a Fragment (checksums included)."""
        if self._fragments is not None:
            return self._fragments[i]
        return Fragment(
            self.fqn,
            self.key_path,
            self.dtype,
            self.global_shape,
            tuple(self.offsets[i].tolist()),
            tuple(self.lengths[i].tolist()),
            self.file_names[int(self.files[i])],
            int(self.byte_offsets[i]),
            int(self.sizes[i]),
            self.checksums(i),
            int(self.writer_ranks[i]),
            digest_bytes(self.digests, i),
        )

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        """Every row as a Fragment (built once; for tools that walk them all)."""
        if self._fragments is None:
            sums = self._sum_values.tolist()
            starts = self._sum_starts.tolist()
            names = self.file_names
            self._fragments = tuple(
                Fragment(
                    self.fqn,
                    self.key_path,
                    self.dtype,
                    self.global_shape,
                    tuple(o),
                    tuple(n),
                    names[f],
                    b,
                    s,
                    tuple(sums[starts[i] : starts[i + 1]]),
                    w,
                    digest_bytes(self.digests, i),
                )
                for i, (o, n, f, b, s, w) in enumerate(
                    zip(
                        self.offsets.tolist(),
                        self.lengths.tolist(),
                        self.files.tolist(),
                        self.byte_offsets.tolist(),
                        self.sizes.tolist(),
                        self.writer_ranks.tolist(),
                        strict=True,
                    )
                )
            )
        return self._fragments

    def __repr__(self) -> str:
        return (
            f"TensorEntry({self.fqn!r}, {self.dtype}{list(self.global_shape)}, "
            f"{self.num_fragments} fragment{'s' if self.num_fragments != 1 else ''})"
        )


class TensorBoxes:
    """One tensor's stored boxes only (``Catalog.boxes``): what planning that never
    reads bytes needs (the share_reads coordinator matching every rank's boxes), without
    the byte offsets, files, writers and checksums a :class:`TensorEntry` gathers.
    Arrays are read-only (views of one gather, or of a cached entry's columns)."""

    __slots__ = ("dtype", "fqn", "global_shape", "lengths", "offsets")

    def __init__(
        self, fqn: str, dtype: str, global_shape: tuple[int, ...], offsets: np.ndarray, lengths: np.ndarray
    ) -> None:
        self.fqn, self.dtype, self.global_shape = fqn, dtype, global_shape
        self.offsets, self.lengths = _frozen(offsets), _frozen(lengths)

    @classmethod
    def of(cls, entry: TensorEntry) -> TensorBoxes:
        """The boxes of an entry already built (its arrays, not copies)."""
        return cls(entry.fqn, entry.dtype, entry.global_shape, entry.offsets, entry.lengths)

    @property
    def num_fragments(self) -> int:
        return len(self.offsets)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Fragment rows as flat columns. Tensor and file columns are codes into tables
    the owning catalog keeps; list columns are flat values plus per-row starts."""

    tensor: np.ndarray  # (F,) int32
    coord_starts: np.ndarray  # (F+1,) int64 into offsets/lengths
    offsets: np.ndarray  # int64, flat
    lengths: np.ndarray  # int64, flat
    byte_offset: np.ndarray  # (F,) int64
    nbytes: np.ndarray  # (F,) int64
    file: np.ndarray  # (F,) int32
    writer: np.ndarray  # (F,) int32
    sum_starts: np.ndarray  # (F+1,) int64 into sums
    sums: np.ndarray  # uint32, flat
    #: (F, 16) uint8: the optional ``digest`` column (XXH3-128 of each fragment's bytes);
    #: None when the catalog has none
    digests: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tensor)

    @functools.cached_property
    def fixed_ndim(self) -> int:
        """The number of dimensions every row has, or -1 where rows differ (then
        offsets and lengths cannot be read as (F, ndim) arrays)."""
        cs = self.coord_starts
        if not len(self.tensor) or int(cs[0]) != 0:
            return -1
        d = int(cs[1])
        if int(cs[-1]) != d * len(self.tensor):
            return -1
        step = 1 << 20  # a bounded pass: no row-long temporaries (a first touch of as much memory)
        for a in range(0, len(cs) - 1, step):
            if not bool((np.diff(cs[a : a + step + 1]) == d).all()):
                return -1
        return d

    @staticmethod
    def empty() -> Rows:
        i64, i32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        return Rows(
            i32, np.zeros(1, np.int64), i64, i64, i64, i64, i32, i32, np.zeros(1, np.int64), np.zeros(0, np.uint32)
        )

    @staticmethod
    def no_columns(ndim: int) -> tuple[np.ndarray | None, ...]:
        """Empty columns in :meth:`take`'s order, then no digests: for entries built from
        Fragment lists that are not validated (kept as given, no columns)."""
        i64, i32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        box = np.zeros((0, ndim), np.int64)
        return (box, box, i64, i64, i32, i32, np.zeros(1, np.int64), np.zeros(0, np.uint32), None)

    @staticmethod
    def concat(parts: Sequence[Rows]) -> Rows:
        """Rows of ``parts`` back to back. Digests are kept when every part has them
        (and dropped when none has); ValueError when only some have (the caller names
        its sources: a catalog's sections either all carry the column or none does)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return Rows.empty()
        with_digests = [p.digests is not None for p in parts if len(p)]
        if any(with_digests) and not all(with_digests):
            raise ValueError("rows with and without the digest column cannot be joined")

        def starts(firsts: list[np.ndarray], sizes: list[int]) -> np.ndarray:
            shift = np.cumsum([0, *sizes[:-1]])
            return np.concatenate([np.zeros(1, np.int64), *(f[1:] + k for f, k in zip(firsts, shift, strict=True))])

        return Rows(
            tensor=np.concatenate([p.tensor for p in parts]),
            coord_starts=starts([p.coord_starts for p in parts], [len(p.offsets) for p in parts]),
            offsets=np.concatenate([p.offsets for p in parts]),
            lengths=np.concatenate([p.lengths for p in parts]),
            byte_offset=np.concatenate([p.byte_offset for p in parts]),
            nbytes=np.concatenate([p.nbytes for p in parts]),
            file=np.concatenate([p.file for p in parts]),
            writer=np.concatenate([p.writer for p in parts]),
            sum_starts=starts([p.sum_starts for p in parts], [len(p.sums) for p in parts]),
            sums=np.concatenate([p.sums for p in parts]),
            digests=(
                np.concatenate([_digests_or_empty(p) for p in parts]).reshape(-1, DIGEST_BYTES)
                if any(with_digests)
                else None
            ),
        )

    @staticmethod
    def from_fragments(frags: Sequence[Fragment], tensor_code: dict[str, int], file_code: dict[str, int]) -> Rows:
        """Rows of Fragment objects (codes added to the two dicts as met)."""
        n = len(frags)
        tensor = np.fromiter((tensor_code.setdefault(f.fqn, len(tensor_code)) for f in frags), np.int32, n)
        file = np.fromiter((file_code.setdefault(f.file, len(file_code)) for f in frags), np.int32, n)
        ndims = np.fromiter((len(f.offsets) for f in frags), np.int64, n)
        nlens = np.fromiter((len(f.lengths) for f in frags), np.int64, n)
        if (ndims != nlens).any():
            i = int(np.flatnonzero(ndims != nlens)[0])
            raise FormatError(f"catalog row {i} ({frags[i].fqn!r}): offsets and lengths differ in length")
        nsums = np.fromiter((len(f.checksums) for f in frags), np.int64, n)
        return Rows(
            tensor=tensor,
            coord_starts=np.concatenate([np.zeros(1, np.int64), np.cumsum(ndims)]),
            offsets=np.fromiter(itertools.chain.from_iterable(f.offsets for f in frags), np.int64),
            lengths=np.fromiter(itertools.chain.from_iterable(f.lengths for f in frags), np.int64),
            byte_offset=np.fromiter((f.byte_offset for f in frags), np.int64, n),
            nbytes=np.fromiter((f.nbytes for f in frags), np.int64, n),
            file=file,
            writer=np.fromiter((f.writer_rank for f in frags), np.int32, n),
            sum_starts=np.concatenate([np.zeros(1, np.int64), np.cumsum(nsums)]),
            sums=np.fromiter(itertools.chain.from_iterable(f.checksums for f in frags), np.uint32),
            digests=_digest_matrix([f.digest for f in frags], "catalog"),
        )

    @staticmethod
    def from_table(table: pa.Table, tensor: np.ndarray, file: np.ndarray) -> Rows:
        """Rows of a table in CATALOG_SCHEMA's columns (types already checked), with the
        tensor and file codes the caller computed for each row."""

        def listed(name: str) -> tuple[np.ndarray, np.ndarray]:
            col = table.column(name).combine_chunks()
            starts = col.offsets.to_numpy().astype(np.int64)
            return col.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False), starts - starts[0]

        offs, coord_starts = listed("offsets")
        lens, len_starts = listed("lengths")
        if not np.array_equal(coord_starts, len_starts):
            i = int(np.flatnonzero(coord_starts != len_starts)[0]) - 1
            raise FormatError(f"catalog row {i}: offsets and lengths differ in length")
        sums_col = table.column("checksums").combine_chunks()
        sum_starts = sums_col.offsets.to_numpy().astype(np.int64)
        digests = digest_column(table.column(DIGEST_COLUMN)) if DIGEST_COLUMN in table.column_names else None
        return Rows(
            tensor=tensor.astype(np.int32, copy=False),
            coord_starts=coord_starts,
            offsets=offs,
            lengths=lens,
            byte_offset=_numpy(table, "byte_offset", np.int64),
            nbytes=_numpy(table, "nbytes", np.int64),
            file=file.astype(np.int32, copy=False),
            writer=_numpy(table, "writer_rank", np.int32),
            sum_starts=sum_starts - sum_starts[0],
            sums=sums_col.flatten().to_numpy(zero_copy_only=False).astype(np.uint32, copy=False),
            digests=digests,
        )

    def take_boxes(self, rows: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        """Offsets and lengths (F, ndim) of ``rows`` (all of ``ndim`` dimensions)."""
        n = len(rows)
        if ndim and self.fixed_ndim == ndim:  # rows of a table (the usual case): row gathers, no index per value
            return np.take(self.offsets.reshape(-1, ndim), rows, axis=0), np.take(
                self.lengths.reshape(-1, ndim), rows, axis=0
            )
        pos = (self.coord_starts[rows][:, None] + np.arange(ndim, dtype=np.int64)[None, :]).reshape(-1)
        return self.offsets[pos].reshape(n, ndim), self.lengths[pos].reshape(n, ndim)

    def take_digests(self, rows: np.ndarray) -> np.ndarray | None:
        """The digests (F, 16) of ``rows``, None when these rows have no digest column."""
        return None if self.digests is None else self.digests[rows]

    def take(self, rows: np.ndarray, ndim: int) -> tuple[np.ndarray, ...]:
        """Columns of ``rows`` (all of one tensor of ``ndim`` dimensions): offsets,
        lengths (F, ndim), byte offsets, sizes, files, writers, checksum starts and
        values (digests: :meth:`take_digests`)."""
        n = len(rows)
        offs, lens = self.take_boxes(rows, ndim)
        s0, s1 = self.sum_starts[rows], self.sum_starts[rows + 1]
        counts = s1 - s0
        if bool((counts == 1).all()):  # one checksum block per row (small fragments): one gather
            sum_starts, sum_pos = np.arange(n + 1, dtype=np.int64), s0
        else:
            sum_starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
            sum_pos = np.repeat(s0 - sum_starts[:-1], counts) + np.arange(int(sum_starts[-1]), dtype=np.int64)
        return (
            offs,
            lens,
            self.byte_offset[rows],
            self.nbytes[rows],
            self.file[rows],
            self.writer[rows],
            sum_starts,
            self.sums[sum_pos],
        )


#: The optional catalog column of fragment digests (FORMAT.md, "References").
DIGEST_COLUMN = "digest"
DIGEST_TYPE = pa.binary(DIGEST_BYTES)


def digest_column(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A fixed_size_binary(16) column (type and nulls checked by the caller) as (F, 16) uint8."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(array)
    data = array.buffers()[1]
    if data is None or not n:
        return np.zeros((0, DIGEST_BYTES), np.uint8)
    flat = np.frombuffer(data, np.uint8)[array.offset * DIGEST_BYTES : (array.offset + n) * DIGEST_BYTES]
    return flat.reshape(n, DIGEST_BYTES)


def digest_array(digests: np.ndarray) -> pa.Array:
    """(F, 16) uint8 digests as a fixed_size_binary(16) Arrow array (no nulls)."""
    flat = np.ascontiguousarray(digests, dtype=np.uint8).reshape(-1)
    return pa.FixedSizeBinaryArray.from_buffers(DIGEST_TYPE, len(flat) // DIGEST_BYTES, [None, pa.py_buffer(flat)])


def _digests_or_empty(rows: Rows) -> np.ndarray:
    return rows.digests if rows.digests is not None else np.zeros((0, DIGEST_BYTES), np.uint8)


def _numpy(table: pa.Table, name: str, dtype: type) -> np.ndarray:
    return table.column(name).combine_chunks().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
