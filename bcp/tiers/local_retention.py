"""Local retention, per host: keep the newest ``keep`` local steps, delete the rest.

Run by each host's first rank on its own local root only: the local tier never
deletes anything in persistent storage (and persistent retention never deletes
local steps). A step counts as kept only if this host holds its manifest; older
step directories without one (saves that failed or were killed) go too. A step
being drained is never deleted. Deleting a step removes its manifest first, so a
deletion cut short leaves a directory that is not a step here.

Nothing here follows a link: a ``step_*`` entry that is a symbolic link is unlinked
(the link, never what it points to), one that is neither a directory nor a link is
unlinked too, and a directory is emptied by ``shutil.rmtree`` relative to the root's
descriptor (which never descends into a link). A step directory whose ``job.json``
names another job (``job.py``) is never deleted: a WARNING, and when this job saves
that step number, it is moved aside to ``foreign-<hex>-step_<n>`` (docs/tiers.md,
"Security").
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from collections.abc import Collection

from bcp.backends.file import FileBackend
from bcp.commit import read_manifest
from bcp.holds import HoldChecker, holds_in, list_holds, release
from bcp.metadata import MANIFEST_KEY
from bcp.metadata.keys import step_name
from bcp.tiers.job import read_job
from bcp.tiers.paths import local_steps, step_dir

log = logging.getLogger(__name__)

#: where a step directory of another job goes when this job saves its step number
FOREIGN_PREFIX = "foreign-"


def owner_of(root: str, step: int, job: str | None) -> str | None:
    """The job id another job's step directory names, or None when the entry is this
    job's to delete (its own id, none readable, or no ``job`` to compare with)."""
    if job is None:
        return None
    found = read_job(step_dir(root, step))
    return found if found is not None and found != job else None


def _kind(path: str) -> str | None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "link" if stat.S_ISLNK(mode) else "other"


def remove_step(root: str, step: int, job: str | None = None) -> None:
    """Delete one local step directory, its manifest first; never follows a link, never
    deletes another job's step (``job``: this job's id). A failure is logged: what
    stays is only space, deleted at the next attempt."""
    path = step_dir(root, step)
    kind = _kind(path)
    if kind is None:
        return
    if kind != "dir":
        log.warning("local tier: %s is a %s, not a step directory; removing the entry only", path, kind)
        try:
            os.unlink(path)
        except OSError as e:
            log.warning("local tier: could not remove %s: %s", path, e)
        return
    other = owner_of(root, step, job)
    if other is not None:
        log.warning("local tier: %s belongs to job %s, not this job (%s); it is never deleted", path, other, job)
        return
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        log.warning("local tier: could not delete step %d under %s: %s", step, root, e)
        return
    backend = FileBackend(root)
    checker = HoldChecker(backend)
    name = step_name(step)
    try:
        manifest = read_manifest(backend, f"{name}/")
    except Exception:  # noqa: BLE001 - unreadable: deleted all the same, its holds judged by age
        manifest = None
    try:
        try:
            _unlink_manifest(root_fd, name)
        except OSError as e:  # replaced meanwhile (a link: ELOOP), no permission: next time
            log.warning("local tier: could not delete step %d under %s: %s", step, root, e)
            return
        checker.deleted(name, manifest)
        kept = _retired(backend, checker, name)
        if not kept:
            shutil.rmtree(name, ignore_errors=True, dir_fd=root_fd)
        else:
            _remove_all_but(root_fd, name, kept)
            log.info("local tier: kept %s of step %d whole: newer local steps read its bytes", sorted(kept), step)
        if manifest is not None:
            release(backend, name, manifest, checker)  # its holds on older steps, and what they alone kept
    except Exception as e:  # noqa: BLE001 - what stays is only space, deleted at the next attempt
        log.warning("local tier: could not finish deleting step %d under %s: %s", step, root, e)
    finally:
        os.close(root_fd)


