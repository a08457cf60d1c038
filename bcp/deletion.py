"""``bcp.delete`` and ``bcp.exists``: the library's ``bcp rm``, for code (framework
plugins, training scripts) that removes or probes one checkpoint by URI.

The safety rules are ``bcp rm``'s: which objects are the checkpoint's is
:func:`bcp.discovery.checkpoint_objects` (``manifest.json`` and ``gen-*/``);
anything else at the location is not bcp's and is left; a location that holds no
committed checkpoint is refused unless ``uncommitted=True``; a local location that
is a symbolic link is always refused. Neither call is collective: call it from one
rank (or from each rank on its own checkpoint).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from bcp.backends import Backend, backend_for
from bcp.backends.file import file_directory
from bcp.discovery import CheckpointObjects, checkpoint_objects
from bcp.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from bcp.holds import Deletion, HoldChecker, delete_checkpoint, describe_retired
from bcp.metadata.keys import MANIFEST_KEY, split_parent
from bcp.target import Target, resolve_backend

log = logging.getLogger(__name__)


def exists(uri: Target, *, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether a committed bcp checkpoint is at ``uri`` (its ``manifest.json`` is
    there). False for a location that is missing, empty, holds only an unfinished
    save, or holds other files; the manifest's contents are not read (``bcp.open``
    checks those)."""
    backend = resolve_backend(uri, storage_options)
    return backend.exists(MANIFEST_KEY)


def delete(
    uri: Target,
    *,
    missing_ok: bool = False,
    uncommitted: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Delete the checkpoint at ``uri``: its manifest first (it stops being a committed
    checkpoint at once), then its generations, partial files included. Returns the
    keys of the objects left there because they are not bcp's (they are logged too).

    Refuses with :class:`~bcp.CheckpointNotFoundError` when nothing is there (unless
    ``missing_ok``), with :class:`~bcp.IncompleteCheckpointError` when there is no
    ``manifest.json`` (unless ``uncommitted``: a save that never committed), and with
    :class:`~bcp.CheckpointError` for a local path that is a symbolic link or a file. On the
    file backend no directory the deletion emptied is left, the checkpoint's own
    directory included."""
    backend = resolve_backend(uri, storage_options)
    where = backend.uri  # credentials redacted
    found = deletable(backend, uncommitted=uncommitted, tool="bcp.delete", force="pass uncommitted=True")
    if found is None:
        if missing_ok:
            return []
        raise CheckpointNotFoundError(f"no checkpoint at {where}: nothing is there")
    done = delete_by_holds(uri, backend, storage_options)
    if done.retired:
        log.warning(
            "bcp.delete %s: kept generation(s) whole for newer checkpoints: %s", where, describe_retired(done.retired)
        )
    if found.other_keys:
        log.warning(
            "bcp.delete %s: left %d object(s) that are not bcp's: %s",
            where,
            len(found.other_keys),
            ", ".join(found.other_keys[:5]) + (", ..." if len(found.other_keys) > 5 else ""),
        )
    remove_emptied_root(backend)
    log.info("bcp.delete %s: deleted %d object(s)", where, len(found.bcp_keys))
    return list(found.other_keys)


def parent_of(target: Target, backend: Backend, storage_options: Mapping[str, Any] | None) -> tuple[Backend, str]:
    """The backend of the checkpoint's parent (same storage options) and its name there:
    holds name siblings, whose manifests say which of its bytes must stay. A Backend
    object has no URI to find a parent from: the checkpoint itself, name ``""`` (every
    hold on it then counts as live)."""
    if isinstance(target, Backend):
        return backend, ""
    try:
        parent, name = split_parent(os.fspath(target))
    except ValueError:
        return backend, ""
    return backend_for(parent, **dict(storage_options or {})), name


def delete_by_holds(target: Target, backend: Backend, storage_options: Mapping[str, Any] | None = None) -> Deletion:
    """Delete the checkpoint at ``target`` (``backend``: its own) by the holds' rule
    (:func:`bcp.holds.delete_checkpoint`): its manifest first, then every generation no
    newer sibling holds; held ones stay whole (retired), each with who keeps it."""
    parent, name = parent_of(target, backend, storage_options)
    return delete_checkpoint(parent, name, HoldChecker(parent), only_bcp=True)


def remove_emptied_root(backend: Backend) -> None:
    """After a deletion, on the file backend: remove the checkpoint's own directory if
    it is now empty (other files keep it), so ``bcp rm`` and ``bcp.delete`` leave no
    empty directory behind."""
    root = file_directory(backend)
    if root is not None:
        try:
            os.rmdir(root)  # only when empty; never a link (deletable refused those)
        except OSError:
            pass


def deletable(backend: Backend, *, uncommitted: bool, tool: str, force: str) -> CheckpointObjects | None:
    """The checks ``bcp.delete`` and ``bcp rm`` share before they delete: the objects of
    the checkpoint at ``backend`` (None: nothing is there, not even a save's partial
    files). Refuses a local location that is a symbolic link or a file, and one with no
    ``manifest.json`` unless ``uncommitted`` (``force`` says how, ``tool`` who refuses)."""
    where = backend.uri
    root = file_directory(backend)
    if root is not None and os.path.islink(root):
        raise CheckpointError(f"{where} is a symbolic link; {tool} does not delete through links")
    if root is not None and os.path.lexists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{where} is a file, not a bcp checkpoint (a directory); {tool} leaves it")
    found = checkpoint_objects(backend)
    if not found.keys and next(iter(backend.unfinished("")), None) is None:
        return None
    if not found.committed and not uncommitted:
        raise IncompleteCheckpointError(
            f"{where} has no {MANIFEST_KEY}: not a committed bcp checkpoint ({len(found.keys)} object(s), "
            f"{len(found.generations)} bcp generation(s)); {force} to delete its bcp objects "
            f"({MANIFEST_KEY}, gen-*/) anyway"
        )
    return found
