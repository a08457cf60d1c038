"""The fragment catalog: one row per stored fragment of a global tensor (fragments.arrow).

Pure data: knows the format, not torch, not storage. The engine builds
:class:`Fragment` rows while saving and asks the :class:`Catalog` where bytes live
while loading. Rows are held as numpy columns (:mod:`.rows`); a tensor's rows become
Fragment objects only when a caller asks for them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute  # binds pa.compute

from .dtypes import itemsize
from .errors import FormatError
from .rows import Fragment, Rows, TensorEntry

if TYPE_CHECKING:
    from .sections import Head

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

Box = tuple[Sequence[int], Sequence[int]]


class TensorTable:
    """The catalog's tensors in save order: name, key path, dtype, shape. Rows refer to
    a tensor by its index here."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.key_paths: list[str] = []
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []

        self._arrays: TensorArrays | None = None

    def add(self, fqn: str, key_path: str, dtype: str, shape: tuple[int, ...]) -> int:
        code = self.index.setdefault(fqn, len(self.names))
        if code == len(self.names):
            self.names.append(fqn)
            self.key_paths.append(key_path)
            self.dtypes.append(dtype)
            self.shapes.append(shape)
            self._arrays = None
        return code

    def __len__(self) -> int:
        return len(self.names)

    @property
    def arrays(self) -> TensorArrays:
        """The table as numpy columns (built once; every section's checks use them)."""
        if self._arrays is None:
            self._arrays = TensorArrays(self)
        return self._arrays


class TensorArrays:
    """A TensorTable's shapes, strides, key paths and dtypes as numpy arrays."""

    def __init__(self, tensors: TensorTable) -> None:
        self.ndim = np.array([len(s) for s in tensors.shapes], dtype=np.int64)
        self.starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(self.ndim)])
        self.shape = np.fromiter((d for s in tensors.shapes for d in s), np.int64, int(self.starts[-1]))
        #: row-major element strides (flat like ``shape``): suffix products of the shape
        self.strides = np.ones(len(self.shape), dtype=np.int64)
        for t, shape in enumerate(tensors.shapes):
            acc, base = 1, int(self.starts[t])
            for d in range(len(shape) - 1, -1, -1):
                self.strides[base + d] = min(acc, MAX_TENSOR_BYTES)  # exact below 2**62 elements
                acc *= shape[d]
        self.key_paths: dict[str, int] = {}
        self.kp = np.fromiter((self.key_paths.setdefault(v, len(self.key_paths)) for v in tensors.key_paths), np.int64)
        self.dtypes: dict[str, int] = {}
        self.dt = np.fromiter((self.dtypes.setdefault(v, len(self.dtypes)) for v in tensors.dtypes), np.int64)


