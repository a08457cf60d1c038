"""Checkpoints under one root, found: committed steps, partial ones, checkpoints in
any layout (``bcp ls`` uses :func:`find_checkpoints`), and the error that says why a
URI holds no checkpoint. Works on every backend through the object contract alone
(list, read): a step is *committed* exactly when its ``manifest.json`` exists.
Deciding what to keep and deleting it is :mod:`bcp.retention`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections.abc import Iterable

from bcp import commit
from bcp.backends import Backend, ObjectNotFoundError, Unfinished, join_uri
from bcp.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from bcp.holds import UNREADABLE, Hold, HoldChecker, Keeper, parse_hold
from bcp.metadata.keys import (
    GENERATION_PREFIX,
    LATEST_KEY,
    MANIFEST_KEY,
    STEP_PREFIX,
    generation_of,
    is_generation,
    manifest_key,
    step_name,
    step_of,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepInfo:
    step: int
    committed: bool
    objects: int = 0
    bytes: int = 0
    created: str | None = None  # from the manifest
    metrics: dict | None = None
    #: generation names (``gen-<id>``) found in the step, committed or not
    generations: set[str] = dataclasses.field(default_factory=set)
    #: the youngest unfinished write's age in seconds (inf: none)
    unfinished_age: float = math.inf
    #: the holds on its generations (newer checkpoints that refer to its bytes)
    holds: list[Hold] = dataclasses.field(default_factory=list)


def step_and_generation(key: str) -> tuple[int | None, str | None]:
    step = step_of(key)
    return step, (generation_of(key.split("/", 1)[1]) if step is not None else None)


def scan(
    backend: Backend,
    *,
    sizes: bool = False,
    unfinished: bool | Iterable[Unfinished] = True,
    keys: Iterable[str] | None = None,
) -> dict[int, StepInfo]:
    """Every step directory under the root, committed or not (one listing, plus one of
    unfinished writes: a step holding only partial files still exists). ``unfinished``
    may be the writes a caller already listed, and ``keys`` the objects, so the store
    is not asked twice."""
    found: dict[int, StepInfo] = {}
    if unfinished:
        pending = backend.unfinished(STEP_PREFIX) if unfinished is True else unfinished
        for u in pending:
            step, generation = step_and_generation(u.name)
            if step is None:
                continue
            info = found.setdefault(step, StepInfo(step, committed=False))
            info.unfinished_age = min(info.unfinished_age, u.age_seconds)
            if generation is not None:
                info.generations.add(generation)
    for key in backend.list(STEP_PREFIX) if keys is None else keys:
        step, generation = step_and_generation(key)
        if step is None:
            continue
        info = found.setdefault(step, StepInfo(step, committed=False))
        if generation is not None:
            info.generations.add(generation)
        _count_object(info, backend, key, f"{step_name(step)}/", sizes)
    return found


def _count_object(info: StepInfo | FoundCheckpoint, backend: Backend, key: str, prefix: str, sizes: bool) -> None:
    """One listed object of the checkpoint at ``prefix``: counted, its manifest marks
    the checkpoint committed, and its size is added when asked (an object deleted
    since the listing counts nothing)."""
    info.objects += 1
    if key == manifest_key(prefix):
        info.committed = True
    elif (hold := parse_hold(key)) is not None and hold.owner == prefix.rstrip("/"):
        info.holds.append(hold)
    if sizes:
        try:
            info.bytes += backend.size(key)
        except ObjectNotFoundError:
            pass


#: How deep below a root ``find_checkpoints`` looks for checkpoints: the root itself
#: (depth 0), ``ROOT/a`` (1), ``ROOT/a/b`` (2) and ``ROOT/a/b/c`` (3). Deeper ones
#: are not reported (name a deeper root instead).
FIND_MAX_DEPTH = 3
#: How many objects ``find_checkpoints`` lists at most before it stops and says so.
FIND_MAX_OBJECTS = 1_000_000


@dataclasses.dataclass
class FoundCheckpoint:
    """A checkpoint found under a root by :func:`find_checkpoints`."""

    #: its location relative to the root: ``""`` for the root itself, else ``a/b``
    path: str
    #: ``root`` (the root is the checkpoint), ``step`` (a manager's ``step_<N>``
    #: directory, directly under the root or under a manager root below it) or
    #: ``directory`` (any other location below the root)
    kind: str
    committed: bool = False
    #: the step number for ``kind == "step"``
    step: int | None = None
    objects: int = 0
    bytes: int = 0
    holds: list[Hold] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FindResult:
    checkpoints: list[FoundCheckpoint]
    #: the listing stopped at ``FIND_MAX_OBJECTS`` objects: there may be more
    truncated: bool = False


def checkpoint_prefix_of(key: str, max_depth: int = FIND_MAX_DEPTH) -> str | None:
    """The location (relative to the root, ``""`` for the root) of the checkpoint a key
    belongs to, or None: ``P/manifest.json`` and ``P/gen-<id>/...`` belong to the
    checkpoint at ``P`` when ``P`` has at most ``max_depth`` parts. The shallowest
    match wins (a checkpoint's own objects never hold another one's)."""
    parts = key.split("/")
    for depth in range(min(len(parts), max_depth + 1)):
        name = parts[depth]
        last = depth == len(parts) - 1
        if (last and name == MANIFEST_KEY) or (not last and is_generation(name)):
            return "/".join(parts[:depth])
    return None


def kind_of(path: str) -> tuple[str, int | None]:
    if not path:
        return "root", None
    name = path.rsplit("/", 1)[-1]
    step = step_of(name + "/")
    if step is not None and name == step_name(step):
        return "step", step
    return "directory", None


def find_checkpoints(
    backend: Backend,
    *,
    sizes: bool = False,
    max_depth: int = FIND_MAX_DEPTH,
    max_objects: int = FIND_MAX_OBJECTS,
) -> FindResult:
    """Every checkpoint under the root, however they are laid out: the root itself,
    a manager's step directories, plain subdirectories, nested up to ``max_depth``
    levels. Committed: its ``manifest.json`` exists; incomplete: only generation
    objects or partial writes (killed saves). One listing of the root and one walk of
    unfinished writes, each stopped after ``max_objects`` entries (``truncated``)."""
    found: dict[str, FoundCheckpoint] = {}

    def entry(path: str) -> FoundCheckpoint:
        if path not in found:
            kind, step = kind_of(path)
            found[path] = FoundCheckpoint(path, kind, step=step)
        return found[path]

    truncated = False
    for count, key in enumerate(backend.list("")):
        if count >= max_objects:
            truncated = True
            log.warning("stopped listing %s after %d objects: later checkpoints are not shown", backend.uri, count)
            break
        path = checkpoint_prefix_of(key, max_depth)
        if path is None:
            continue
        _count_object(entry(path), backend, key, f"{path}/" if path else "", sizes)
    # a killed save may have left only partial files; this walk is bounded the same way
    for count, pending in enumerate(backend.unfinished("")):
        if count >= max_objects:
            truncated = True
            break
        path = checkpoint_prefix_of(pending.name, max_depth)
        if path is not None:
            entry(path)
    return FindResult(sorted(found.values(), key=lambda c: c.path), truncated)


#: How many objects :func:`missing_checkpoint_error` lists at most to say what is there.
DIAGNOSE_MAX_OBJECTS = 10_000


def missing_checkpoint_error(backend: Backend) -> CheckpointError:
    """The error for a location without ``manifest.json``, saying what is there
    instead: nothing (CheckpointNotFoundError); else an IncompleteCheckpointError (files
    but no manifest) whose message tells apart a CheckpointManager root (naming its
    newest committed step's URI and ``load_latest``), checkpoints further down (naming
    them), a save that never committed (``gen-*/`` or partial files at the location)
    and files that are none of bcp's. Costs listings, bounded: an error path only."""
    uri = backend.uri
    if next(iter(backend.list("")), None) is None and not _holds_partial_writes(backend):
        return CheckpointNotFoundError(f"no checkpoint at {uri}")
    steps = scan(backend, unfinished=False)
    if steps or backend.exists(LATEST_KEY):
        return IncompleteCheckpointError(_manager_root_message(uri, steps))
    found = find_checkpoints(backend, max_objects=DIAGNOSE_MAX_OBJECTS)
    below = [c for c in found.checkpoints if c.path and c.committed]
    listed = ", ".join(join_uri(uri, c.path) for c in below[:3])
    if len(below) > 3:
        listed += f" and {len(below) - 3} more"
    if any(not c.path for c in found.checkpoints):
        also = f"; committed checkpoints below it: {listed}" if below else ""
        return IncompleteCheckpointError(
            f"{uri} has no {MANIFEST_KEY}: a save started there and never committed "
            f"(it failed, was killed, or is still running), so there is no checkpoint to load{also}"
        )
    if below:
        return IncompleteCheckpointError(
            f"no checkpoint at {uri} itself (no {MANIFEST_KEY}); it holds {len(below)} checkpoint(s) below it: "
            f"{listed}. Load one of those by its URI (bcp ls {uri} lists them)"
        )
    if found.checkpoints:  # only saves below that never committed
        return IncompleteCheckpointError(
            f"no checkpoint at {uri} (no {MANIFEST_KEY}); below it are only saves that never committed: "
            + ", ".join(join_uri(uri, c.path) for c in found.checkpoints[:3])
        )
    more = " (in the part listed)" if found.truncated else ""
    return IncompleteCheckpointError(
        f"no checkpoint at {uri}: it holds files, but no {MANIFEST_KEY} and nothing of a bcp checkpoint{more} "
        f"(no {GENERATION_PREFIX}*/ directory, no {STEP_PREFIX}N/ of a CheckpointManager): is it the right location?"
    )


