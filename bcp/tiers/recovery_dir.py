"""The recovery directory of one host (``bcp.tiers.recover``, step 4; docs/tiers.md, "Recovering").

``<local root>/recover-<nonce>/step_<N>/`` holds the chosen step's manifest and
catalog, a hard link to each data file the host holds whole, and a sparse file of the
manifest's size for each other one (ranks of one host share it); an incremental
step's referenced files lie beside it, under ``recover-<nonce>/<sibling step>/`` as in
the local root (``incremental_local.data_path``). The exchange fills the holes, and
an ordinary ``bcp.load`` reads from it (references through its parent directory). A recovery removes it after;
one a killed recovery left is removed by the next listing (:func:`remove_leftovers`).

Also here: the chosen step's manifest and catalog as its source reads them
(:func:`read_metadata`) and as every rank checks them once sent (:func:`check_received`).

When a recovery fails on a checksum or format error, each host checks its own copies
of the files involved against the manifest (:func:`check_copy`) and moves a bad one
aside (:func:`quarantine`): renamed to ``<name>.quarantined`` in its step directory,
a name no listing counts, so the next recovery (and the next start) uses another
host's copy or the persistent tier instead; it goes with its step directory
(local retention, or the next save of that step number).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Collection

from bcp.errors import CorruptCheckpointError
from bcp.metadata import Catalog, FormatError, Manifest
from bcp.metadata.keys import MANIFEST_KEY
from bcp.reader import CheckpointMetadata, check_catalog, fetch_catalog, fetch_manifest
from bcp.target import resolve_backend
from bcp.tiers.holding import file_spans, verify
from bcp.tiers.incremental_local import data_path
from bcp.tiers.inventory import LocalChoice

log = logging.getLogger(__name__)

#: Recovery directories under a local root: ``recover-<nonce>`` (never a holding).
RECOVERY_PREFIX = "recover-"
#: open(2) flag refusing a symbolic link as the last path component (0 where there is none)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: A local copy found corrupt is renamed to its name plus this (never counted as held).
QUARANTINE_SUFFIX = ".quarantined"


@dataclasses.dataclass(frozen=True)
class BadCopy:
    """One host's copy of a file of a local step that failed its check."""

    host: str
    #: the file's path on that host, as it was named
    path: str
    #: why it is bad
    reason: str
    #: where it is now (``path`` + QUARANTINE_SUFFIX), or None when it could not be moved
    moved_to: str | None

    def describe(self) -> str:
        where = f"quarantined as {self.moved_to}" if self.moved_to else "could not be moved aside"
        return f"{self.path} on host {self.host} ({self.reason}; {where})"


def remove_leftovers(root: str) -> None:
    """Remove the recovery directories a killed recovery left under ``root``
    (FileNotFoundError when there is no root; other OSErrors as listing raises them)."""
    for entry in os.scandir(root):
        if entry.name.startswith(RECOVERY_PREFIX) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def prepare(
    recovery_dir: str,
    step_dir: str,
    manifest: Manifest,
    metadata: CheckpointMetadata,
    held: frozenset[int],
) -> None:
    """The host's recovery directory (ranks of one host may all run this at once):
    hard links to the files held whole, sparse files of the manifest's sizes for the
    others, then the catalog and the manifest; directories 0700 and files 0600 whatever
    the umask, as everywhere in the tier. The catalog's directory is made for itself: an
    incremental step that changed nothing has no data file of its own beside it."""
    for i, entry in enumerate(manifest.data_files):
        target = data_path(recovery_dir, entry)  # a reference: under its sibling step, beside the step
        _private_dirs(os.path.dirname(target))
        if i in held:
            _link(data_path(step_dir, entry), target)
        else:
            _sparse(target, entry.nbytes)
    catalog = os.path.join(recovery_dir, *manifest.catalog.path.split("/"))
    _private_dirs(os.path.dirname(catalog))
    _write_replace(catalog, metadata.catalog)
    _write_replace(os.path.join(recovery_dir, MANIFEST_KEY), metadata.manifest)


def _private_dirs(path: str) -> None:
    """``path`` and its missing parents, each made 0700 (``os.makedirs`` gives the parents
    it makes the umask's mode); another rank of the host may make one at the same time."""
    missing = []
    while not os.path.isdir(path):  # link-ok: inside the private 0700 root
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass


def _link(source: str, target: str) -> None:
    """``target`` the same file as ``source`` (a hard link: bcp's file backend refuses
    symbolic links); a copy where the file system has no hard links."""
    try:
        os.link(source, target, follow_symlinks=False)
    except FileExistsError:
        if not os.path.samefile(source, target):
            raise
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        log.warning("local tier: cannot hard-link %s (%s); copying it", source, e)
        partial = f"{target}.{secrets.token_hex(4)}.partial"
        shutil.copyfile(source, partial, follow_symlinks=False)
        os.chmod(partial, 0o600)
        os.replace(partial, target)


