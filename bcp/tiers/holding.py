"""``holding.json``: the data files one host holds for one local step, each checked.

A data file counts for recovery only once it is listed here, and it is listed only
after its size and digest were recomputed from the bytes on this host and matched
the manifest (``FileEntry.nbytes`` and ``FileEntry.crc32c``: a CRC32C over the
block checksums of the file's fragments, in file order; metadata/FORMAT.md). A file
cut short by a host that died while receiving it is therefore never used.

Several ranks of a host add files to the same ``holding.json``: each takes an
exclusive ``flock`` on ``holding.lock`` beside it, reads, adds, and replaces the file
atomically (a partial file, then ``rename``), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from bcp.metadata import Catalog, FileEntry, block_checksums, digest_of_checksums

from .paths import HOLDING_LOCK, HOLDING_NAME

FORMAT = "bcp-holding"
VERSION = 1
#: bytes read at a time when a file is verified (a multiple of any block size up to it)
READ_BYTES = 16 << 20


def read_holding(step_dir: str) -> dict[str, Any] | None:
    """The parsed ``holding.json`` of a step directory; None when there is none."""
    try:
        with open(os.path.join(step_dir, HOLDING_NAME), "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{step_dir}/{HOLDING_NAME} is not a {FORMAT} file")
    return doc


def held_files(step_dir: str, save_id: str) -> dict[str, FileEntry]:
    """The data files listed for the save ``save_id`` (none for another save's list)."""
    doc = read_holding(step_dir)
    if doc is None or doc.get("save_id") != save_id:
        return {}
    return {path: FileEntry(path, e["nbytes"], e["crc32c"]) for path, e in doc["files"].items()}


@contextlib.contextmanager
def _locked(step_dir: str) -> Iterator[None]:
    fd = os.open(os.path.join(step_dir, HOLDING_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def add_held(step_dir: str, save_id: str, entries: Sequence[FileEntry]) -> None:
    """List ``entries`` (checked files of the save ``save_id``) in the step's
    ``holding.json``, under the host's lock; a list of another save is replaced."""
    os.makedirs(step_dir, exist_ok=True)
    with _locked(step_dir):
        doc = read_holding(step_dir)
        files: dict[str, Any] = dict(doc["files"]) if doc is not None and doc.get("save_id") == save_id else {}
        for e in entries:
            files[e.path] = {"nbytes": e.nbytes, "crc32c": e.crc32c}
        data = json.dumps(
            {"format": FORMAT, "version": VERSION, "save_id": save_id, "files": dict(sorted(files.items()))},
            indent=1,
        ).encode("utf-8")
        final = os.path.join(step_dir, HOLDING_NAME)
        tmp = f"{final}.partial-{secrets.token_hex(4)}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)


def file_spans(catalog: Catalog) -> dict[str, list[tuple[int, int]]]:
    """Each data file's fragments as (byte offset, bytes), in file order, each once
    (rows of tied weights share their bytes); empty fragments are left out: they have
    no checksum blocks."""
    names = catalog.file_names
    spans: dict[int, set[tuple[int, int]]] = {}
    for fqn in catalog.tensors:
        entry = catalog.tensors[fqn]
        for code, off, n in zip(entry.files.tolist(), entry.byte_offsets.tolist(), entry.sizes.tolist(), strict=True):
            if n:
                spans.setdefault(code, set()).add((off, n))
    return {names[code]: sorted(s) for code, s in spans.items()}


def file_digest(path: str, spans: Sequence[tuple[int, int]], block_bytes: int) -> tuple[int, int]:
    """(size, digest) of the file at ``path``: the digest recomputed from its bytes
    (each fragment in ``block_bytes`` blocks from its first byte), read in pieces of
    at most READ_BYTES."""
    step = max(block_bytes, READ_BYTES // block_bytes * block_bytes)
    sums: list[int] = []
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        for offset, nbytes in spans:
            done = 0
            while done < nbytes:
                take = min(step, nbytes - done)
                data = os.pread(fd, take, offset + done)
                if len(data) != take:
                    return size, -1  # the file ends inside a fragment
                sums.extend(block_checksums(data, block_bytes))
                done += take
    finally:
        os.close(fd)
    return size, digest_of_checksums(sums)


def verify(path: str, entry: FileEntry, spans: Mapping[str, Sequence[tuple[int, int]]], block_bytes: int) -> str | None:
    """Why the file at ``path`` is not ``entry`` (its size or digest differ), or None when it is."""
    try:
        size, digest = file_digest(path, spans.get(entry.path, ()), block_bytes)
    except OSError as e:
        return f"cannot read it: {e}"
    if size != entry.nbytes:
        return f"it has {size} bytes; the manifest says {entry.nbytes}"
    if digest != entry.crc32c:
        return f"its digest is {digest:#010x}; the manifest says {entry.crc32c:#010x}"
    return None