def _holds_partial_writes(backend: Backend) -> bool:
    """Whether a killed writer left something at the location that ``list`` hides: a
    partial file, or an empty directory inside a save's generation (an empty
    directory elsewhere, made by anyone, is nothing)."""
    return any(not u.name.endswith("/") or checkpoint_prefix_of(u.name) is not None for u in backend.unfinished(""))


def _manager_root_message(uri: str, steps: dict[int, StepInfo]) -> str:
    committed = sorted(s for s, info in steps.items() if info.committed)
    manager = f"bcp.CheckpointManager({uri!r})"
    if not committed:
        return (
            f"{uri} is a CheckpointManager root, not a checkpoint, and it has no committed step yet: there is "
            f"nothing to load ({manager}.load_latest(state) returns (None, state) here)"
        )
    newest = join_uri(uri, step_name(committed[-1]))
    return (
        f"{uri} is a CheckpointManager root, not a checkpoint: name one of its {len(committed)} committed step(s) "
        f"by its URI (the newest is {newest}), or load the newest with {manager}.load_latest(state); "
        f"bcp ls {uri} lists the steps"
    )


def committed_steps(backend: Backend) -> list[int]:
    return sorted(s for s, info in scan(backend, unfinished=False).items() if info.committed)


def base_step(backend: Backend, step: int) -> int | None:
    """The base of a manager's incremental save of ``step``: the newest committed step
    other than ``step``, or None (a full save recording digests; also
    when the listing fails: a base only saves bytes, it never fails a save)."""
    try:
        others = [s for s in committed_steps(backend) if s != step]
    except Exception as e:  # noqa: BLE001 - logged; the save writes every byte
        log.warning("incremental save of step %d: listing %s failed (%s): saving every byte", step, backend.uri, e)
        return None
    return others[-1] if others else None


