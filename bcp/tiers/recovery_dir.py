"""The recovery directory of one host (``bcp.tiers.recover``, step 4; docs/tiers.md, "Recovering").

``<local root>/recover-<nonce>/`` holds the chosen step's manifest and catalog, a
hard link to each data file the host holds whole, and a sparse file of the
manifest's size for each other one (ranks of one host share it); the exchange fills
the holes, and an ordinary ``bcp.load`` reads from it. A recovery removes it after;
one a killed recovery left is removed by the next listing (:func:`remove_leftovers`).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil

from bcp.metadata import Manifest
from bcp.metadata.layout import MANIFEST_KEY

from ..reader import CheckpointMetadata

log = logging.getLogger(__name__)

#: Recovery directories under a local root: ``recover-<nonce>`` (never a holding).
RECOVERY_PREFIX = "recover-"
#: open(2) flag refusing a symbolic link as the last path component (0 where there is none)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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
    others, then the catalog and the manifest."""
    for i, entry in enumerate(manifest.data_files):
        target = os.path.join(recovery_dir, *entry.path.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if i in held:
            _link(os.path.join(step_dir, *entry.path.split("/")), target)
        else:
            _sparse(target, entry.nbytes)
    _write_replace(os.path.join(recovery_dir, *manifest.catalog.path.split("/")), metadata.catalog)
    _write_replace(os.path.join(recovery_dir, MANIFEST_KEY), metadata.manifest)


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
        os.replace(partial, target)


def _sparse(path: str, nbytes: int) -> None:
    """A file of ``nbytes`` (holes until written). Several ranks may create it at once:
    none truncates what another wrote (it has its final size from the first call)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | NOFOLLOW, 0o644)
    try:
        if os.fstat(fd).st_size != nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _write_replace(path: str, data: bytes) -> None:
    """Write ``path`` whole through a partial file and a rename (identical bytes from
    several ranks of a host: the last rename wins, with the same content)."""
    partial = f"{path}.{secrets.token_hex(4)}.partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)
