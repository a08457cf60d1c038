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

An incremental checkpoint's references (metadata/FORMAT.md, "References") are
checked as its own rows are: a bad block in a sibling's file is reported naming the
file, its owner checkpoint and the offset, by every checkpoint that reads it.
:func:`verify_root` checks every committed checkpoint under a root with one
:class:`SharedChecks`: a stored fragment that several checkpoints share (the same
owner's file, offset, size and checksums) is read once, and its result, good or bad,
reported for each of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bcp.backends import Backend, StorageError, backend_for, join_uri
from bcp.discovery import FIND_MAX_DEPTH, find_checkpoints
from bcp.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, PickleNotAllowedError
from bcp.io_scheduler.read_exec import execute_reads
from bcp.io_scheduler.read_plan import RunSet
from bcp.metadata import Fragment, TensorEntry
from bcp.metadata.keys import split_parent
from bcp.reader import open_checkpoint
from bcp.references import ReferencingBackend, describe_file

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


#: A stored fragment's identity across checkpoints: where its file lies (the owner's
#: location and the file's path), its offset, size and block checksums.
_Stored = tuple[str, str, int, int, tuple[int, ...]]


@dataclasses.dataclass
class SharedChecks:
    """What :func:`verify_root` has checked so far, shared by its checkpoints: each
    stored fragment's outcome (None: its bytes matched; else the problem and the bad
    block's file and offset), and each data file's (None: there with its size)."""

    fragments: dict[_Stored, tuple[str, str, int | None] | None] = dataclasses.field(default_factory=dict)
    files: dict[tuple[str, str, int], str | None] = dataclasses.field(default_factory=dict)
    #: the checkpoints (URIs) that use each stored fragment and data file, in the order checked
    users: dict[object, list[str]] = dataclasses.field(default_factory=dict)

    def use(self, key: object, uri: str) -> None:
        users = self.users.setdefault(key, [])
        if not users or users[-1] != uri:
            users.append(uri)


def _owners(uri: str, backend: Backend) -> Callable[[str], str]:
    """``owner(path)``: the URI of the checkpoint whose generation holds data file
    ``path`` of the checkpoint at ``uri`` (itself, or the sibling a reference names),
    built the same way whichever checkpoint asks."""
    try:
        parent, name = split_parent(uri)
    except ValueError:  # no parent segment: no references either
        return lambda _path: uri
    own = join_uri(parent, name)
    if isinstance(backend, ReferencingBackend):
        owners = backend.owners
        return lambda path: join_uri(parent, owners[path]) if path in owners else own
    return lambda _path: own


def verify_checkpoint(
    uri: str, *, progress: Callable[[int, str], Any] | None = None, shared: SharedChecks | None = None
) -> dict:
    """Check the checkpoint at ``uri`` (see the module's docstring); a report:
    ``ok``, ``problems`` (one line each), counts and seconds. Raises only when the
    manifest or catalog cannot be opened at all. With ``shared``, a fragment or file
    already checked (for another checkpoint) is not read again: its outcome is reused."""
    start = time.perf_counter()
    problems: list[str] = []
    reader = open_checkpoint(uri, verify=True)  # parses manifest and catalog, checks the catalog CRC
    backend = reader.backend
    owner = _owners(uri, backend)
    bad_files: set[str] = set()
    refs, where = {f.path for f in reader.manifest.references}, describe_file(backend)

    def named(path: str) -> str:  # a reference: where, in which sibling, the file lies
        return where(path) if path in refs else repr(path)

    for entry in reader.manifest.data_files:
        known = (owner(entry.path), entry.path, entry.nbytes)
        if shared is not None:
            shared.use(known, uri)
        if shared is not None and known in shared.files:
            problem = shared.files[known]
        else:
            problem = None
            try:
                size = backend.size(entry.path)
                if size != entry.nbytes:
                    problem = f"data file {named(entry.path)} has {size} bytes; the manifest says {entry.nbytes}"
            except FileNotFoundError:
                problem = f"data file {named(entry.path)} is missing"
            except StorageError as e:  # a link where the file should be, a denied read: a problem, not a raise
                problem = f"data file {named(entry.path)}: {e.reason}"
            if shared is not None:
                shared.files[known] = problem
        if problem is not None:
            problems.append(problem)
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
    file_names = entries[0].file_names if entries else []
    total = len(rows) + len(skipped_rows)

    def stored(t: int, i: int, c: int) -> _Stored:
        frag = entries[t].fragment(i)
        return (owner(file_names[c]), frag.file, frag.byte_offset, frag.nbytes, tuple(frag.checksums))

    known_ok = 0
    if shared is not None and len(rows):  # fragments checked for another checkpoint: their outcome, not a read
        fresh = np.ones(len(rows), bool)
        for n, (t, i, c) in enumerate(rows[:, :3].tolist()):
            key = stored(t, i, c)
            shared.use(key, uri)
            if key not in shared.fragments:
                continue
            fresh[n] = False
            outcome = shared.fragments[key]
            if outcome is None:
                known_ok += 1
            else:
                problems.append(f"{outcome[0]} ({_where(entries[t].fragment(i))})")
        rows = rows[fresh]
    block = reader.manifest.checksum_block_bytes
    bar = progress(int(rows[:, 4].sum()), "verifying") if progress else None
    read = 0
    failed: dict[Fragment, tuple[str, str, int | None]] = {}

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
                    bad = (e.file, e.offset) if isinstance(e, CorruptCheckpointError) else (None, None)
                    failed[frag] = (f"{type(e).__name__}: {e}", bad[0] or frag.file, bad[1])
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
        if shared is not None:
            for t, i, c in rows[:, :3].tolist():
                shared.fragments[stored(t, i, c)] = failed.get(entries[t].fragment(i))
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
    # counted); fragments_ok: those whose bytes matched (read now, or for another
    # checkpoint: fragments_known); bytes_read: bytes read now
    return {
        "uri": reader.uri,
        "ok": not problems,
        "problems": problems,
        "tensors": len(reader.tensor_keys()),
        "objects": len(reader.object_keys()),
        "fragments": total,
        "fragments_ok": len(rows) - len(failed) + known_ok,
        "fragments_known": known_ok,
        "bytes_read": read,
        "seconds": round(time.perf_counter() - start, 3),
    }


def verify_root(uri: str, *, progress: Callable[[int, str], Any] | None = None) -> dict:
    """Check every committed checkpoint at or below ``uri`` (a manager root, or any
    folder of checkpoints: :func:`bcp.discovery.find_checkpoints`), each stored byte
    read once: fragments and data files that checkpoints share (references) are checked
    for the first and their outcome reused for the others. A report: ``ok``,
    ``problems`` (``PATH: problem``, one per problem per checkpoint), ``checkpoints``
    (each one's :func:`verify_checkpoint` report with its ``path``), ``damaged`` (each
    bad stored fragment or data file once: its problem, ``file`` and ``offset`` of the
    bad block, and every checkpoint that uses it), counts and seconds.
    CheckpointNotFoundError when there is no committed checkpoint there."""
    start = time.perf_counter()
    backend = backend_for(uri)
    try:
        found = find_checkpoints(backend)
        where = backend.uri
    finally:
        backend.close()
    committed = [c for c in found.checkpoints if c.committed]
    if not committed:
        raise CheckpointNotFoundError(
            f"{where} holds no committed checkpoint at or below it "
            f"(bcp verify looks {FIND_MAX_DEPTH} levels down; name a deeper folder for deeper ones)"
        )
    shared = SharedChecks()
    reports: list[dict] = []
    path_of: dict[str, str] = {}
    for c in committed:
        at = join_uri(uri, c.path) if c.path else uri
        path_of[at] = c.path or "."
        try:
            report = verify_checkpoint(at, progress=progress, shared=shared)
        except (CheckpointError, OSError) as e:  # its manifest or catalog cannot be read: the others go on
            report = {"uri": at, "ok": False, "problems": [f"{type(e).__name__}: {e}"], "tensors": 0, "objects": 0}
            report |= {"fragments": 0, "fragments_ok": 0, "fragments_known": 0, "bytes_read": 0}
        report["path"] = path_of[at]
        reports.append(report)
    damaged = []
    for key, outcome in [*shared.fragments.items(), *shared.files.items()]:
        if outcome is None:
            continue
        problem, file, offset = (outcome, key[1], None) if isinstance(outcome, str) else outcome
        owner = str(key[0])
        damaged.append(
            {
                "problem": problem,
                "file": f"{owner.partition('?')[0].rstrip('/')}/{file}",
                "offset": offset,
                "checkpoints": [path_of.get(u, u) for u in shared.users.get(key, [])],
            }
        )
    return {
        "uri": where,
        "ok": all(r["ok"] for r in reports),
        "problems": [f"{r['path']}: {p}" for r in reports for p in r["problems"]],
        "checkpoints": reports,
        "damaged": damaged,
        "truncated": found.truncated,
        "fragments": sum(r["fragments"] for r in reports),
        "fragments_ok": sum(r["fragments_ok"] for r in reports),
        "fragments_known": sum(r["fragments_known"] for r in reports),
        "bytes_read": sum(r["bytes_read"] for r in reports),
        "seconds": round(time.perf_counter() - start, 3),
    }
