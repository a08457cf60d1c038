"""Reading as little of a large catalog as a rank needs (catalog v2, FORMAT.md).

A load's coordinator reads the manifest and, for a small catalog, the whole catalog
(every rank gets the bytes, as before catalog v2). For a large one it reads only the
head and the trailer at the end of the file (ranged reads) and shares those; every
rank then reads, itself, only the sections that its wanted boxes need
(``reader.catalog.require``). At 16,384 ranks no rank receives the whole catalog.
"""

from __future__ import annotations

from bcp.backends import Backend, ObjectNotFoundError
from bcp.metadata import Catalog
from bcp.metadata.catalog.sections import TRAILER, is_v2

from .commit import fetch_catalog, fetch_manifest, parse_manifest
from .errors import CorruptCheckpointError
from .reader import CheckpointReader, declared_sizes

#: catalogs up to this size are read whole by the coordinator and shared
WHOLE_CATALOG_BYTES = 8 << 20
#: the coordinator's first read of a large catalog's end: the head is usually inside
TAIL_GUESS_BYTES = 1 << 20


def fetch_load_metadata(backend: Backend) -> tuple[bytes, bytes, bool]:
    """(manifest bytes, catalog bytes, partial): the whole catalog when it is small (or
    a v1 catalog), else only its last bytes holding the head and the trailer
    (``partial``). Run by one rank; every rank gets the result."""
    manifest_bytes, manifest = fetch_manifest(backend)
    cat = manifest.catalog
    if cat.nbytes <= WHOLE_CATALOG_BYTES:
        return manifest_bytes, fetch_catalog(backend, manifest), False
    try:
        size = backend.size(cat.path)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {cat.path!r} of {backend.uri} is missing", file=cat.path) from e
    if size != cat.nbytes:
        raise CorruptCheckpointError(
            f"catalog {cat.path!r} of {backend.uri} holds {size} bytes; the manifest says {cat.nbytes}",
            file=cat.path,
        )
    guess = min(TAIL_GUESS_BYTES, size)
    tail = _ranged(backend, cat.path, size - guess, guess)
    if not is_v2(tail):  # a v1 catalog: one Arrow file, read whole
        return manifest_bytes, fetch_catalog(backend, manifest), False
    need = Catalog.tail_bytes(size, tail[-TRAILER.size :])
    if need > len(tail):
        tail = _ranged(backend, cat.path, size - need, need - len(tail)) + tail
    return manifest_bytes, tail[len(tail) - need :], True


def _ranged(backend: Backend, key: str, offset: int, length: int) -> bytes:
    try:
        data = backend.read(key, offset, length)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {key!r} of {backend.uri} is missing", file=key) from e
    if len(data) != length:
        raise CorruptCheckpointError(
            f"catalog {key!r} of {backend.uri} ended before byte {offset + length} "
            f"({len(data)} of {length} bytes from {offset})",
            file=key,
            offset=offset + len(data),
        )
    return data


def reader_from_head(
    backend: Backend, manifest_bytes: bytes, tail: bytes, *, allow_pickle: bool = False, verify: bool = True
) -> CheckpointReader:
    """A reader over a catalog read in part: ``tail`` holds the catalog's head and
    trailer (from :func:`fetch_load_metadata`); sections are read from ``backend``
    when ``reader.catalog.require`` asks for them, each checked against the head."""
    manifest = parse_manifest(backend, manifest_bytes)
    path = manifest.catalog.path
    where = f"{backend.uri}/{path}"
    sizes = declared_sizes(backend, manifest)

    def fetch(offset: int, length: int) -> bytes:
        return _ranged(backend, path, offset, length)

    catalog = Catalog.from_head(
        tail,
        file_size=manifest.catalog.nbytes,
        fetch=fetch,
        where=where,
        checksum_block_bytes=manifest.checksum_block_bytes,
    )
    catalog.check_files(sizes, where=where)
    reader = CheckpointReader(backend, manifest, catalog, allow_pickle=allow_pickle, verify=verify)
    reader.check_keys()
    return reader
