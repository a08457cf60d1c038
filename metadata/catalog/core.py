"""The fragment catalog (fragments.arrow): one row per stored fragment, held as numpy
columns (:mod:`..rows`). Pure data: knows the format, not torch, not storage. This module
is the Catalog itself: building, decoding and encoding it (:mod:`.validate`,
:mod:`.sections`, :mod:`.head`), reading a v2 catalog in part (:mod:`.partial`) and
handing out TensorEntry objects checked for exact tiling."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bcp.metadata.catalog.arrow import bind_rows, cast_columns, catalog_columns, ipc_file, rows_table
from bcp.metadata.catalog.budget import decode_budget
from bcp.metadata.catalog.head import decode_head
from bcp.metadata.catalog.partial import Box, Fetch, HeldSections
from bcp.metadata.catalog.sections import TRAILER, encode, is_v2, read_trailer
from bcp.metadata.catalog.tensors import CATALOG_SCHEMA, TensorTable
from bcp.metadata.catalog.validate import check_rows_in_files, decode_rows
from bcp.metadata.catalog.view import TensorsView
from bcp.metadata.catalog.whole import WholeRows, find_exact_rows, find_whole_rows
from bcp.metadata.entries import check_tilings, gather_boxes, gather_entries
from bcp.metadata.format_errors import FormatError
from bcp.metadata.geometry import stable_order
from bcp.metadata.rows import Fragment, Rows, TensorBoxes, TensorEntry

#: bytes of a v2 catalog's fixed trailer (sections.TRAILER.size)
TRAILER_BYTES = TRAILER.size


class Catalog:
    """All fragments of a checkpoint, indexed by tensor (``tensors``: fqn -> TensorEntry).

    Built from Fragment objects (a test, a tool), from an Arrow table of rows (a save's
    commit) or decoded from storage (:meth:`from_arrow`). A catalog decoded from the
    sections of a v2 file may hold only some of its rows: :meth:`require` reads the
    sections a set of wanted boxes needs."""

    _table_of_tensors: TensorTable
    _file_names: list[str]
    _rows: Rows
    #: the Fragment objects a catalog was built from (row i is _given[i]); None otherwise
    _given: list[Fragment] | None
    #: every row held as a Fragment, tensor by tensor (built on demand)
    _fragments: list[Fragment] | None
    _where: str
    #: check whole-tensor tiling when an entry is built (rows read from storage)
    _check_tiling: bool
    #: a v2 catalog's sections: which are held, how to read the others
    _parts: HeldSections | None = None

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
        self._names_tuple: tuple[str, ...] | None = None
        self._given = given
        self._where = where
        self._check_tiling = check_tiling
        self._parts = None
        self._set_rows(rows)

    @property
    def tensors(self) -> Mapping[str, TensorEntry]:
        """fqn -> TensorEntry, each built on first use; a view a call (one held: a reference cycle)."""
        return TensorsView(self._table_of_tensors, self._entry)

    def _set_rows(self, rows: Rows) -> None:
        self._rows = rows
        self._fragments = None
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
        table = cast_columns(table.select(catalog_columns(table.column_names)), where)
        self = cls.__new__(cls)
        tensors = TensorTable()
        files: list[str] = []
        rows = bind_rows(table, tensors, files, where=where, fixed=False)
        self._setup(tensors, files, rows, where=where, check_tiling=True)
        return self

    @property
    def file_names(self) -> tuple[str, ...]:
        """Data file keys the rows refer to (TensorEntry.files are codes into these)."""
        return tuple(self._file_names)

    @property
    def tensor_index(self) -> Mapping[str, int]:
        """fqn -> position in save order, a plain dict (a test of many names, no call each)."""
        return self._table_of_tensors.index

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
        self._load_sections(parts.missing(requests, self._table_of_tensors))

    def require_all(self) -> None:
        """Read every section not held yet (a catalog read in part becomes whole)."""
        if self._parts is not None:
            self._load_sections(np.flatnonzero(~self._parts.loaded))

    def _load_sections(self, todo: np.ndarray) -> None:
        """Read sections ``todo`` (ascending) and hold their rows with the others."""
        parts = self._parts
        if parts is None or not len(todo):
            return
        parts.read(todo, self._table_of_tensors, self._file_names, self._where)
        self._set_rows(Rows.concat([parts.rows[k] for k in sorted(parts.rows)]))
        pa.default_memory_pool().release_unused()  # the sections' Arrow buffers: the rows are numpy now

    def _rows_of(self, t: int) -> np.ndarray:
        return self._order[self._starts[t] : self._starts[t + 1]]

    def entries(self, fqns: Iterable[str]) -> list[TensorEntry]:
        """The entries of ``fqns`` (KeyError for a name not in the catalog), those not
        built yet built together: one gather of their rows per number of dimensions
        and one vectorised tiling check (:mod:`.entries`) instead of one of each per
        tensor. For callers that need many tensors (a rank loading its FSDP shards)."""
        index = self._table_of_tensors.index
        codes = [index[f] for f in fqns]
        todo = [t for t in dict.fromkeys(codes) if t not in self._cache]
        if self._given is None and len(todo) > 1:
            self._build_entries(todo)
        return [self._entry(t) for t in codes]

    def whole_rows(self, fqns: Sequence[str], boxes: Sequence[Box] | None = None) -> WholeRows:
        """Which of ``fqns`` are stored as one row holding the whole tensor, with no
        entry built (:mod:`.whole`); -1 for the others (and all, if built from Fragments).
        With ``boxes``: the one row equal to each box that no other row meets (tiling checked)."""
        complete = None if self.is_whole else self._complete
        args = (fqns, self._table_of_tensors, self._rows, self._starts, self._order)
        usable, names = self._given is None, self._file_names_tuple()
        if boxes is not None:
            return find_exact_rows(*args, boxes, usable=usable, file_names=names, check=self._check_tilings)
        return find_whole_rows(*args, usable=usable, complete=complete, file_names=names)

    def shapes_and_dtypes(self, fqns: Sequence[str]) -> list[tuple[tuple[int, ...], str] | None]:
        """Each of ``fqns``'s global shape and dtype name (None if not held), no entry built."""
        tensors = self._table_of_tensors
        shapes, dtypes = tensors.shapes, tensors.dtypes
        return [None if t is None else (shapes[t], dtypes[t]) for t in map(tensors.index.get, fqns)]

    def shape(self, fqn: str) -> tuple[int, ...]:
        """The global shape of ``fqn`` (KeyError if not held) without building its entry."""
        return self._table_of_tensors.shapes[self._table_of_tensors.index[fqn]]

    def boxes(self, fqns: Iterable[str], *, check_tiling: bool = True) -> list[TensorBoxes]:
        """The stored boxes of ``fqns`` (KeyError if not held), tiling checked as in
        :meth:`entries`, nothing cached, only offsets and lengths gathered: the share_reads
        coordinator matches every rank's boxes and reads no bytes (:mod:`.entries`).
        ``check_tiling=False``: rows gathered from the table are not checked here; the
        caller proves the tiling itself and passes the tensors it could not prove to
        ``boxes`` again (the share_reads coordinator's cut index sorts the rows anyway)."""
        tensors = self._table_of_tensors
        codes = [tensors.index[f] for f in fqns]
        held = [t for t in dict.fromkeys(codes) if t in self._cache or self._given is not None]
        out = {t: TensorBoxes.of(self._entry(t)) for t in held}
        todo = {t: self._rows_of(t) for t in dict.fromkeys(codes) if t not in out}
        out.update(gather_boxes(self._rows, tensors, todo, self._check_tilings if check_tiling else lambda *_a: None))
        return [out[t] for t in codes]

    def _check_tilings(self, codes: list[int], offs: np.ndarray, lens: np.ndarray, counts: list[int]) -> None:
        """FormatError unless the rows of tensors ``codes`` (``counts[i]`` rows each,
        tensor after tensor) tile their shapes exactly; tensors not held whole skipped."""
        if self._check_tiling:
            check_tilings(self._table_of_tensors, codes, offs, lens, counts, self._complete, self._where)

    def _build_entries(self, todo: list[int]) -> None:
        tensors = self._table_of_tensors
        by_ndim: dict[int, list[int]] = {}
        for t in todo:
            by_ndim.setdefault(len(tensors.shapes[t]), []).append(t)
        for ndim, codes in by_ndim.items():
            row_ids = [self._rows_of(t) for t in codes]
            built, offs, lens = gather_entries(self._rows, row_ids, ndim, codes, self._read_only_entry)
            self._check_tilings(codes, offs, lens, [len(r) for r in row_ids])
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
            arrays: tuple[np.ndarray | None, ...] = Rows.no_columns(len(shape))  # given Fragments: kept as given
        else:
            arrays = (*self._rows.take(rows, len(shape)), self._rows.take_digests(rows))
        entry = self._new_entry(t, arrays, frags)
        if check:
            self._check_tilings([t], entry.offsets, entry.lengths, [entry.num_fragments])
            self._cache[t] = entry
        return entry

    def _file_names_tuple(self) -> tuple[str, ...]:
        """The data file names, one tuple shared by every entry (rebuilt as parts add names)."""
        names = self._names_tuple
        if names is None or len(names) != len(self._file_names):
            names = self._names_tuple = tuple(self._file_names)
        return names

    def _read_only_entry(self, t: int, arrays: tuple[Any, ...]) -> TensorEntry:
        return self._new_entry(t, arrays, read_only=True)  # gather_entries' views: read-only already

    def _new_entry(
        self,
        t: int,
        arrays: tuple[Any, ...],
        frags: tuple[Fragment, ...] | None = None,
        *,
        read_only: bool = False,
    ) -> TensorEntry:
        tensors = self._table_of_tensors  # arrays: Rows.take's columns, then the digests (or None)
        offs, lens, byte_offsets, sizes, files, writers, sum_starts, sums, digests = arrays
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
            file_names=self._file_names_tuple(),
            writer_ranks=writers,
            checksum_starts=sum_starts,
            checksum_values=sums,
            fragments=frags,
            read_only=read_only,
            digests=digests,
        )

    def _complete(self, t: int) -> bool:
        """Whether every stored row of tensor ``t`` is held."""
        return self._parts is None or self._parts.complete(t)

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
        return rows_table(self._table_of_tensors, self._file_names, self._rows)

    def to_arrow(self) -> bytes:
        """Catalog v2 bytes (FORMAT.md): sections of rows (zstd Arrow IPC files), then
        the head (tensor, section and span tables) and a fixed trailer."""
        if self._parts is not None and not self._parts.loaded.all():
            raise ValueError(f"{self._where}: a catalog read in part cannot be written")
        return encode(self._table_of_tensors, self._file_names, self._rows)

    def to_arrow_v1(self) -> bytes:
        """Catalog v1 bytes (one Arrow IPC file), for tests of readers that keep loading it."""
        return ipc_file(self.to_table())

    @classmethod
    def from_arrow(cls, data: bytes, *, where: str, checksum_block_bytes: int) -> Catalog:
        """Decode and validate catalog bytes (``where`` names the file in errors).

        Untrusted input: the Arrow messages are bounded before anything is decompressed
        (:func:`check_ipc_budget`), every row is validated, and every malformed input
        raises :class:`FormatError`, never an Arrow, arithmetic or lookup error."""
        return _decoded(where, checksum_block_bytes, lambda: cls._decode(data, where, checksum_block_bytes))

    @classmethod
    def _decode(cls, data: bytes, where: str, checksum_block_bytes: int) -> Catalog:
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
    def from_head(cls, tail: bytes, *, file_size: int, fetch: Fetch, where: str, checksum_block_bytes: int) -> Catalog:
        """A v2 catalog read in part from ``tail``, the last bytes (head and trailer at
        least) of a ``file_size``-byte file; ``fetch(offset, length)`` reads sections
        when :meth:`require` needs them, each checked then (FormatError if malformed)."""
        decode = lambda: cls._open_head(tail, file_size, fetch, where, checksum_block_bytes)  # noqa: E731
        return _decoded(where, checksum_block_bytes, decode)

    @classmethod
    def _open_head(cls, tail: bytes, file_size: int, fetch: Fetch, where: str, checksum_block_bytes: int) -> Catalog:
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
        self._parts = HeldSections(head, fetch, checksum_block_bytes, budget - head.used)
        return self

    @staticmethod
    def tail_bytes(file_size: int, tail: bytes) -> int:
        """How many bytes from the end of a ``file_size``-byte v2 catalog hold its head
        and trailer, given at least its last TRAILER_BYTES ``tail``."""
        head_offset, _crc = read_trailer(tail, file_size, "catalog")
        return file_size - head_offset

    def check_files(self, file_sizes: Mapping[str, int], *, where: str) -> None:
        """Raise FormatError unless every fragment's bytes lie inside a file of
        ``file_sizes`` (the manifest's: path -> bytes), so no planned read asks for more
        than the manifest declares; a catalog read in part checks later sections too."""
        check_rows_in_files(self._rows, self._table_of_tensors, self._file_names, file_sizes, where=where)
        if self._parts is not None:
            self._parts.file_sizes = dict(file_sizes)


def _decoded(where: str, checksum_block_bytes: int, decode: Callable[[], Catalog]) -> Catalog:
    """``decode()``, every malformed input a FormatError naming ``where``."""
    if checksum_block_bytes <= 0:
        raise FormatError(f"{where}: checksum block size {checksum_block_bytes} is not positive")
    try:
        return decode()
    except FormatError:
        raise
    except (pa.ArrowException, ArithmeticError, LookupError, TypeError, ValueError, RecursionError, EOFError) as e:
        raise FormatError(f"{where}: malformed catalog: {type(e).__name__}: {e}") from e