def _retired(backend: FileBackend, checker: HoldChecker, name: str) -> set[str]:
    """The generations of the step directory ``name`` that a live hold keeps (FORMAT.md, "Holds")."""
    held = {h.generation for h in holds_in(backend.list(f"{name}/")) if h.owner == name}
    return {g for g in held if any(checker.live(h) for h in list_holds(backend, name, g))}


def _remove_all_but(root_fd: int, name: str, kept: set[str]) -> None:
    """Empty the step directory ``name`` but for the ``kept`` generations (never following a link)."""
    step_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        for entry in os.listdir(step_fd):
            if entry in kept:
                continue
            if _kind_at(step_fd, entry) == "dir":
                shutil.rmtree(entry, ignore_errors=True, dir_fd=step_fd)
            else:
                os.unlink(entry, dir_fd=step_fd)
    finally:
        os.close(step_fd)


def _kind_at(dir_fd: int, entry: str) -> str:
    return "dir" if stat.S_ISDIR(os.lstat(entry, dir_fd=dir_fd).st_mode) else "other"


def _unlink_manifest(root_fd: int, name: str) -> None:
    """Remove the manifest of the step directory ``name`` under ``root_fd`` (never through a link)."""
    step_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        os.unlink(MANIFEST_KEY, dir_fd=step_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(step_fd)


def move_aside(root: str, step: int) -> str:
    """Rename another job's step directory out of this job's way (never deleting it)."""
    target = os.path.join(root, f"{FOREIGN_PREFIX}{secrets.token_hex(4)}-{step_name(step)}")
    os.rename(step_dir(root, step), target)
    log.warning(
        "local tier: %s belonged to another job; moved to %s (never loaded or deleted by bcp: remove it by hand)",
        step_dir(root, step),
        target,
    )
    return target


def _foreign(root: str, steps: list[int], job: str | None) -> set[int]:
    out = set()
    for s in steps:
        other = owner_of(root, s, job)
        if other is not None:
            log.warning(
                "local tier: %s belongs to job %s, not this job (%s); left alone", step_dir(root, s), other, job
            )
            out.add(s)
    return out


def expired_steps(
    root: str, current: int, keep: int, pinned: Collection[int] = (), job: str | None = None
) -> list[int]:
    """The local steps retention deletes once ``current`` is saved: those up to
    ``current`` other than the newest ``keep`` with a manifest here, ``current`` and
    the ``pinned`` ones (being drained); never another job's (``job``: this job's id)."""
    steps = [s for s in local_steps(root) if s <= current]
    steps = [s for s in steps if s not in _foreign(root, steps, job)]
    committed = [s for s in steps if _kind(step_dir(root, s)) == "dir" and _is_file(step_dir(root, s), MANIFEST_KEY)]
    kept = set(committed[-keep:]) | set(pinned) | {current}
    return [s for s in steps if s not in kept]


def _is_file(directory: str, name: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode)
    except OSError:
        return False


def apply_retention(
    root: str, current: int, keep: int, pinned: Collection[int] = (), job: str | None = None
) -> list[int]:
    """Delete the expired local steps (:func:`expired_steps`); returns them."""
    expired = expired_steps(root, current, keep, pinned, job)
    for s in reversed(expired):  # newest first: a referrer's holds go before its bases are judged
        remove_step(root, s, job)
    if expired:
        log.info("local tier: deleted local steps %s under %s", expired, root)
    return expired


def remove_stale(root: str, step: int, pinned: Collection[int] = (), job: str | None = None) -> list[int]:
    """Before saving ``step``: delete this host's copies of ``step`` and of every
    later step. They come from an earlier run of the job (a restart went back to an
    older step), and must never be mixed with, or preferred to, this run's steps.
    Another job's (``job``: this job's id) are left alone; one at ``step`` itself is
    moved aside (:func:`move_aside`)."""
    later = [s for s in local_steps(root) if s >= step and s not in pinned]
    foreign = _foreign(root, later, job)
    if step in foreign:
        move_aside(root, step)
    stale = [s for s in later if s not in foreign]
    for s in reversed(stale):
        remove_step(root, s, job)
    if stale:
        log.info("local tier: deleted stale local steps %s under %s (from an earlier run)", stale, root)
    return stale