def _sparse(path: str, nbytes: int) -> None:
    """A file of ``nbytes`` (holes until written). Several ranks may create it at once:
    none truncates what another wrote (it has its final size from the first call)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size != nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _write_replace(path: str, data: bytes) -> None:
    """Write ``path`` whole through a partial file and a rename (identical bytes from
    several ranks of a host: the last rename wins, with the same content)."""
    partial = f"{path}.{secrets.token_hex(4)}.partial"
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600), "wb") as f:
        f.write(data)
    os.replace(partial, path)


def check_copy(
    step_dir: str, save_id: str, held: Collection[int], paths: Collection[str] | None, host: str
) -> list[BadCopy]:
    """(a host's first rank) Check this host's copy of the local step at ``step_dir``
    after a recovery from it failed on corrupt bytes: the catalog, and the data files
    it served (``held``, indices into the manifest's ``data_files``) among ``paths``
    (the files the errors named; None: every one), each against the manifest's size
    and digest. Each bad one is quarantined. Never raises: a copy that cannot be
    checked is left as it is (the caller then blames no one)."""
    try:
        backend = resolve_backend(step_dir)
        _bytes, manifest = fetch_manifest(backend)
    except Exception as e:  # noqa: BLE001 - the manifest was fine at the listing; report, blame nothing
        log.warning("local tier: cannot check %s after a failed recovery: %s", step_dir, e)
        return []
    if manifest.save_id != save_id:
        return []
    out: list[BadCopy] = []
    try:
        catalog = fetch_catalog(backend, manifest)
    except (CorruptCheckpointError, FormatError, OSError) as e:  # an unreadable catalog (EIO, EACCES) too
        out.append(quarantine(os.path.join(step_dir, *manifest.catalog.path.split("/")), str(e), host))
        return out
    wanted = [
        i
        for i in sorted(held)
        if 0 <= i < len(manifest.data_files) and (paths is None or manifest.data_files[i].path in paths)
    ]
    if not wanted:
        return out
    try:
        spans = file_spans(
            Catalog.from_arrow(catalog, where=step_dir, checksum_block_bytes=manifest.checksum_block_bytes)
        )
    except Exception as e:  # noqa: BLE001 - a catalog matching the manifest's CRC: a bug, not damage
        log.warning("local tier: cannot read the catalog of %s: %s", step_dir, e)
        return out
    for i in wanted:
        entry = manifest.data_files[i]
        path = data_path(step_dir, entry)
        problem = verify(path, entry, spans, manifest.checksum_block_bytes)
        if problem is not None:
            out.append(quarantine(path, problem, host))
    return out


def quarantine(path: str, reason: str, host: str) -> BadCopy:
    """Move the corrupt local file ``path`` aside (renamed in place; see the module's
    docstring), with a WARNING naming it."""
    moved: str | None = path + QUARANTINE_SUFFIX
    try:
        os.replace(path, moved)  # type: ignore[arg-type]
    except OSError as e:
        log.warning("local tier: cannot move the corrupt %s aside: %s", path, e)
        moved = None
    bad = BadCopy(host, path, reason, moved)
    log.warning("local tier: corrupt local copy: %s; recovery goes on without it", bad.describe())
    return bad


# -- the chosen step's metadata ---------------------------------------------------------------------


def check_received(step_dir: str, manifest: Manifest, metadata: CheckpointMetadata, choice: LocalChoice) -> None:
    """The manifest and catalog bytes the source rank sent: the chosen save's, the
    catalog the one the manifest names (its size and CRC32C), as a load reading them
    would check (the load decodes them and checks them against the data files)."""
    if manifest.save_id != choice.save_id or metadata.head_only:
        raise CorruptCheckpointError(
            f"{step_dir}/{MANIFEST_KEY} (local tier, as sent): save {manifest.save_id} sent, {choice.save_id} chosen",
            file=MANIFEST_KEY,
        )
    check_catalog(f"{step_dir} (local tier, as sent)", manifest, metadata.catalog)


def read_metadata(step_dir: str, choice: LocalChoice) -> CheckpointMetadata:
    """The chosen copy's manifest (the one the inventory saw) and its catalog, checked."""
    backend = resolve_backend(step_dir)
    manifest_bytes, manifest = fetch_manifest(backend)
    if manifest.save_id != choice.save_id:
        raise CorruptCheckpointError(
            f"{step_dir}/{MANIFEST_KEY} changed during recovery (save {manifest.save_id}, chosen {choice.save_id})",
            file=MANIFEST_KEY,
        )
    return CheckpointMetadata(manifest_bytes, fetch_catalog(backend, manifest))
