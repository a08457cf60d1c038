"""Holds: which referenced bytes must stay (FORMAT.md, "Holds: what keeps referenced
bytes alive"), and deleting a checkpoint by that rule.

An incremental checkpoint reads data files of its siblings; before it commits it puts
an empty *hold* ``<owner>/gen-<id>/holds/<referrer>.<save_id>`` on each generation it
refers to. Every path that deletes checkpoint bytes (retention, ``bcp gc``, ``bcp rm``,
``bcp.delete``, the local tier) asks this module first:

* a hold is *live* while ``<referrer>/manifest.json`` exists with that ``save_id`` and
  lists a file of the held generation, or while no such manifest exists and
  ``gen-<save_id>`` started less than the grace period ago (a save in progress); any
  other hold is stale. A referrer whose manifest cannot be read, or that lies outside
  the backend (the owner is the backend's root, so its siblings are beyond it), keeps
  its hold live: bytes are never deleted on a guess.
* deleting a checkpoint removes its manifest first, then each of its generations that
  holds no live hold; a held generation stays whole (*retired*). The holds the deleted
  checkpoint put on others go with it, and a retired generation it was the last live
  referrer of is collected at once.

The order is what keeps a concurrent save safe: the deleter lists holds only after the
manifest is gone, and lists them again just before deleting a generation; a save
writes its holds, then reads its base's manifest again and refers to nothing if it is
gone. So a hold the deleter did not see belongs to a save that will not use the bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence

from bcp import commit
from bcp.backends import Backend
from bcp.commit import DEFAULT_GRACE_SECONDS
from bcp.metadata import Manifest
from bcp.metadata.keys import (
    HOLDS_DIR,
    generation_name,
    hold_key,
    is_generation,
    is_sibling_name,
    manifest_key,
    parse_hold_key,
)

log = logging.getLogger(__name__)


def place(backend: Backend, keys: Sequence[str]) -> None:
    """Write the holds ``keys``; on a failure, delete those written (a stale hold is
    harmless, but none is left behind) and raise it."""
    for i, key in enumerate(keys):
        try:
            backend.write(key, b"")
        except OSError:
            for done in keys[:i]:
                with contextlib.suppress(OSError):
                    backend.delete(done)
            raise


@dataclasses.dataclass(frozen=True)
class Hold:
    """One hold object, found by a listing of a backend."""

    #: the object's key on the backend
    key: str
    #: the checkpoint whose generation is held, relative to the backend (``""``: its root)
    owner: str
    generation: str
    #: the sibling that refers to the bytes, and its save
    referrer: str
    save_id: str

    @property
    def referrer_path(self) -> str | None:
        """Where the referrer lies on the backend; None when the owner is the backend's
        root (its siblings are outside the backend)."""
        if not self.owner:
            return None
        parent = self.owner.rpartition("/")[0]
        return f"{parent}/{self.referrer}" if parent else self.referrer


def parse_hold(key: str) -> Hold | None:
    """The hold a listed key is (``[<path>/]<owner>/gen-<id>/holds/<name>.<save_id>``), or None."""
    parts = key.split("/")
    if len(parts) < 3 or parts[-2] != HOLDS_DIR or not is_generation(parts[-3]):
        return None
    found = parse_hold_key("/".join(parts[-3:]))
    if found is None:
        return None
    generation, referrer, save_id = found
    return Hold(key, "/".join(parts[:-3]), generation, referrer, save_id)


def holds_in(keys: Iterable[str]) -> list[Hold]:
    return [h for k in keys if (h := parse_hold(k)) is not None]


def prefix_of(path: str) -> str:
    """The key prefix of the checkpoint at ``path`` (``""`` for the root)."""
    return f"{path}/" if path else ""


def name_of(path: str) -> str:
    return path.rpartition("/")[2]


@dataclasses.dataclass(frozen=True)
class Keeper:
    """A checkpoint that keeps bytes of a retired (or live) generation alive."""

    referrer: str
    #: how many of the generation's files it reads, and their bytes (per its manifest;
    #: 0 for a save still in progress)
    files: int
    nbytes: int
    #: True: committed and listing the files; False: a save in progress (younger than the grace period)
    committed: bool


class _Unreadable:
    """A manifest that exists and cannot be read (the referrer keeps its holds)."""


UNREADABLE = _Unreadable()


class HoldChecker:
    """Whether holds are live, on one backend (the parent of the checkpoints), each
    referrer's manifest read once. ``now`` is fixed at construction so one decision
    sees one clock."""

    def __init__(
        self, backend: Backend, *, grace_seconds: float = DEFAULT_GRACE_SECONDS, now: float | None = None
    ) -> None:
        self.backend = backend
        self.grace_seconds = grace_seconds
        self.now = time.time() if now is None else now
        self._manifests: dict[str, Manifest | _Unreadable | None] = {}
        #: (path, save_id) of manifests this process deleted: their holds are stale at once
        self.gone: set[tuple[str, str]] = set()

    def remember(self, path: str, manifest: Manifest | _Unreadable | None) -> None:
        """A manifest a caller read already (``bcp ls`` reads each one)."""
        self._manifests[path] = manifest

    def manifest(self, path: str) -> Manifest | _Unreadable | None:
        if path not in self._manifests:
            try:
                self._manifests[path] = commit.read_manifest(self.backend, prefix_of(path))
            except Exception as e:  # noqa: BLE001 - unreadable: its holds stay live, logged
                log.warning(
                    "holds: the manifest of %r at %s cannot be read (%s); its holds stay live",
                    path,
                    self.backend.uri,
                    e,
                )
                self._manifests[path] = UNREADABLE
        return self._manifests[path]

    def deleted(self, path: str, manifest: Manifest | None) -> None:
        """The manifest at ``path`` was deleted by this process."""
        self._manifests[path] = None
        if manifest is not None:
            self.gone.add((path, manifest.save_id))

    def keeper(self, hold: Hold) -> Keeper | None:
        """The referrer keeping ``hold`` live, or None when the hold is stale."""
        path = hold.referrer_path
        if path is None or not is_sibling_name(hold.referrer):
            return Keeper(hold.referrer, 0, 0, committed=False)  # cannot tell: live
        if (path, hold.save_id) in self.gone:
            return None
        m = self.manifest(path)
        if isinstance(m, _Unreadable):
            return Keeper(hold.referrer, 0, 0, committed=False)
        if m is not None and m.save_id == hold.save_id:
            owner = name_of(hold.owner)
            files = [f for f in m.references if f.checkpoint == owner and f.path.split("/", 1)[0] == hold.generation]
            return Keeper(hold.referrer, len(files), sum(f.nbytes for f in files), committed=True) if files else None
        if commit.is_young(generation_name(hold.save_id), self.grace_seconds, self.now):
            return Keeper(hold.referrer, 0, 0, committed=False)
        return None

    def live(self, hold: Hold) -> bool:
        return self.keeper(hold) is not None


def list_holds(backend: Backend, path: str, generation: str) -> list[Hold]:
    return holds_in(backend.list(f"{prefix_of(path)}{generation}/{HOLDS_DIR}/"))


def collect_generation(backend: Backend, path: str, generation: str, checker: HoldChecker) -> list[Keeper]:
    """Delete generation ``generation`` of the checkpoint at ``path`` unless a live hold
    is on it; returns the keepers ([]: deleted). The holds are listed again just before
    the deletion: one written since the first listing is a save in progress (live)."""
    seen = list_holds(backend, path, generation)
    keepers = [k for h in seen if (k := checker.keeper(h)) is not None]
    if not keepers and seen:
        known = {h.key for h in seen}
        keepers = [k for h in list_holds(backend, path, generation) if h.key not in known and (k := checker.keeper(h))]
    if keepers:
        return keepers
    commit.delete_generation(backend, f"{prefix_of(path)}{generation}")
    return []


def owns_generation(checker: HoldChecker, path: str, generation: str) -> bool:
    """Whether ``generation`` is the committed generation of the checkpoint at ``path``
    (an unreadable manifest counts as yes: nothing is deleted on a guess)."""
    m = checker.manifest(path)
    return isinstance(m, _Unreadable) or (m is not None and m.generation == generation)


@dataclasses.dataclass
class Deletion:
    """What :func:`delete_checkpoint` did."""

    path: str
    #: its generations deleted, and those kept whole (retired) with who keeps them
    deleted: list[str] = dataclasses.field(default_factory=list)
    retired: dict[str, list[Keeper]] = dataclasses.field(default_factory=dict)
    #: other checkpoints' retired generations (``<path>/gen-<id>``) it was the last referrer of, collected
    collected: list[str] = dataclasses.field(default_factory=list)


def delete_checkpoint(
    backend: Backend, path: str, checker: HoldChecker | None = None, *, only_bcp: bool = True
) -> Deletion:
    """Delete the checkpoint at ``path`` on ``backend`` (the parent of its siblings):
    its manifest first, then each generation with no live hold; the held ones stay whole
    (retired). Then the holds it put on its siblings' generations are deleted, and a
    retired one that no live hold is left on is collected. ``only_bcp=False`` also deletes
    everything else under ``path`` when nothing there was retired."""
    checker = checker or HoldChecker(backend)
    prefix = prefix_of(path)
    try:
        manifest = commit.read_manifest(backend, prefix)
    except Exception as e:  # noqa: BLE001 - an unreadable manifest is deleted all the same
        log.warning("deleting %r at %s: its manifest cannot be read (%s)", path, backend.uri, e)
        manifest = None
    backend.delete(manifest_key(prefix))  # first: it stops being a checkpoint at once
    checker.deleted(path, manifest)
    done = Deletion(path)
    for generation in sorted(commit.generations(backend, prefix)):
        keepers = collect_generation(backend, path, generation, checker)
        if keepers:
            done.retired[generation] = keepers
        else:
            done.deleted.append(generation)
    if manifest is not None:
        done.collected = release(backend, path, manifest, checker)
    if not only_bcp and not done.retired:
        backend.delete_prefix(prefix)
    if done.retired:
        log.info("%s: kept %s whole (retired): %s", backend.uri, path or ".", describe_retired(done.retired))
    return done


def release(backend: Backend, path: str, manifest: Manifest, checker: HoldChecker) -> list[str]:
    """Delete the holds the (deleted) checkpoint at ``path`` put on its siblings, and
    collect each of those generations that is retired and has no live hold left."""
    if not path:
        return []  # the root: its siblings are outside the backend
    parent, _, name = path.rpartition("/")
    collected = []
    targets = sorted({(f.checkpoint, f.path.split("/", 1)[0]) for f in manifest.references if f.checkpoint})
    for owner_name, generation in targets:
        if not is_sibling_name(owner_name) or not is_generation(generation):
            continue
        owner = f"{parent}/{owner_name}" if parent else owner_name
        backend.delete(f"{prefix_of(owner)}{hold_key(generation, name, manifest.save_id)}")
        if owns_generation(checker, owner, generation):
            continue  # a committed checkpoint's own generation: it stays
        if not collect_generation(backend, owner, generation, checker):
            collected.append(f"{owner}/{generation}")
    return collected


def describe_retired(retired: dict[str, list[Keeper]]) -> str:
    return "; ".join(f"{g} held by {', '.join(sorted({k.referrer for k in ks}))}" for g, ks in sorted(retired.items()))


def keepers_of(backend: Backend, path: str, checker: HoldChecker) -> dict[str, list[Keeper]]:
    """Who keeps each generation of the checkpoint at ``path`` alive (generations with
    no live hold are left out): what ``bcp rm --dry-run`` says would stay. Its own
    manifest counts as deleted (only references to its bytes by others keep them)."""
    try:
        manifest = commit.read_manifest(backend, prefix_of(path))
    except Exception:  # noqa: BLE001 - its own holds on itself are then judged by age
        manifest = None
    checker.deleted(path, manifest)
    found: dict[str, list[Keeper]] = {}
    for h in holds_in(backend.list(prefix_of(path))):
        if h.owner == path and (k := checker.keeper(h)) is not None:
            found.setdefault(h.generation, []).append(k)
    return found
