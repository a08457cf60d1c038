"""``bcp verify``: re-read every byte of a checkpoint and check it.

Checks, per checkpoint: the manifest and catalog parse and the catalog's CRC32C
matches; every data file the manifest lists exists with its recorded size; every
tensor's fragments tile its global shape exactly (no gap, no overlap: the catalog
checks it for every reader, and verify reports each tensor that fails); every
stored fragment's bytes match their per-block CRC32C: every catalog row, replicas
included (a load reads one copy of each box; a damaged second copy would be found
only by the load that happens to pick it), rows that point at the same bytes with
the same checksums (tied weights) once; every object decodes (pickled ones are not
unpickled, only counted).

Rows are read in file order, so fragments that follow each other in a data file
share requests (the reader's coalescing), in batches of at most ``SLICE_BYTES``
(a fragment larger than that is read in pieces of whole checksum blocks): memory
is bounded by the batch, whatever the checkpoint's size. Each problem is reported
once: a missing or mis-sized data file is one problem, and its fragments are not
read again to report it per tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bcp.errors import CheckpointError, PickleNotAllowedError
from bcp.io_scheduler.read_exec import execute_reads
from bcp.io_scheduler.read_plan import RunSet
from bcp.metadata import Fragment, TensorEntry
from bcp.reader import open_checkpoint
from bcp.references import describe_file

#: Bytes read and checked per batch (the memory verify holds for data, besides the
#: reader's coalescing scratch).
SLICE_BYTES = 256 << 20

#: One piece of a stored fragment to read: the row and a byte range inside it.
_Piece = tuple[Fragment, int, int]


def _row_order(entries: list[TensorEntry]) -> np.ndarray:
    """(tensor, row) pairs of every row of ``entries`` to check, sorted by file then
    offset (file order: adjacent fragments coalesce), rows that repeat another's bytes
    and checksums dropped, empty rows dropped (nothing to read)."""
    cols = [
        np.stack(
            [
                np.full(e.num_fragments, t, np.int64),
                np.arange(e.num_fragments, dtype=np.int64),
                e.files.astype(np.int64),
                e.byte_offsets.astype(np.int64),
                e.sizes.astype(np.int64),
            ],
            axis=1,
        )
        for t, e in enumerate(entries)
    ]
    rows = np.concatenate(cols) if cols else np.zeros((0, 5), np.int64)
    rows = rows[rows[:, 4] > 0]
    rows = rows[np.lexsort((rows[:, 4], rows[:, 3], rows[:, 2]))]
    if len(rows) > 1:  # same bytes, same size: keep the first, unless its checksums differ
        same = np.all(rows[1:, 2:] == rows[:-1, 2:], axis=1)
        keep = np.ones(len(rows), bool)
        for i in np.flatnonzero(same).tolist():
            a, b = rows[i], rows[i + 1]
            keep[i + 1] = entries[a[0]].checksums(int(a[1])) != entries[b[0]].checksums(int(b[1]))
        rows = rows[keep]
    return rows


def _pieces(entries: list[TensorEntry], rows: np.ndarray, block: int) -> Iterator[_Piece]:
    """Every row's bytes, in pieces of at most SLICE_BYTES cut at checksum-block
    boundaries (a block larger than that is one piece)."""
    step = max(block, SLICE_BYTES // block * block)
    for t, i in rows[:, :2].tolist():
        frag = entries[t].fragment(i)
        for start in range(0, frag.nbytes, step):
            yield frag, start, min(step, frag.nbytes - start)


def _where(frag: Fragment) -> str:
    """The catalog row, for a problem: a replica's box alone would not say which copy."""
    return (
        f"the catalog row of {frag.fqn!r} for box offsets={list(frag.offsets)} lengths={list(frag.lengths)} "
        f"stored from byte {frag.byte_offset} of its file, written by rank {frag.writer_rank}"
    )


