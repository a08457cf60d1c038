"""The commit protocol, in one place (FORMAT.md, "Commit").

A checkpoint exists exactly when its ``manifest.json`` does. A save writes every
object under a fresh generation prefix, then the catalog, then the manifest
(create-only, or an atomic replace on overwrite; on a store that declares
``Capability.NON_ATOMIC_REPLACE``, an overwrite deletes the old manifest and creates
the new one, see :func:`commit`); it is discarded by deleting its generation. A
checkpoint is deleted manifest first, so a deletion that stops halfway leaves an
incomplete directory, never a committed one with missing data.
Every manifest is parsed here (:func:`parse_manifest`) and written here
(:func:`commit`); opening a checkpoint for reading is ``bcp.reader``'s
(``fetch_metadata``, ``open_reader``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable

from bcp.backends import Backend, Capability, ObjectExistsError, ObjectNotFoundError
from bcp.errors import (
    CheckpointExistsError,
    CommitUncertainError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from bcp.metadata import Catalog, FileEntry, Manifest, crc32c
from bcp.metadata.format_errors import CorruptManifestError
from bcp.metadata.keys import (
    GENERATION_PREFIX,
    HOLDS_DIR,
    MANIFEST_KEY,
    generation_of,
    is_generation,
    manifest_key,
    reference_key,
)

log = logging.getLogger(__name__)


def parse_manifest(backend: Backend, data: bytes, prefix: str = "") -> Manifest:
    """``data`` read from the manifest under ``prefix``, validated (FormatError names
    the file; a manifest failing its own checksum is a CorruptCheckpointError)."""
    try:
        return Manifest.from_json(data, where=f"{backend.uri}/{manifest_key(prefix)}")
    except CorruptManifestError as e:
        raise CorruptCheckpointError(str(e), file=manifest_key(prefix)) from e


#: Hex digits of a save id that hold its start time (Unix seconds); 16 random ones follow.
_TIME_DIGITS = 8
_TIMED_ID = re.compile(r"^[0-9a-f]{24}$")


def new_save_id(now: float | None = None) -> str:
    """A fresh save id: the start time, so housekeeping can tell a save in progress
    from a killed one, then 64 random bits, so two saves never share a generation."""
    seconds = int(time.time() if now is None else now)
    return f"{seconds & 0xFFFFFFFF:0{_TIME_DIGITS}x}{secrets.token_hex(8)}"


def generation_started(generation: str) -> float | None:
    """When the save that writes ``[<prefix>]gen-<id>[/]`` started; None for ids
    without a time (written before bcp recorded it)."""
    name = generation.rstrip("/").rsplit("/", 1)[-1]
    save_id = name[len(GENERATION_PREFIX) :] if name.startswith(GENERATION_PREFIX) else ""
    if not _TIMED_ID.match(save_id):
        return None
    return float(int(save_id[:_TIME_DIGITS], 16))


#: Incomplete saves and partial files younger than this are left alone by gc and by an
#: overwrite's cleanup: they may belong to a save still running (another process,
#: another manager). One hour covers a large save on a slow store; a save running
#: longer than it is still safe (it checks its objects before committing), it only
#: may have to be repeated.
DEFAULT_GRACE_SECONDS = 3600.0


def is_young(generation: str, grace_seconds: float, now: float | None = None) -> bool:
    """Whether ``generation`` started less than ``grace_seconds`` ago, so it may be a
    save still running that housekeeping must not delete. A start time in the future
    (clocks disagree) counts as young."""
    started = generation_started(generation)
    if started is None or grace_seconds <= 0:
        return False
    return (time.time() if now is None else now) - started < grace_seconds


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


def write_catalog(backend: Backend, key: str, catalog: Catalog | bytes) -> FileEntry:
    """Write the catalog of a save (a Catalog, or its bytes already encoded: a save's
    commit encodes its merged rows directly); its entry goes into the manifest."""
    data = catalog if isinstance(catalog, bytes) else catalog.to_arrow()
    backend.write(key, data)
    return FileEntry(key, len(data), crc32c(data))


def check_generation_intact(backend: Backend, generation: str, keys: Iterable[str]) -> None:
    """Before the commit: every object of the save is still there (one listing). A gc,
    ``bcp rm`` or a second manager that deleted part of a save in progress makes the
    save fail here instead of committing a checkpoint whose data is gone. Objects the
    listing misses but ``exists`` finds mean the backend's ``list`` is wrong (it must
    return nested keys), and the error says so instead of blaming another process."""
    present = set(backend.list(generation.rstrip("/") + "/"))
    missing = sorted(set(keys) - present)
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    if _exists_any(backend, missing[:3]):
        raise IncompleteCheckpointError(
            f"the backend's list({generation.rstrip('/') + '/'!r}) at {backend.uri} did not return objects this save "
            f"wrote and that exist ({shown}): list(prefix) must return every key under the prefix, nested keys "
            "included (the conformance check test_list_is_recursive); nothing was committed"
        )
    raise IncompleteCheckpointError(
        f"objects of this save at {backend.uri} were deleted while it was writing ({shown}): "
        "another process (bcp gc, bcp rm, a second CheckpointManager) removed them; nothing was committed"
    )


def check_references_intact(parent: Backend, manifest: Manifest) -> None:
    """Before an incremental save's commit: every sibling's data file its manifest refers
    to is still there (one listing a referenced generation). A save that outlived the
    grace period of a ``bcp gc`` or a second manager, which then deleted its base's
    bytes, fails here instead of committing a checkpoint that cannot load."""
    wanted: dict[str, set[str]] = {}
    for f in manifest.references:
        if f.checkpoint is not None:
            key = reference_key(f.checkpoint, f.path)
            wanted.setdefault(key.rsplit("/data/", 1)[0] + "/", set()).add(key)
    missing = sorted(k for prefix, keys in wanted.items() for k in keys - set(parent.list(prefix)))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise IncompleteCheckpointError(
            f"data files this incremental save refers to at {parent.uri} were deleted while it was writing ({shown}): "
            "another process (bcp gc, bcp rm, a second CheckpointManager) removed them after the save's holds "
            "outlived their grace period (longer than a save must take); nothing was committed"
        )


def _exists_any(backend: Backend, keys: Iterable[str]) -> bool:
    """Whether any of ``keys`` exists; False when the store cannot say (the caller is
    already failing, and a second error would only hide the first)."""
    try:
        return any(backend.exists(k) for k in keys)
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        log.debug("checking objects missing from the listing of %s failed: %s", backend.uri, e)
        return False


def replaces_atomically(backend: Backend) -> bool:
    """Whether a write over an existing object is atomic for readers on ``backend``
    (it does not declare ``Capability.NON_ATOMIC_REPLACE``)."""
    return Capability.NON_ATOMIC_REPLACE not in backend.capabilities


def _landed(backend: Backend, manifest: Manifest) -> bool | None:
    """Whether the manifest under the root is ``manifest`` (True), is not (False), or
    cannot be read to tell (None)."""
    named = landed_generation(backend)
    return None if named is None else named == manifest.generation


def landed_generation(backend: Backend) -> str | None:
    """The generation the manifest under the root names, "" when there is none, None
    when it cannot be read back."""
    try:
        found = read_manifest(backend)
    except Exception as e:  # noqa: BLE001 - any failure to read back means "unknown"
        log.debug("reading back the manifest at %s failed: %s", backend.uri, e)
        return None
    return "" if found is None else found.generation


def commit(backend: Backend, manifest: Manifest, *, overwrite: bool) -> None:
    """Write ``manifest``: the commit. Create-only unless ``overwrite``; losing a
    create-only race raises CheckpointExistsError.

    An overwrite is an atomic replace of the manifest, so readers see the old
    checkpoint or the new one. On a store that declares
    ``Capability.NON_ATOMIC_REPLACE`` (its replace deletes first, so a reader could
    find the key missing anyway) it is done in two steps that bcp controls
    (:func:`_replace_in_two_steps`): delete the old manifest, then create the new one
    create-only. Readers then see the old checkpoint, none (``IncompleteCheckpointError``
    for that short window), or the new one, never a torn or mixed manifest; a failed
    create writes the old manifest back, so a failed overwrite keeps the previous
    checkpoint as on other stores.

    An error from the write is checked by reading the manifest back: when it is this
    save's (the error came after the manifest landed: a directory fsync, a temp-file
    cleanup, a lost answer), the save is committed and the error is logged as a
    warning. When the read-back fails too, CommitUncertainError: the caller must keep
    the data, which may be a committed checkpoint."""
    data = manifest.to_json()
    key = manifest_key()
    if not overwrite:
        _write_manifest(backend, manifest, lambda: backend.write_if_absent(key, data))
    elif replaces_atomically(backend):
        _write_manifest(backend, manifest, lambda: backend.write(key, data))
    else:
        _replace_in_two_steps(backend, manifest, data)


def _replace_in_two_steps(backend: Backend, manifest: Manifest, data: bytes) -> None:
    """Overwrite on a store without atomic replace: keep the old manifest's bytes,
    delete it, create the new one create-only; on any failure, create the old one
    again (create-only, so a manifest that did land, this save's or a racing save's,
    is never replaced). Only a process killed between the delete and the create
    leaves no manifest: both generations are then kept, and nothing is committed."""
    key = manifest_key()
    try:
        old: bytes | None = backend.read(key)
    except ObjectNotFoundError:
        old = None  # nothing to replace (deleted since the save started): a plain create
    try:
        if old is not None:
            backend.delete(key)  # from here until the create, readers find no checkpoint
        _write_manifest(backend, manifest, lambda: backend.write_if_absent(key, data))
    except BaseException as e:
        if old is not None:
            _put_back(backend, old, e)
        raise


def _put_back(backend: Backend, old: bytes, failure: BaseException) -> None:
    """Recreate the manifest an overwrite deleted, unless a manifest is there again."""
    key = manifest_key()
    try:
        backend.write_if_absent(key, old)
    except ObjectExistsError:
        return  # this save's manifest landed after all, or a racing save's did
    except Exception as e:  # noqa: BLE001 - the commit's own error is the one to raise
        log.error(
            "the overwrite at %s deleted the previous %s and could not write it back (%s): "
            "no checkpoint is committed there now",
            backend.uri,
            key,
            e,
        )
        failure.add_note(
            f"the previous checkpoint's {key} at {backend.uri} was deleted for this overwrite and could not be "
            f"written back ({e}): its data is still there, but nothing is committed there now"
        )
        return
    log.warning("the overwrite at %s failed; the previous %s was written back", backend.uri, key)
    failure.add_note(f"the previous checkpoint at {backend.uri} was kept: its {key} was written back")


def _write_manifest(backend: Backend, manifest: Manifest, write: Callable[[], None]) -> None:
    """Run ``write`` (the manifest's write), reading the manifest back on an error to
    tell a commit that landed from one that did not (see :func:`commit`)."""
    try:
        write()
    except ObjectExistsError as e:
        landed = _landed(backend, manifest)
        if landed:  # a retried create whose first answer was lost
            log.warning("committed %s; the store answered a retried commit with %s", backend.uri, e)
            return
        if landed is None:
            raise CommitUncertainError(
                f"could not tell whether this save's manifest was written at {backend.uri} ({e}); its data was kept"
            ) from e
        raise CheckpointExistsError(
            f"another save committed a checkpoint at {backend.uri} while this one was writing; this save was discarded"
        ) from e
    except Exception as e:
        landed = _landed(backend, manifest)
        if landed:
            log.warning("committed %s, but writing its manifest reported an error afterwards: %s", backend.uri, e)
            return
        if landed is None:
            raise CommitUncertainError(
                f"writing the manifest at {backend.uri} failed ({e}) and it cannot be read back: "
                "the save may be committed, so its data was kept; "
                "load it to find out, or save again with overwrite=True"
            ) from e
        raise


def delete_generation(backend: Backend, generation: str) -> None:
    """Delete the objects of one generation (``[<checkpoint>/]gen-<id>``), which no
    manifest may name: a failed save's, or the one an overwrite replaced."""
    backend.delete_prefix(generation.rstrip("/") + "/")


def delete_uncommitted(backend: Backend, prefix: str) -> None:
    """Delete everything under ``prefix`` (ending in ``/``), a directory whose save never
    committed: there is no manifest to delete first."""
    backend.delete_prefix(prefix)


def is_held(backend: Backend, generation: str) -> bool:
    """Whether a newer checkpoint has put a hold on ``generation`` (``gen-<id>/holds/*``,
    FORMAT.md "Holds"). Such a generation is never deleted here: whether the hold is
    live needs the referrer's manifest, beside the checkpoint; ``bcp gc`` of the parent
    (:mod:`bcp.holds`) collects it once its holds are stale."""
    return next(iter(backend.list(f"{generation.rstrip('/')}/{HOLDS_DIR}/")), None) is not None


def discard_partial(backend: Backend, generation: str, *, why: str) -> None:
    """A failed save's generation discarded (:func:`discard_generation`), unless the
    manifest names it or cannot be read back: a Ctrl-C or ``sys.exit`` between the
    manifest landing and the save marking itself committed deleted the data under a
    committed manifest."""
    named = landed_generation(backend)
    if named is None or named == generation:
        log.warning("kept %s %s at %s: the manifest there may name it", why, generation, backend.uri)
    else:
        discard_generation(backend, generation, why=why)


def discard_generation(backend: Backend, generation: str, *, why: str = "the partial save") -> None:
    """Delete one generation's objects, unless it is held (:func:`is_held`: an
    overwrite's replaced generation that a newer checkpoint reads stays whole, retired);
    failures are logged (the caller's error matters more)."""
    try:
        if is_held(backend, generation):
            log.info("kept %s %s at %s whole: newer checkpoints hold its bytes", why, generation, backend.uri)
            return
        delete_generation(backend, generation)
    except Exception as e:  # noqa: BLE001 - leftovers are only space (under a manager root, gc removes them)
        log.warning("could not remove %s %s at %s: %s", why, generation, backend.uri, e)


def delete_checkpoint(backend: Backend, prefix: str = "", *, only_bcp: bool = False) -> None:
    """The checkpoint under ``prefix`` (``""`` or ending in ``/``): manifest first, so
    it stops being committed at once, then its generations, then everything else
    under ``prefix`` unless ``only_bcp`` (``bcp rm``: other files there are not bcp's)."""
    backend.delete(manifest_key(prefix))
    for generation in sorted(generations(backend, prefix)):
        delete_generation(backend, f"{prefix}{generation}")  # whole directories: partial files too
    if not only_bcp:
        backend.delete_prefix(prefix)


def generations(backend: Backend, prefix: str = "") -> set[str]:
    """Names (``gen-<id>``) of the generations under ``prefix``, including those that
    hold only unfinished writes (a save killed before any object was complete)."""
    keys = list(backend.list(f"{prefix}{GENERATION_PREFIX}"))
    keys += [u.name for u in backend.unfinished(f"{prefix}{GENERATION_PREFIX}")]
    names = {key[len(prefix) :].split("/", 1)[0] for key in keys}
    return {name for name in names if is_generation(name)}  # a user's gen-mine/ is not bcp's


def unused_generations(
    backend: Backend, prefix: str = "", *, grace_seconds: float = 0.0, found: Iterable[str] | None = None
) -> list[str]:
    """Generation prefixes (``<prefix>gen-.../``) of the committed checkpoint under
    ``prefix`` that its manifest does not use: left by an overwrite that was killed,
    or being written by one now (those younger than ``grace_seconds`` are left alone).
    ``found``: the generation names (``gen-<id>``) a caller's listing already found
    there (None: list them); only the manifest is read then. Empty when nothing is
    committed there."""
    manifest = read_manifest(backend, prefix)
    if manifest is None:
        return []
    names = generations(backend, prefix) if found is None else set(found)
    live = manifest.generation
    return sorted(f"{prefix}{g}/" for g in names if g != live and not is_young(g, grace_seconds))


def is_own_partial(name: str, prefix: str = "") -> bool:
    """Whether the unfinished write ``name`` (as ``Backend.unfinished`` names it) is
    part of the checkpoint under ``prefix``: inside one of its generations, or a
    half-written ``manifest.json``. Anything else there is not bcp's to remove."""
    if not name.startswith(prefix):
        return False
    rest = name[len(prefix) :]
    return generation_of(rest) is not None or (rest.startswith(MANIFEST_KEY) and "/" not in rest)


def remove_leftovers(backend: Backend, live: str, *, grace_seconds: float) -> list[str]:
    """(coordinator, after an overwrite committed generation ``live`` at the backend's
    root) Delete what killed saves of this location left: every other generation that
    started ``grace_seconds`` ago or more, and half-written manifests as old. Younger
    ones may belong to a save of the same location still running: the rule of
    ``bcp gc`` (docs/manager.md). Best effort: a failure is logged, never raised (the
    checkpoint is committed). Returns what was deleted."""
    removed: list[str] = []
    try:
        names = generations(backend)
        stale = [
            f"{g}/" for g in sorted(names) if g != live and not is_young(g, grace_seconds) and not is_held(backend, g)
        ]
        partial = [  # a generation's partial files go with it
            u.name
            for u in backend.unfinished(MANIFEST_KEY)
            if is_own_partial(u.name) and u.age_seconds >= grace_seconds
        ]
        for generation in stale:
            delete_generation(backend, generation)  # whole directories: their partial files too
            removed.append(generation)
        for name in partial:
            backend.delete_unfinished(name)
            removed.append(name)
    except Exception as e:  # noqa: BLE001 - leftovers are only space; bcp gc removes them later
        log.warning("could not remove what killed saves left at %s: %s", backend.uri, e)
    if removed:
        log.info("removed %d leftover(s) of killed saves at %s: %s", len(removed), backend.uri, ", ".join(removed))
    return removed
