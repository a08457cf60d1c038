"""A v2 catalog read in part: which sections it holds, which a set of boxes needs, and
reading and checking those.

A loading rank of a large checkpoint needs the rows of its own boxes only. It reads
the head (:mod:`.head`), then, for the boxes it wants, the sections whose span index
entries meet the boxes' flat spans (:mod:`.spans`), each fetched with a ranged read and
checked against the head (CRC32C, decode budget, every row, row count, writers, span
index) before its rows join the :class:`~.core.Catalog`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from bcp.metadata.catalog.budget import decode_budget
from bcp.metadata.catalog.head import Head
from bcp.metadata.catalog.spans import flat_spans, section_spans
from bcp.metadata.catalog.tensors import TensorTable
from bcp.metadata.catalog.validate import check_rows_in_files, decode_rows
from bcp.metadata.checksum import crc32c
from bcp.metadata.format_errors import FormatError
from bcp.metadata.rows import Rows

#: ``fetch(offset, length)``: bytes of the catalog file (a ranged read)
Fetch = Callable[[int, int], bytes]
#: a box of a tensor: (offsets, lengths)
Box = tuple[Sequence[int], Sequence[int]]


class HeldSections:
    """A v2 catalog's head and which of its sections a catalog holds."""

    def __init__(self, head: Head, fetch: Fetch, checksum_block_bytes: int, budget_left: int) -> None:
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

    def missing(self, requests: Iterable[tuple[str, Box]], tensors: TensorTable) -> np.ndarray:
        """The sections not held yet (ascending) whose span index entries meet the flat
        spans of the (fqn, box) ``requests``. Unknown tensors and malformed boxes are
        skipped (the caller reports them)."""
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
            return np.zeros(0, np.int64)
        tcode = np.array(codes, dtype=np.int64)
        first, last, live = flat_spans(
            tcode, np.array(starts, np.int64), np.array(offs, np.int64), np.array(lens, np.int64), tensors
        )
        tcode, first, last = tcode[live], first[live], last[live]
        head = self.head
        counts = self.t_starts[tcode + 1] - self.t_starts[tcode]
        total = int(counts.sum())
        step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        span = self.t_order[np.repeat(self.t_starts[tcode], counts) + step]
        lo, hi = np.repeat(first, counts), np.repeat(last, counts)
        meets = (head.span_first[span] <= hi) & (head.span_last[span] >= lo)
        wanted = np.zeros(head.sections, dtype=bool)
        wanted[head.span_section[span[meets]]] = True
        return np.flatnonzero(wanted & ~self.loaded)

    def complete(self, t: int) -> bool:
        """Whether every section holding rows of tensor ``t`` is held."""
        span = self.t_order[self.t_starts[t] : self.t_starts[t + 1]]
        return bool(self.loaded[self.head.span_section[span]].all())

    def read(self, todo: np.ndarray, tensors: TensorTable, file_names: list[str], where: str) -> None:
        """Read sections ``todo`` (ascending), one ranged read per run of adjacent ones,
        into ``rows`` (new file names are appended to ``file_names``)."""
        head = self.head
        runs = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1)
        for run in runs:
            a, b = int(run[0]), int(run[-1])
            start, end = int(head.sec_offset[a]), int(head.sec_offset[b] + head.sec_length[b])
            data = self.fetch(start, end - start)
            if len(data) != end - start:
                raise FormatError(f"{where}: read {len(data)} bytes of catalog sections [{start}, {end})")
            for k in range(a, b + 1):
                lo = int(head.sec_offset[k]) - start
                section = data[lo : lo + int(head.sec_length[k])]
                rows = self._decode(k, section, tensors, file_names, f"{where} (section {k})")
                self._check_digests(k, rows, where)
                self.rows[k] = rows
                self.loaded[k] = True

    def _check_digests(self, k: int, rows: Rows, where: str) -> None:
        """FormatError unless section ``k`` agrees with the sections held on having the
        optional ``digest`` column (a column of a catalog: all its rows have it, or none)."""
        for j, held in self.rows.items():
            if len(held) and len(rows) and (held.digests is None) != (rows.digests is None):
                has, lacks = (j, k) if rows.digests is None else (k, j)
                raise FormatError(
                    f"{where}: section {has} has the digest column and section {lacks} has not (all or none)"
                )

    def _decode(self, k: int, data: bytes, tensors: TensorTable, file_names: list[str], where: str) -> Rows:
        """Section ``k``'s rows, checked against the head: CRC32C, budget, every row,
        tensor table, row count, writers, span index."""
        head = self.head
        if crc32c(data) != int(head.sec_crc[k]):
            raise FormatError(
                f"{where}: fails its CRC32C ({crc32c(data):#010x}, head says {int(head.sec_crc[k]):#010x})"
            )
        budget = min(decode_budget(len(data)), self.budget_left)
        rows, used = decode_rows(data, where, self.checksum_block_bytes, tensors, file_names, fixed=True, budget=budget)
        self.budget_left -= used
        if len(rows) != int(head.sec_rows[k]):
            raise FormatError(f"{where}: holds {len(rows)} rows; the head says {int(head.sec_rows[k])}")
        if len(rows) and (
            (rows.writer < head.sec_first_writer[k]).any() or (rows.writer > head.sec_last_writer[k]).any()
        ):
            raise FormatError(
                f"{where}: holds rows of writers outside "
                f"{int(head.sec_first_writer[k])}..{int(head.sec_last_writer[k])}"
            )
        t, lo, hi = section_spans(rows, tensors)
        ht, hlo, hhi = head.spans_of(k)
        if not (np.array_equal(t, ht) and np.array_equal(lo, hlo) and np.array_equal(hi, hhi)):
            raise FormatError(f"{where}: the head's span index does not match the section's rows")
        if self.file_sizes is not None:
            check_rows_in_files(rows, tensors, file_names, self.file_sizes, where=where)
        return rows
