"""Incremental local steps (``LocalTier(incremental=True)``; docs/tiers.md, "Incremental local steps").

A local save refers to the previous local step of the same run (``bcp.save``'s
``base=``): its catalog rows of unchanged pieces name data files of older local
steps, read at ``<local root>/<owner step>/<path>`` (metadata/FORMAT.md, "References").
Every host holds its own copy of those files: the ones its ranks wrote and the
replicas it received when their step was saved, so a step's referenced files have as
many copies, on the same hosts, as its own files had (replication sends each step's
own files once; a reference needs nothing sent again). What keeps them:

* **Holds on every host.** The save's coordinator writes the holds on its host
  (``bcp.incremental.hold_base``); every other host's first rank writes the same
  holds in its local root before that host's copy of the manifest
  (:func:`write_holds`), so local retention on each host keeps referenced
  generations whole ("retired", ``local_retention.py``).
* **Holdings carried forward.** A referenced file counts for recovery on a host only
  when the host listed it, checked, for the base step (``holding.json``): each host's
  first rank lists it again for the new step (:func:`carry_references`), with the
  new manifest's entry. The bytes are not read again: the base's check covered every
  fragment of the file the base's catalog names, and a reference reuses only those.

A referenced file is found through :func:`data_path` and sized through
:func:`held_size`: its owner must be a step directory name, and no component under
the local root may be a symbolic link or anything but a directory (the file itself
a regular file), as for the step's own files.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence

from bcp.backends.file import FileBackend
from bcp.incremental import referenced_generations
from bcp.metadata import FileEntry, Manifest
from bcp.metadata.keys import MANIFEST_KEY, hold_key, is_sibling_name, step_name, step_of
from bcp.tiers.holding import add_held, read_holding
from bcp.tiers.paths import DIR_MODE, FILE_MODE, READ_FLAGS, read_regular

log = logging.getLogger(__name__)

#: manifests larger than this are not read here (as the inventory's limit)
MAX_MANIFEST_BYTES = 256 << 20


def owner_of(step_dir: str, entry: FileEntry) -> str:
    """The directory name under the local root holding ``entry``'s bytes: its
    ``checkpoint`` for a reference, else the step's own. ValueError for an owner that
    is not a step directory name (never a recovery directory, never ``..``)."""
    own = os.path.basename(os.path.normpath(step_dir))
    owner = entry.checkpoint or own
    if not is_sibling_name(owner) or step_of(owner + "/") is None or step_name(step_of(owner + "/") or 0) != owner:
        raise ValueError(f"local tier: data file {entry.path!r} refers to {owner!r}, not a local step")
    return owner


def data_path(step_dir: str, entry: FileEntry) -> str:
    """Where ``entry`` of the step at ``step_dir`` lies: under the step, or under the
    owning sibling step beside it (a reference)."""
    parent = os.path.dirname(os.path.normpath(step_dir))
    return os.path.join(parent, owner_of(step_dir, entry), *entry.path.split("/"))


def held_size(step_dir: str, entry: FileEntry) -> int | None:
    """The size of ``entry``'s file (:func:`data_path`), or None when it is not there
    as a regular file reached through directories only (a link anywhere below the
    local root, a FIFO, a bad owner: None)."""
    try:
        parent = os.path.dirname(os.path.normpath(step_dir))
        parts = [owner_of(step_dir, entry), *entry.path.split("/")]
    except ValueError:
        return None
    path = parent
    size = None
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except OSError:
            return None
        last = i == len(parts) - 1
        if not (stat.S_ISREG(st.st_mode) if last else stat.S_ISDIR(st.st_mode)) or st.st_uid != os.geteuid():
            return None  # a link, a FIFO; another user's (a hard link to their file, planted)
        size = st.st_size
    return size


def _manifest_at(step_dir: str) -> Manifest | None:
    data = read_regular(os.path.join(step_dir, MANIFEST_KEY), MAX_MANIFEST_BYTES)
    if data is None:
        return None
    try:
        return Manifest.from_json(data, where=os.path.join(step_dir, MANIFEST_KEY))
    except Exception as e:  # noqa: BLE001 - an unreadable base: nothing carried, no holds here
        log.warning("local tier: cannot read the base %s: %s", step_dir, e)
        return None


def base_generations(root: str, base: int) -> list[tuple[str, str]]:
    """(owner step, generation) of every generation the base's manifest names: what the
    save's coordinator held (``bcp.incremental.hold_base``); [] when this host cannot
    read the base's manifest."""
    manifest = _manifest_at(os.path.join(root, step_name(base)))
    return [] if manifest is None else list(referenced_generations(manifest, step_name(base)))


def write_holds(root: str, manifest: Manifest, name: str, holds: Sequence[tuple[str, str]]) -> None:
    """This host's holds of step ``name`` (save ``manifest.save_id``) on ``holds``,
    written 0600 through the file backend (which refuses links)."""
    backend = FileBackend(root, fsync=False, file_mode=FILE_MODE)
    for owner, generation in holds:
        backend.write(f"{owner}/{hold_key(generation, name, manifest.save_id)}", b"")


def private_holds(root: str, manifest: Manifest, name: str, holds: Sequence[tuple[str, str]]) -> None:
    """The holds the save's coordinator wrote on its host (with the umask's modes) made
    the user's alone: each file 0600, each ``holds`` directory 0700; never through a link."""
    for owner, generation in holds:
        key = hold_key(generation, name, manifest.save_id).split("/")
        _chmod(os.path.join(root, owner, *key[:-1]), os.O_RDONLY | os.O_DIRECTORY, DIR_MODE, stat.S_ISDIR)
        _chmod(os.path.join(root, owner, *key), READ_FLAGS, FILE_MODE, stat.S_ISREG)


def _chmod(path: str, flags: int, mode: int, kind: object) -> None:
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # absent (the save referred to nothing) or a link: nothing to change
    try:
        st = os.fstat(fd)
        if kind(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:  # type: ignore[operator]
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def carry_references(root: str, manifest: Manifest, name: str, base: int) -> list[FileEntry]:
    """(a host's first rank) List in step ``name``'s ``holding.json`` each referenced
    file this host listed for the base step (same path, same size, the base's own save),
    still a regular file of that size; returns them."""
    refs = manifest.references
    if not refs:
        return []
    base_dir = os.path.join(root, step_name(base))
    base_manifest = _manifest_at(base_dir)
    holding = read_holding(base_dir)
    if base_manifest is None or holding is None or holding.save_id != base_manifest.save_id:
        return []
    step_dir = os.path.join(root, name)
    carried = [
        f
        for f in refs
        if (held := holding.files.get(f.path)) is not None
        and held.nbytes == f.nbytes
        and held_size(step_dir, f) == f.nbytes
    ]
    if carried:
        add_held(step_dir, manifest.save_id, carried)
    return carried