class _Tensors(Mapping):
    """fqn -> TensorEntry, built on first use from the catalog's columns (a rank
    loading its shards of a large checkpoint touches a small part of the catalog)."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def __getitem__(self, fqn: str) -> TensorEntry:
        return self._catalog._entry(self._catalog._table_of_tensors.index[fqn])

    def __iter__(self) -> Iterator[str]:
        return iter(self._catalog._table_of_tensors.names)

    def __len__(self) -> int:
        return len(self._catalog._table_of_tensors)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._catalog._table_of_tensors.index


class Catalog:
    """All fragments of a checkpoint, indexed by tensor (``tensors``: fqn -> TensorEntry).

    Built from Fragment objects (a test, a tool), from an Arrow table of rows (a save's
    commit) or decoded from storage (:meth:`from_arrow`). A catalog decoded from the
    sections of a v2 file may hold only some of its rows: :meth:`require` reads the
    sections a set of wanted boxes needs."""

    _table_of_tensors: TensorTable
    _file_names: list[str]
    _file_index: dict[str, int]
    _rows: Rows
    #: the Fragment objects a catalog was built from (row i is _given[i]); None otherwise
    _given: list[Fragment] | None
    #: every row held as a Fragment, tensor by tensor (built on demand)
    _fragments: list[Fragment] | None
    _where: str
    #: check whole-tensor tiling when an entry is built (rows read from storage)
    _check_tiling: bool
    #: a v2 catalog's sections: which are held, how to read the others
    _parts: _Sections | None = None

    def __init__(self, fragments: Iterable[Fragment]) -> None:
        frags = list(fragments)
        tensors = TensorTable()
        for f in frags:
            code = tensors.add(f.fqn, f.key_path, f.dtype, f.global_shape)
            if (f.dtype, f.global_shape, f.key_path) != (
                tensors.dtypes[code],
                tensors.shapes[code],
                tensors.key_paths[code],
            ):
                raise FormatError(
                    f"catalog: fragments of {f.fqn!r} disagree on dtype/shape/path: "
                    f"{tensors.dtypes[code]}{list(tensors.shapes[code])} vs {f.dtype}{list(f.global_shape)}"
                )
        file_index: dict[str, int] = {}
        rows = Rows.from_fragments(frags, dict(tensors.index), file_index)
        self._setup(tensors, list(file_index), rows, where="catalog", check_tiling=False, given=frags)

    def _setup(
        self,
        tensors: TensorTable,
        files: list[str],
        rows: Rows,
        *,
        where: str,
        check_tiling: bool,
        given: list[Fragment] | None = None,
    ) -> None:
        self._table_of_tensors = tensors
        self._file_names = files
        self._file_index = {name: i for i, name in enumerate(files)}
        self._given = given
        self._where = where
        self._check_tiling = check_tiling
        self._parts = None
        self._set_rows(rows)
        self.tensors: Mapping[str, TensorEntry] = _Tensors(self)

    def _set_rows(self, rows: Rows) -> None:
        self._rows = rows
        self._fragments = None
        from .sections import stable_order

        order = stable_order(rows.tensor)
        self._order = order
        self._starts = np.searchsorted(rows.tensor[order], np.arange(len(self._table_of_tensors) + 1))
        self._cache: dict[int, TensorEntry] = {}

    @classmethod
    def from_table(cls, table: pa.Table, *, where: str = "catalog") -> Catalog:
        """A catalog over rows already in Arrow form (a save's fragment reports, in
        CATALOG_SCHEMA's columns; string columns plain or dictionary-encoded): no
        Fragment objects are built. The rows are the writer's own, not read from
        storage; ``where`` names them in errors."""
        missing = [n for n in CATALOG_SCHEMA.names if n not in table.column_names]
        if missing:
            raise ValueError(f"{where}: missing column(s) {', '.join(missing)}")
        table = _cast(table.select(CATALOG_SCHEMA.names), where)
        self = cls.__new__(cls)
        tensors = TensorTable()
        files: list[str] = []
        rows = _bind(table, tensors, files, where=where, fixed=False)
        self._setup(tensors, files, rows, where=where, check_tiling=True)
        return self

    @property
    def file_names(self) -> tuple[str, ...]:
        """Data file keys the rows refer to (TensorEntry.files are codes into these)."""
        return tuple(self._file_names)

    @property
    def fragments(self) -> list[Fragment]:
        """Every row read as a Fragment: tensors in save order, each tensor's rows in
        catalog order (built on demand: tools walk them, loads do not). A catalog built
        from Fragment objects gives them back in their order."""
        if self._given is not None:
            return self._given
        if self._fragments is None:
            self._fragments = [
                f for t in range(len(self._table_of_tensors)) for f in self._entry(t, check=False).fragments
            ]
        return self._fragments

    def __len__(self) -> int:
        return len(self._rows)

    def require(self, requests: Iterable[tuple[str, Box]]) -> None:
        """Make sure every stored row that may overlap the (fqn, box) ``requests`` is
        held. A no-op for a catalog held whole; a catalog read in part (:meth:`from_head`)
        reads the sections it lacks whose span index entries meet the boxes' flat
        spans. Unknown tensors and malformed boxes are skipped (the caller reports
        them). Entries taken from ``tensors`` before this call may lack the new rows."""
        parts = self._parts
        if parts is None or parts.loaded.all():
            return
        from .sections import flat_spans

        tensors = self._table_of_tensors
        codes: list[int] = []
        offs: list[int] = []
        lens: list[int] = []
        starts = [0]
        for fqn, (b_off, b_len) in requests:
            t = tensors.index.get(fqn)
            if t is None or not len(b_off) == len(b_len) == len(tensors.shapes[t]):
                continue
            shape = tensors.shapes[t]
            if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(b_off, b_len, shape, strict=True)):
                continue
            codes.append(t)
            offs += b_off
            lens += b_len
            starts.append(len(offs))
        if not codes:
            return
        tcode = np.array(codes, dtype=np.int64)
        first, last, live = flat_spans(
            tcode, np.array(starts, np.int64), np.array(offs, np.int64), np.array(lens, np.int64), tensors
        )
        tcode, first, last = tcode[live], first[live], last[live]
        head = parts.head
        counts = parts.t_starts[tcode + 1] - parts.t_starts[tcode]
        total = int(counts.sum())
        step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        span = parts.t_order[np.repeat(parts.t_starts[tcode], counts) + step]
        lo, hi = np.repeat(first, counts), np.repeat(last, counts)
        meets = (head.span_first[span] <= hi) & (head.span_last[span] >= lo)
        wanted = np.zeros(head.sections, dtype=bool)
        wanted[head.span_section[span[meets]]] = True
        self._load_sections(np.flatnonzero(wanted & ~parts.loaded))

    def require_all(self) -> None:
        """Read every section not held yet (a catalog read in part becomes whole)."""
        if self._parts is not None:
            self._load_sections(np.flatnonzero(~self._parts.loaded))

    def _load_sections(self, todo: np.ndarray) -> None:
        """Read sections ``todo`` (ascending), one ranged read per run of adjacent ones."""
        parts = self._parts
        if parts is None or not len(todo):
            return
        head = parts.head
        runs = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1)
        for run in runs:
            a, b = int(run[0]), int(run[-1])
            start, end = int(head.sec_offset[a]), int(head.sec_offset[b] + head.sec_length[b])
            data = parts.fetch(start, end - start)
            if len(data) != end - start:
                raise FormatError(f"{self._where}: read {len(data)} bytes of catalog sections [{start}, {end})")
            for k in range(a, b + 1):
                lo = int(head.sec_offset[k]) - start
                parts.rows[k] = self._decode_section(k, data[lo : lo + int(head.sec_length[k])])
                parts.loaded[k] = True
        self._set_rows(Rows.concat([parts.rows[k] for k in sorted(parts.rows)]))
        pa.default_memory_pool().release_unused()  # the sections' Arrow buffers: the rows are numpy now

    def _decode_section(self, k: int, data: bytes) -> Rows:
        """Section ``k``'s rows, checked against the head: CRC32C, budget, every row,
        tensor table, row count, writers, span index."""
        from .checksum import crc32c
        from .sections import section_spans

        parts = self._parts
        assert parts is not None
        head, where = parts.head, f"{self._where} (section {k})"
        if crc32c(data) != int(head.sec_crc[k]):
            raise FormatError(
                f"{where}: fails its CRC32C ({crc32c(data):#010x}, head says {int(head.sec_crc[k]):#010x})"
            )
        budget = min(decode_budget(len(data)), parts.budget_left)
        rows, used = decode_rows(
            data, where, parts.checksum_block_bytes, self._table_of_tensors, self._file_names, fixed=True, budget=budget
        )
        parts.budget_left -= used
        self._file_index = {name: i for i, name in enumerate(self._file_names)}
        if len(rows) != int(head.sec_rows[k]):
            raise FormatError(f"{where}: holds {len(rows)} rows; the head says {int(head.sec_rows[k])}")
        if len(rows) and (
            (rows.writer < head.sec_first_writer[k]).any() or (rows.writer > head.sec_last_writer[k]).any()
        ):
            raise FormatError(
                f"{where}: holds rows of writers outside "
                f"{int(head.sec_first_writer[k])}..{int(head.sec_last_writer[k])}"
            )
        t, lo, hi = section_spans(rows, self._table_of_tensors)
        ht, hlo, hhi = head.spans_of(k)
        if not (np.array_equal(t, ht) and np.array_equal(lo, hlo) and np.array_equal(hi, hhi)):
            raise FormatError(f"{where}: the head's span index does not match the section's rows")
        if parts.file_sizes is not None:
            check_rows_in_files(rows, self._table_of_tensors, self._file_names, parts.file_sizes, where=where)
        return rows

    def _rows_of(self, t: int) -> np.ndarray:
        return self._order[self._starts[t] : self._starts[t + 1]]

    def entries(self, fqns: Iterable[str]) -> list[TensorEntry]:
        """The entries of ``fqns`` (KeyError for a name not in the catalog), those not
        built yet built together: one gather of their rows per number of dimensions
        and one vectorised tiling check (:mod:`.entries`) instead of one of each per
        tensor. For callers that need many tensors (a rank loading its FSDP shards,
        the coordinator planning shared reads)."""
        index = self._table_of_tensors.index
        codes = [index[f] for f in fqns]
        todo = [t for t in dict.fromkeys(codes) if t not in self._cache]
        if self._given is None and len(todo) > 1:
            self._build_entries(todo)
        return [self._entry(t) for t in codes]

    def _build_entries(self, todo: list[int]) -> None:
        from .entries import gather_entries, simple_tilings

        tensors = self._table_of_tensors
        by_ndim: dict[int, list[int]] = {}
        for t in todo:
            by_ndim.setdefault(len(tensors.shapes[t]), []).append(t)
        for ndim, codes in by_ndim.items():
            row_ids = [self._rows_of(t) for t in codes]
            built, offs, lens = gather_entries(self._rows, row_ids, ndim, codes, self._new_entry)
            if self._check_tiling and ndim:
                simple = simple_tilings([tensors.shapes[t] for t in codes], offs, lens, [len(r) for r in row_ids])
                for i in np.flatnonzero(~simple).tolist():
                    if self._complete(codes[i]):
                        self._check_tiled(codes[i], built[i])
            for t, entry in zip(codes, built, strict=True):
                self._cache[t] = entry

    def _entry(self, t: int, *, check: bool = True) -> TensorEntry:
        entry = self._cache.get(t)
        if entry is not None:
            return entry
        shape = self._table_of_tensors.shapes[t]
        rows = self._rows_of(t)
        frags = None if self._given is None else tuple(self._given[i] for i in rows.tolist())
        if frags is not None and any(len(f.offsets) != len(shape) for f in frags):
            # Fragment lists are not validated: keep what was given, columns left empty
            arrays: tuple[np.ndarray, ...] = (np.zeros((0, len(shape)), np.int64),) * 2 + (
                np.zeros(0, np.int64),
                np.zeros(0, np.int64),
                np.zeros(0, np.int32),
                np.zeros(0, np.int32),
                np.zeros(1, np.int64),
                np.zeros(0, np.uint32),
            )
        else:
            arrays = self._rows.take(rows, len(shape))
        entry = self._new_entry(t, arrays, frags)
        if check and self._check_tiling and self._complete(t):
            self._check_tiled(t, entry)
        if check:
            self._cache[t] = entry
        return entry

    def _new_entry(
        self, t: int, arrays: tuple[np.ndarray, ...], frags: tuple[Fragment, ...] | None = None
    ) -> TensorEntry:
        tensors = self._table_of_tensors
        offs, lens, byte_offsets, sizes, files, writers, sum_starts, sums = arrays
        return TensorEntry(
            tensors.names[t],
            tensors.key_paths[t],
            tensors.dtypes[t],
            tensors.shapes[t],
            offsets=offs,
            lengths=lens,
            byte_offsets=byte_offsets,
            sizes=sizes,
            files=files,
            file_names=tuple(self._file_names),
            writer_ranks=writers,
            checksum_starts=sum_starts,
            checksum_values=sums,
            fragments=frags,
        )

    def _check_tiled(self, t: int, entry: TensorEntry) -> None:
        problem = tiling_problem(entry.global_shape, entry.offsets, entry.lengths)
        if problem is not None:
            raise FormatError(f"{self._where}: tensor {entry.fqn!r}: {problem}")

    def _complete(self, t: int) -> bool:
        """Whether every stored row of tensor ``t`` is held."""
        parts = self._parts
        if parts is None:
            return True
        span = parts.t_order[parts.t_starts[t] : parts.t_starts[t + 1]]
        return bool(parts.loaded[parts.head.span_section[span]].all())

    @property
    def sections_held(self) -> tuple[int, int]:
        """(sections held, sections in the file); (1, 1) for a catalog not read in part."""
        parts = self._parts
        return (1, 1) if parts is None else (int(parts.loaded.sum()), len(parts.loaded))

    @property
    def is_whole(self) -> bool:
        """Whether every row of the catalog is held."""
        return self._parts is None or bool(self._parts.loaded.all())

    # -- Arrow IPC -----------------------------------------------------------------------

    def to_table(self) -> pa.Table:
        """The rows as an Arrow table in CATALOG_SCHEMA's columns, string columns
        dictionary-encoded (built column by column from the numpy columns)."""
        return _table(self._table_of_tensors, self._file_names, self._rows)

    def to_arrow(self) -> bytes:
        """Catalog v2 bytes (FORMAT.md): sections of rows by runs of writers, each an
        Arrow IPC file with string columns dictionary-encoded and zstd-compressed
        buffers (about 15 bytes per fragment for FSDP-like catalogs), then the head
        (tensor table, section table, span index) and a fixed trailer."""
        from .sections import encode

        if self._parts is not None and not self._parts.loaded.all():
            raise ValueError(f"{self._where}: a catalog read in part cannot be written")
        return encode(self._table_of_tensors, self._file_names, self._rows)

    def to_arrow_v1(self) -> bytes:
        """Catalog v1 bytes (one Arrow IPC file): what bcp wrote before catalog v2;
        for tests of the readers that must keep loading it."""
        return _ipc_file(self.to_table())

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
        from .sections import is_v2

        if is_v2(data[-32:]):
            self = cls._open_head(data, len(data), lambda off, n: data[off : off + n], where, checksum_block_bytes)
            self.require_all()
            return self
        tensors = TensorTable()
        files: list[str] = []
        rows, _used = decode_rows(data, where, checksum_block_bytes, tensors, files, fixed=False)
        self = cls.__new__(cls)
        self._setup(tensors, files, rows, where=where, check_tiling=True)
        return self

    @classmethod
    def from_head(
        cls,
        tail: bytes,
        *,
        file_size: int,
        fetch: Callable[[int, int], bytes],
        where: str,
        checksum_block_bytes: int,
    ) -> Catalog:
        """A v2 catalog read in part: ``tail`` is its last bytes (at least the head and
        the trailer) of a ``file_size``-byte file; ``fetch(offset, length)`` reads
        other bytes of it. No rows are held until :meth:`require` reads the sections
        some boxes need. Checks the trailer, the head's CRC32C and the head itself;
        each section is checked when read (FormatError for anything malformed)."""
        if checksum_block_bytes <= 0:
            raise FormatError(f"{where}: checksum block size {checksum_block_bytes} is not positive")
        try:
            return cls._open_head(tail, file_size, fetch, where, checksum_block_bytes)
        except FormatError:
            raise
        except (pa.ArrowException, ArithmeticError, LookupError, TypeError, ValueError, RecursionError, EOFError) as e:
            raise FormatError(f"{where}: malformed catalog: {type(e).__name__}: {e}") from e

    @classmethod
    def _open_head(
        cls, tail: bytes, file_size: int, fetch: Callable[[int, int], bytes], where: str, checksum_block_bytes: int
    ) -> Catalog:
        from .sections import decode_head, read_trailer

        head_offset, head_crc = read_trailer(tail, file_size, where)
        from_tail = len(tail) - (file_size - head_offset)
        if from_tail < 0:
            raise FormatError(f"{where}: the {len(tail)} bytes read do not hold the catalog head")
        budget = decode_budget(file_size)
        head = decode_head(
            tail[from_tail : len(tail) - TRAILER_BYTES], head_offset, head_crc, where=where, budget=budget
        )
        self = cls.__new__(cls)
        self._setup(head.tensors, [], Rows.empty(), where=where, check_tiling=True)
        self._parts = _Sections(head, fetch, checksum_block_bytes, budget - head.used)
        return self

    @staticmethod
    def tail_bytes(file_size: int, tail: bytes) -> int:
        """How many bytes from the end of a ``file_size``-byte v2 catalog hold its head
        and trailer, given at least its last TRAILER_BYTES ``tail``."""
        from .sections import read_trailer

        head_offset, _crc = read_trailer(tail, file_size, "catalog")
        return file_size - head_offset

    def check_files(self, file_sizes: Mapping[str, int], *, where: str) -> None:
        """Raise FormatError unless every fragment names a file of ``file_sizes`` (the
        manifest's data files: path -> bytes) and its bytes lie inside that file.
        With this, no read planned from the catalog can ask for more bytes than the
        manifest declares (vectorised; one pass over the rows held). A catalog read in
        part checks the rows of every section it reads later too."""
        check_rows_in_files(self._rows, self._table_of_tensors, self._file_names, file_sizes, where=where)
        if self._parts is not None:
            self._parts.file_sizes = dict(file_sizes)


#: bytes of a v2 catalog's fixed trailer (sections.TRAILER.size)
TRAILER_BYTES = 24


class _Sections:
    """A v2 catalog's head and which of its sections a catalog holds."""

    def __init__(
        self, head: Head, fetch: Callable[[int, int], bytes], checksum_block_bytes: int, budget_left: int
    ) -> None:
        self.head = head
        self.fetch = fetch
        self.checksum_block_bytes = checksum_block_bytes
        #: decode budget left for the sections (the whole file's, shared)
        self.budget_left = budget_left
        self.loaded = np.zeros(head.sections, dtype=bool)
        self.rows: dict[int, Rows] = {}
        self.file_sizes: dict[str, int] | None = None
        #: span index rows sorted by tensor, and each tensor's range in them
        self.t_order, self.t_starts = head.sections_of_tensors()


def check_rows_in_files(
    rows: Rows, tensors: TensorTable, file_names: Sequence[str], file_sizes: Mapping[str, int], *, where: str
) -> None:
    """FormatError naming the first row whose bytes are not inside a declared file."""
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


def _check_in_file(where: str, i: int, fqn: str, file: str, off: int, n: int, size: int | None) -> None:
    if size is None or size < 0:
        raise FormatError(f"{where} row {i} ({fqn!r}): data file {file!r} is not among the manifest's data files")
    if off > size - n:
        raise FormatError(
            f"{where} row {i} ({fqn!r}): bytes [{off}, {off + n}) lie outside data file {file!r}, "
            f"which the manifest says holds {size} bytes"
        )


# -- rows <-> Arrow ------------------------------------------------------------------------


def _ipc_file(table: pa.Table) -> bytes:
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


def _table(tensors: TensorTable, file_names: Sequence[str], rows: Rows, version: str = "1") -> pa.Table:
    """Rows in CATALOG_SCHEMA's columns, strings dictionary-encoded; the dictionaries
    hold only the tensors and files these rows name, each value once."""
    arrays = tensors.arrays
    present = np.bincount(rows.tensor, minlength=len(tensors)) > 0
    kept = np.flatnonzero(present)
    t = (np.cumsum(present) - 1)[rows.tensor]  # codes into the kept tensors
    names = [tensors.names[i] for i in kept.tolist()]
    kp_kept, kp_codes = np.unique(arrays.kp[kept], return_inverse=True)
    dt_kept, dt_codes = np.unique(arrays.dt[kept], return_inverse=True)
    kp_vocab, dt_vocab = list(arrays.key_paths), list(arrays.dtypes)
    kp_values = pa.array([kp_vocab[i] for i in kp_kept.tolist()], pa.string())
    dt_values = pa.array([dt_vocab[i] for i in dt_kept.tolist()], pa.string())
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
        pa.DictionaryArray.from_arrays(pa.array(t, pa.int32()), pa.array(names, pa.string())),
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
    table = pa.Table.from_arrays(columns, names=schema.names)
    return table.replace_schema_metadata({"bcp.catalog.version": version})


def _cast(table: pa.Table, where: str) -> pa.Table:
    """The columns in CATALOG_SCHEMA's types, except that dictionary-encoded string
    columns stay encoded (decoding them costs a string per row)."""
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
    return pa.Table.from_arrays(columns, names=CATALOG_SCHEMA.names)


def _codes(column: pa.ChunkedArray, where: str) -> tuple[np.ndarray, list[str]]:
    """Per-row codes of a string column and the distinct strings they index (a
    dictionary's repeated values merged): the strings are decoded once each."""
    chunks = [c if pa.types.is_dictionary(c.type) else c.dictionary_encode() for c in column.chunks]
    parts: list[np.ndarray] = []
    index: dict[str, int] = {}
    for chunk in chunks:
        words = chunk.dictionary.to_pylist()
        if any(w is None for w in words):
            raise FormatError(f"{where}: null values in the catalog")
        remap = np.fromiter((index.setdefault(w, len(index)) for w in words), np.int64, len(words))
        indices = chunk.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        parts.append(remap[indices] if len(words) else np.zeros(len(chunk), np.int64))
    values = list(index)
    codes = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return codes, values


def _bind(table: pa.Table, tensors: TensorTable, files: list[str], *, where: str, fixed: bool) -> Rows:
    """Rows of a (type-checked) table with tensor and file codes into ``tensors`` and
    ``files``, after checking that every row of a tensor agrees with the tensor table
    on dtype, shape and key path. ``fixed``: the tensor table is given (a v2 head), so
    an unknown tensor is an error; else tensors are added in order of first row."""
    n = table.num_rows
    fqn_codes, fqn_values = _codes(table.column("fqn"), where)
    kp_codes, kp_values = _codes(table.column("key_path"), where)
    dt_codes, dt_values = _codes(table.column("dtype"), where)
    file_codes, file_values = _codes(table.column("file"), where)
    shape_col = table.column("global_shape").combine_chunks()
    shape_starts = shape_col.offsets.to_numpy().astype(np.int64)
    shape_starts -= shape_starts[0]
    shape_flat = shape_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    row_ndim = np.diff(shape_starts)
    if n:
        if fixed:
            known = np.array([tensors.index.get(v, -1) for v in fqn_values], dtype=np.int64)
            local = known[fqn_codes]
            if (local < 0).any():
                i = int(np.flatnonzero(local < 0)[0])
                raise FormatError(
                    f"{where} row {i}: tensor {fqn_values[fqn_codes[i]]!r} is not in the catalog's tensor table"
                )
        else:
            first = np.full(len(fqn_values), n, dtype=np.int64)
            first[fqn_codes[::-1]] = np.arange(n - 1, -1, -1)  # the last write wins: each fqn's first row
            for r in np.sort(first[first < n]).tolist():
                s0, s1 = shape_starts[r], shape_starts[r + 1]
                shape = tuple(shape_flat[s0:s1].tolist())
                tensors.add(fqn_values[fqn_codes[r]], kp_values[kp_codes[r]], dt_values[dt_codes[r]], shape)
            local = np.array([tensors.index[v] for v in fqn_values], dtype=np.int64)[fqn_codes]
        # every row against its tensor's entry in the table (codes in the table's vocabularies)
        arrays = tensors.arrays
        kp_map = np.array([arrays.key_paths.get(v, -1) for v in kp_values], dtype=np.int64)
        dt_map = np.array([arrays.dtypes.get(v, -1) for v in dt_values], dtype=np.int64)
        t_ndim, t_flat, t_starts = arrays.ndim, arrays.shape, arrays.starts
        bad = (arrays.kp[local] != kp_map[kp_codes]) | (arrays.dt[local] != dt_map[dt_codes])
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
    else:
        local = np.zeros(0, np.int64)
    file_index = {name: i for i, name in enumerate(files)}
    for v in file_values:
        if v not in file_index:
            file_index[v] = len(files)
            files.append(v)
    file_map = np.array([file_index[v] for v in file_values], dtype=np.int32)
    return Rows.from_table(table, local, file_map[file_codes] if n else np.zeros(0, np.int32))


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
    tensor table (see :func:`_bind`). Returns the rows and the bytes of the budget
    (default: :func:`decode_budget` of the file) that decoding counted."""
    budget = decode_budget(len(data)) if budget is None else budget
    used = check_ipc_budget(data, where=where, budget=budget)
    table = read_ipc_columns(data, CATALOG_SCHEMA.names, where)
    _check_expansion(table, where=where, budget=budget)  # strings stay encoded: counted, not charged
    table = _cast(table, where)
    if table.num_rows and any(table.column(n).null_count for n in CATALOG_SCHEMA.names):
        raise FormatError(f"{where}: null values in the catalog")
    _validate_table(table, where=where, checksum_block_bytes=checksum_block_bytes)
    return _bind(table, tensors, files, where=where, fixed=fixed), used


def read_ipc_columns(data: bytes, names: Sequence[str], where: str) -> pa.Table:
    """The columns ``names`` of an Arrow IPC file, fully validated by Arrow; a
    FormatError naming ``where`` when the file is unreadable or lacks a column."""
    try:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, EOFError) as e:
        raise FormatError(f"{where}: not a readable Arrow IPC file: {e}") from e
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise FormatError(f"{where}: missing column(s) {', '.join(missing)}")
    return table.select(list(names))


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
        dt_codes, dt_values = _codes(table.column("dtype"), where)  # one itemsize lookup per distinct dtype
        known = np.array([itemsize_or_zero(d) for d in dt_values], dtype=np.int64)
        sizes = known[dt_codes]
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
    if not cut and len(offsets):  # every box is the whole tensor (one fragment, or replicas of it)
        return None
    if len(cut) == 1:  # the usual layout (a shard along one dimension): intervals that must abut
        (k,) = cut
        start, end = offsets[:, k], offsets[:, k] + lengths[:, k]
        if len(start) and start[0] == 0 and end[-1] == shape[k] and (end[:-1] == start[1:]).all():
            return None  # already in order, abutting, no replicas: the catalog's usual order
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


def check_ipc_budget(data: bytes, *, where: str, budget: int) -> int:
    """Refuse an Arrow IPC file whose batches would decode to more than ``budget``
    bytes, before anything is decompressed.

    Reads the footer and the header of every message it lists (the blocks the Arrow
    reader will decode): row and element counts of every array, and each buffer's
    size, where compressed buffers declare their decompressed size in their first 8
    bytes (Arrow's format). Files that are not Arrow IPC files are left to the Arrow
    reader to reject. Returns the bytes counted (what decoding will allocate, at most)."""
    if len(data) < 18 or data[:6] != b"ARROW1" or data[-6:] != b"ARROW1":
        return 0  # not an IPC file: open_file says so
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
    return used


def _check_expansion(table: pa.Table, *, where: str, budget: int) -> int:
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
    return total