def verify_checkpoint(uri: str, *, progress: Callable[[int, str], Any] | None = None) -> dict:
    """Check the checkpoint at ``uri`` (see the module's docstring); a report:
    ``ok``, ``problems`` (one line each), counts and seconds. Raises only when the
    manifest or catalog cannot be opened at all."""
    start = time.perf_counter()
    problems: list[str] = []
    reader = open_checkpoint(uri, verify=True)  # parses manifest and catalog, checks the catalog CRC
    backend = reader.backend
    bad_files: set[str] = set()
    refs, where = {f.path for f in reader.manifest.references}, describe_file(backend)

    def named(path: str) -> str:  # a reference: where, in which sibling, the file lies
        return where(path) if path in refs else repr(path)

    for entry in reader.manifest.data_files:
        try:
            size = backend.size(entry.path)
        except FileNotFoundError:
            problems.append(f"data file {named(entry.path)} is missing")
            bad_files.add(entry.path)
            continue
        if size != entry.nbytes:
            problems.append(f"data file {named(entry.path)} has {size} bytes; the manifest says {entry.nbytes}")
            bad_files.add(entry.path)
    entries: list[TensorEntry] = []
    for fqn in reader.tensor_keys():
        try:  # the catalog refuses a tensor whose fragments do not tile it (FormatError)
            entries.append(reader.meta(fqn).entry)
        except CheckpointError as e:
            problems.append(f"{type(e).__name__}: {e}")
    rows = _row_order(entries)
    if bad_files and len(rows):  # reported above, once: their rows are not read
        names = entries[0].file_names
        skip = np.array([names[c] in bad_files for c in range(len(names))], bool)
        skipped_rows = rows[skip[rows[:, 2]]]
        rows = rows[~skip[rows[:, 2]]]
    else:
        skipped_rows = rows[:0]
    block = reader.manifest.checksum_block_bytes
    bar = progress(int(rows[:, 4].sum()), "verifying") if progress else None
    read = 0
    failed: set[Fragment] = set()

    def run(pieces: list[_Piece]) -> None:
        views = [memoryview(bytearray(n)) for _f, _s, n in pieces]
        plans = [
            RunSet(frag, i, np.array([s], np.int64), np.zeros(1, np.int64), n) for i, (frag, s, n) in enumerate(pieces)
        ]
        execute_reads(backend, plans, views, block_bytes=block, verify=True)

    def check(batch: list[_Piece]) -> None:
        """Read and check a batch together; on an error, fragment by fragment, so that
        every bad fragment is named once and a fragment's later pieces are skipped."""
        nonlocal read
        batch = [p for p in batch if p[0] not in failed]
        try:
            run(batch)
        except (CheckpointError, OSError):
            by_fragment: dict[Fragment, list[_Piece]] = {}
            for piece in batch:
                by_fragment.setdefault(piece[0], []).append(piece)
            batch = []
            for frag, pieces in by_fragment.items():
                try:
                    run(pieces)
                    batch += pieces
                except (CheckpointError, OSError) as e:
                    problems.append(f"{type(e).__name__}: {e} ({_where(frag)})")
                    failed.add(frag)
        n = sum(p[2] for p in batch)
        read += n
        if bar is not None:
            bar.update(n)

    try:
        batch: list[_Piece] = []
        held = 0
        for piece in _pieces(entries, rows, block):
            if held + piece[2] > SLICE_BYTES and batch:
                check(batch)
                batch, held = [], 0
            batch.append(piece)
            held += piece[2]
        if batch:
            check(batch)
        for fqn in reader.object_keys():
            try:
                reader.read_object(fqn) if not reader.is_per_rank(fqn) else reader.per_rank_objects(fqn)
            except PickleNotAllowedError:
                pass  # stored as a pickle: its bytes were checked, running it is not verify's to decide
            except CheckpointError as e:
                problems.append(f"object {fqn!r}: {e}")
    finally:
        if bar is not None:
            bar.close()
    # fragments: stored fragments to check (each stored copy once, empty ones not
    # counted); fragments_ok: those read whose bytes matched; bytes_read: their bytes
    return {
        "uri": reader.uri,
        "ok": not problems,
        "problems": problems,
        "tensors": len(reader.tensor_keys()),
        "objects": len(reader.object_keys()),
        "fragments": len(rows) + len(skipped_rows),
        "fragments_ok": len(rows) - len(failed),
        "bytes_read": read,
        "seconds": round(time.perf_counter() - start, 3),
    }