def step_metrics(backend: Backend, step: int) -> dict[str, float]:
    """The numeric metrics the manager stored with ``step``. A manifest that cannot be
    read, or a metric that is not a finite number, is left out with a warning: one bad
    step must not stop retention (or a manager's start) for the others."""
    try:
        manifest = commit.read_manifest(backend, f"{step_name(step)}/")
    except Exception as e:  # noqa: BLE001 - any unreadable manifest: no metrics, logged
        log.warning("step %d: manifest unreadable, its metrics are ignored: %s", step, e)
        return {}
    if manifest is None:
        return {}
    managed = manifest.user_metadata.get("bcp_manager")
    raw = managed.get("metrics") if isinstance(managed, dict) else None
    if not isinstance(raw, dict):
        return {}
    metrics: dict[str, float] = {}
    for name, value in raw.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            metrics[str(name)] = float(value)
        else:
            log.warning("step %d: metric %r is not a finite number (%.60r); ignored", step, name, value)
    return metrics


@dataclasses.dataclass
class ListedCheckpoint:
    """A checkpoint found under a root, with what its manifest says (:func:`list_checkpoints`)."""

    #: as in :class:`FoundCheckpoint`
    path: str
    kind: str
    step: int | None
    #: ``committed``, ``incomplete``, ``unreadable`` (a manifest that cannot be read) or
    #: ``retired`` (deleted, its bytes kept whole for the newer checkpoints in ``held_by``)
    status: str
    objects: int
    bytes: int
    #: the manifest's ``created``, as written (None: not committed, or unreadable)
    created: str | None = None
    #: ``created`` parsed, with its time zone
    created_at: datetime.datetime | None = None
    #: the newest committed step of its manager root: what ``CheckpointManager.latest()`` would load
    latest: bool = False
    #: why the manifest is unreadable
    error: Exception | None = None
    #: bytes of the sibling checkpoints' data files it reads (references, FORMAT.md
    #: "References"): shared with them, not stored under it (``bytes`` is what is)
    shared_bytes: int = 0
    #: the checkpoints keeping its bytes alive (live holds on its generations), each
    #: with the bytes of its files they read; a ``retired`` location is kept only for them
    held_by: list[Keeper] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Listing:
    checkpoints: list[ListedCheckpoint]
    #: the listing stopped at ``FIND_MAX_OBJECTS`` objects: there may be more
    truncated: bool = False


