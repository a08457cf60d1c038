"""The commit protocol, in one place (FORMAT.md, "Commit").

A checkpoint exists exactly when its ``manifest.json`` does. A save writes every
object under a fresh generation prefix, then the catalog, then the manifest
(create-only, or an atomic replace on overwrite); it is discarded by deleting its
generation. A checkpoint is deleted manifest first, so a deletion that stops
halfway leaves an incomplete directory, never a committed one with missing data.
Every reader and writer of manifests (save, load, ``bcp.open``, the manager and
the CLI) goes through this module.
"""

from __future__ import annotations

import dataclasses
import logging

from bcp.backends import Backend, ObjectExistsError, ObjectNotFoundError
from bcp.metadata import Catalog, FileEntry, Manifest, crc32c
from bcp.metadata.layout import GENERATION_PREFIX, manifest_key

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

log = logging.getLogger(__name__)


def parse_manifest(backend: Backend, data: bytes, prefix: str = "") -> Manifest:
    """``data`` read from the manifest under ``prefix``, validated (FormatError names the file)."""
    return Manifest.from_json(data, where=f"{backend.uri}/{manifest_key(prefix)}")


def read_manifest(backend: Backend, prefix: str = "") -> Manifest | None:
    """The committed manifest under ``prefix``; None when there is none."""
    try:
        data = backend.read(manifest_key(prefix))
    except ObjectNotFoundError:
        return None
    return parse_manifest(backend, data, prefix)


@dataclasses.dataclass(frozen=True)
class ExistingCheckpoint:
    """What a save finds at its target: a committed checkpoint, readable or not."""

    #: None when the manifest is there but cannot be parsed (it still counts as committed)
    manifest: Manifest | None


def find_existing(backend: Backend) -> ExistingCheckpoint | None:
    """The checkpoint a save would replace; None when nothing is committed there."""
    if not backend.exists(manifest_key()):
        return None
    try:
        return ExistingCheckpoint(read_manifest(backend))
    except Exception as e:  # noqa: BLE001 - an unreadable old manifest still blocks a non-overwrite save
        log.warning("existing manifest at %s is unreadable: %s", backend.uri, e)
        return ExistingCheckpoint(None)


def fetch_metadata(backend: Backend) -> tuple[bytes, bytes]:
    """The manifest's and the catalog's bytes, checked against each other (one rank
    reads them and shares the bytes). Distinguishes nothing there from a save that
    never committed."""
    try:
        manifest_bytes = backend.read(manifest_key())
    except ObjectNotFoundError:
        if next(iter(backend.list("")), None) is not None:
            raise IncompleteCheckpointError(
                f"{backend.uri} has no {manifest_key()}: a save started there and never committed "
                "(it failed, was killed, or is still running), so there is no checkpoint to load"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {backend.uri}") from None
    cat = parse_manifest(backend, manifest_bytes).catalog
    try:
        data = backend.read(cat.path)
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(f"catalog {cat.path!r} of {backend.uri} is missing", file=cat.path) from e
    if len(data) != cat.nbytes or crc32c(data) != cat.crc32c:
        raise CorruptCheckpointError(
            f"catalog {cat.path!r} of {backend.uri} does not match the manifest "
            f"({len(data)} bytes, crc32c {crc32c(data):#010x}; expected {cat.nbytes} bytes, {cat.crc32c:#010x})",
            file=cat.path,
        )
    return manifest_bytes, data


def write_catalog(backend: Backend, key: str, catalog: Catalog) -> FileEntry:
    """Write the catalog of a save; its entry goes into the manifest."""
    data = catalog.to_arrow()
    backend.write(key, data)
    return FileEntry(key, len(data), crc32c(data))


def commit(backend: Backend, manifest: Manifest, *, overwrite: bool) -> None:
    """Write ``manifest``: the commit. Create-only unless ``overwrite`` (then an atomic
    replace); losing a create-only race raises CheckpointExistsError."""
    data = manifest.to_json()
    if overwrite:
        backend.write(manifest_key(), data)
        return
    try:
        backend.write_if_absent(manifest_key(), data)
    except ObjectExistsError as e:
        raise CheckpointExistsError(
            f"another save committed a checkpoint at {backend.uri} while this one was writing; this save was discarded"
        ) from e


def delete_generation(backend: Backend, generation: str) -> None:
    """Delete the objects of one generation (``[<checkpoint>/]gen-<id>``), which no
    manifest may name: a failed save's, or the one an overwrite replaced."""
    backend.delete_prefix(generation.rstrip("/") + "/")


def delete_uncommitted(backend: Backend, prefix: str) -> None:
    """Delete everything under ``prefix`` (ending in ``/``), a directory whose save never
    committed: there is no manifest to delete first."""
    backend.delete_prefix(prefix)


def discard_generation(backend: Backend, generation: str, *, why: str = "the partial save") -> None:
    """Delete one generation's objects; failures are logged (the caller's error matters more)."""
    try:
        delete_generation(backend, generation)
    except Exception as e:  # noqa: BLE001 - leftovers are only space (under a manager root, gc removes them)
        log.warning("could not remove %s %s at %s: %s", why, generation, backend.uri, e)


def delete_checkpoint(backend: Backend, prefix: str = "") -> None:
    """The checkpoint under ``prefix`` (``""`` or ending in ``/``): manifest first, so
    it stops being committed at once, then everything else."""
    backend.delete(manifest_key(prefix))
    backend.delete_prefix(prefix)


def unused_generations(backend: Backend, prefix: str = "") -> list[str]:
    """Generation prefixes (``<prefix>gen-.../``) of the committed checkpoint under
    ``prefix`` that its manifest does not use: left by an overwrite that was killed.
    Empty when nothing is committed there."""
    manifest = read_manifest(backend, prefix)
    if manifest is None:
        return []
    live = manifest.generation
    found = {key[len(prefix) :].split("/", 1)[0] for key in backend.list(f"{prefix}{GENERATION_PREFIX}")}
    return sorted(f"{prefix}{g}/" for g in found if g != live)