def list_checkpoints(backend: Backend) -> Listing:
    """Every checkpoint under the root (:func:`find_checkpoints`, with sizes), each
    committed one's manifest read for its creation time, and each manager root's newest
    committed step marked ``latest``. One unreadable manifest (or one whose ``created``
    is no time-zone aware ISO time) makes its checkpoint ``unreadable``, with the error,
    and hides none of the others."""
    found = find_checkpoints(backend, sizes=True)
    checker = HoldChecker(backend)
    rows = []
    for c in found.checkpoints:
        row = ListedCheckpoint(c.path, c.kind, c.step, "committed" if c.committed else "incomplete", c.objects, c.bytes)
        if c.committed:
            manifest = None
            try:
                manifest = commit.read_manifest(backend, f"{c.path}/" if c.path else "")
                row.created = manifest.created if manifest else None
                row.created_at = _created_at(row.created)
                row.shared_bytes = sum(f.nbytes for f in manifest.references) if manifest else 0
            except Exception as e:  # one bad manifest is shown as such; the listing goes on
                log.debug("checkpoint %r of %s is unreadable", c.path, backend.uri, exc_info=True)
                row.status, row.created, row.created_at, row.error = "unreadable", None, None, e
            checker.remember(c.path, manifest if row.status == "committed" else UNREADABLE)
        rows.append(row)
    for c, row in zip(found.checkpoints, rows, strict=True):
        keepers: dict[str, Keeper] = {}
        for h in c.holds:
            k = checker.keeper(h)
            if k is not None:
                was = keepers.get(k.referrer)
                keepers[k.referrer] = (
                    k
                    if was is None
                    else Keeper(k.referrer, was.files + k.files, was.nbytes + k.nbytes, was.committed and k.committed)
                )
        row.held_by = [keepers[r] for r in sorted(keepers)]
        if row.status == "incomplete" and row.held_by:
            row.status = "retired"  # no manifest: kept only for the checkpoints that read its bytes
    newest: dict[str, ListedCheckpoint] = {}
    for row in rows:
        if row.kind == "step" and row.status == "committed":
            manager_root = row.path.rpartition("/")[0]
            best = newest.get(manager_root)
            if best is None or (row.step or 0) > (best.step or 0):
                newest[manager_root] = row
    for row in newest.values():
        row.latest = True
    return Listing(rows, found.truncated)


def _created_at(created: str | None) -> datetime.datetime | None:
    if not created:
        return None
    then = datetime.datetime.fromisoformat(created)
    if then.tzinfo is None:
        raise ValueError(f"created timestamp {created!r} has no time zone")
    return then


@dataclasses.dataclass(frozen=True)
class CheckpointObjects:
    """The objects at one checkpoint location, by whose they are (:func:`checkpoint_objects`)."""

    #: every object there, sorted
    keys: list[str]
    #: ``manifest.json`` and the ``gen-*/`` objects: what ``commit.delete_checkpoint(only_bcp=True)`` deletes
    bcp_keys: list[str]
    #: everything else (not bcp's: a deletion leaves it)
    other_keys: list[str]
    #: the generation names (``gen-<id>``), sorted
    generations: list[str]
    #: ``manifest.json`` is there
    committed: bool


def checkpoint_objects(backend: Backend) -> CheckpointObjects:
    """What belongs to the checkpoint at the backend's root (its manifest and
    generations) and what does not, from one listing: what ``bcp rm`` deletes and
    leaves."""
    keys = sorted(backend.list(""))
    ours = [k for k in keys if k == MANIFEST_KEY or generation_of(k) is not None]
    mine = set(ours)
    return CheckpointObjects(
        keys=keys,
        bcp_keys=ours,
        other_keys=[k for k in keys if k not in mine],
        generations=sorted({g for g in map(generation_of, keys) if g is not None}),
        committed=MANIFEST_KEY in keys,
    )
