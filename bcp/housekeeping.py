"""Checkpoints under one root: find them, decide which to keep, delete the rest.

Shared by :class:`bcp.CheckpointManager` and the ``bcp ls / rm / gc`` commands;
``bcp ls`` finds checkpoints in any layout with :func:`find_checkpoints`.
Works on every backend through the object contract alone (list, read, delete; no
rename): a step is *committed* exactly when its ``manifest.json`` exists.

Deleting a checkpoint removes its manifest first, so a deletion that stops halfway
leaves an incomplete step (garbage, never loaded), not a committed one with missing
data. Nothing younger than the grace period (``grace_seconds``, by the start time in
each save's generation name, or a partial file's age) is garbage: it may be a save
in progress of another process (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
from collections.abc import Iterable

from bcp.backends import Backend, ObjectNotFoundError, Unfinished, join_uri
from bcp.metadata.layout import (
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

from . import commit
from .commit import DEFAULT_GRACE_SECONDS
from .errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError

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


def _step_and_generation(key: str) -> tuple[int | None, str | None]:
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
            step, generation = _step_and_generation(u.name)
            if step is None:
                continue
            info = found.setdefault(step, StepInfo(step, committed=False))
            info.unfinished_age = min(info.unfinished_age, u.age_seconds)
            if generation is not None:
                info.generations.add(generation)
    for key in backend.list(STEP_PREFIX) if keys is None else keys:
        step, generation = _step_and_generation(key)
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


def _kind_of(path: str) -> tuple[str, int | None]:
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
            kind, step = _kind_of(path)
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


def select_kept(
    steps: Iterable[int],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: tuple[str, int, str] | None = None,
    metrics: dict[int, dict] | None = None,
) -> set[int]:
    """The committed steps a retention policy keeps: the union of the newest
    ``keep_last``, every multiple of ``keep_every``, and the ``keep_best`` =
    (metric, N, "min"|"max") best by that metric. The newest step is always kept.
    With no policy at all, everything is kept."""
    steps = sorted(set(steps))
    if not steps:
        return set()
    if keep_last is None and keep_every is None and keep_best is None:
        return set(steps)
    kept = {steps[-1]}
    if keep_last:
        kept.update(steps[-keep_last:])
    if keep_every:
        kept.update(s for s in steps if s % keep_every == 0)
    if keep_best:
        metric, n, mode = keep_best
        scored = [(m[metric], s) for s in steps if (m := (metrics or {}).get(s) or {}).get(metric) is not None]
        scored.sort(key=lambda p: (p[0] if mode == "min" else -p[0], -p[1]))
        kept.update(s for _v, s in scored[:n])
    return kept


def check_policy(keep_last, keep_every, keep_best) -> None:
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1, got {keep_every}")
    if keep_best is not None and (len(keep_best) != 3 or keep_best[2] not in ("min", "max") or keep_best[1] < 1):
        raise ValueError(f"keep_best must be (metric, N >= 1, 'min' or 'max'), got {keep_best!r}")


def delete_step(backend: Backend, step: int) -> None:
    commit.delete_checkpoint(backend, f"{step_name(step)}/")


def _is_busy(info: StepInfo, grace_seconds: float) -> bool:
    """Whether an incomplete step may be a save in progress: a generation that started,
    or a partial file written, less than ``grace_seconds`` ago."""
    return info.unfinished_age < grace_seconds or any(commit.is_young(g, grace_seconds) for g in info.generations)


def write_latest(backend: Backend, step: int) -> None:
    backend.write(LATEST_KEY, json.dumps({"step": step, "path": step_name(step)}).encode())


@dataclasses.dataclass
class GcPlan:
    committed: list[int]  # what the listing found, before anything is deleted
    incomplete: list[int]
    expired: list[int]
    orphan_generations: list[str]
    #: partial files older than the grace period, outside the steps deleted whole
    unfinished: list[str] = dataclasses.field(default_factory=list)
    #: incomplete steps left alone because they may be saves in progress
    young: list[int] = dataclasses.field(default_factory=list)
    #: unused generations of committed checkpoints, and partial files, left alone for the same reason
    young_generations: list[str] = dataclasses.field(default_factory=list)
    young_unfinished: list[str] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.incomplete or self.expired or self.orphan_generations or self.unfinished)


def plan_gc(
    backend: Backend,
    *,
    busy: Iterable[int] = (),
    generations_of: Iterable[int] | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    **policy,
) -> GcPlan:
    """What ``gc`` would delete, from one listing: incomplete steps (except ``busy``
    ones being written now, and any younger than ``grace_seconds``), committed steps
    the policy no longer keeps, unused generations in the kept steps of
    ``generations_of`` (None: every kept step; each costs a manifest read) and old
    partial files. With ``generations_of=None`` (``bcp gc``, a manager's start) also the
    unused generations of every other committed checkpoint under the root, up to
    ``FIND_MAX_DEPTH`` deep (the root itself, ``last.ckpt/``: killed overwrites). One
    listing and one walk of unfinished writes in all."""
    pending = list(backend.unfinished(""))
    keys = list(backend.list("")) if generations_of is None else None
    found = scan(backend, unfinished=[u for u in pending if u.name.startswith(STEP_PREFIX)], keys=keys)
    busy = set(busy)
    committed = sorted(s for s, i in found.items() if i.committed)
    metrics = {s: step_metrics(backend, s) for s in committed} if policy.get("keep_best") else None
    kept = select_kept(committed, metrics=metrics, **policy)
    check = kept if generations_of is None else kept & set(generations_of)
    uncommitted = [s for s, i in sorted(found.items()) if not i.committed and s not in busy]
    young = [s for s in uncommitted if _is_busy(found[s], grace_seconds)]
    incomplete = [s for s in uncommitted if s not in young]
    expired = [s for s in committed if s not in kept]
    whole = {step_name(s) for s in (*incomplete, *expired)}
    spared = busy | set(young)

    def stale(name: str) -> bool:
        step, generation = _step_and_generation(name)
        if step is None:
            if name.endswith("/"):
                return False  # an empty directory that is not a step's: not bcp's to remove
            path = checkpoint_prefix_of(name)
            generation = None if path is None else generation_of(name[len(path) + 1 if path else 0 :])
        if name.split("/", 1)[0] in whole or step in spared:
            return False
        return generation is None or not commit.is_young(generation, grace_seconds)

    unused = [  # the step's generations come from the scan: only its manifest is read
        g
        for s in sorted(check)
        for g in commit.unused_generations(backend, f"{step_name(s)}/", found=found[s].generations)
    ]
    if keys is not None:
        unused += _unused_elsewhere(backend, keys, pending)
    partial = [u for u in pending if stale(u.name)]
    return GcPlan(
        committed=committed,
        incomplete=incomplete,
        expired=expired,
        orphan_generations=[g for g in unused if not commit.is_young(g, grace_seconds)],
        unfinished=sorted(u.name for u in partial if u.age_seconds >= grace_seconds),
        young=young,
        young_generations=[g for g in unused if commit.is_young(g, grace_seconds)],
        young_unfinished=sorted(u.name for u in partial if u.age_seconds < grace_seconds),
    )


def _unused_elsewhere(backend: Backend, keys: list[str], pending: list[Unfinished]) -> list[str]:
    """The unused generations (``<path>/gen-<id>/``, whatever their age) of every
    committed checkpoint under the root but the manager's own steps: an overwrite
    killed there left them (a Lightning ``last.ckpt``, a root that is a checkpoint).
    A checkpoint whose manifest cannot be read is skipped with a warning."""
    generations: dict[str, set[str]] = {}
    committed = []
    for name in [*keys, *(u.name for u in pending)]:
        path = checkpoint_prefix_of(name)
        if path is None or ("/" not in path and _kind_of(path)[0] == "step"):
            continue  # not a checkpoint's, or a step of this root (the scan's)
        prefix = f"{path}/" if path else ""
        found = generations.setdefault(path, set())
        if (generation := generation_of(name[len(prefix) :])) is not None:
            found.add(generation)
        if name == manifest_key(prefix):
            committed.append(prefix)
    unused = []
    for prefix in sorted(committed):
        try:
            unused += commit.unused_generations(backend, prefix, found=generations[prefix.rstrip("/")])
        except Exception as e:  # noqa: BLE001 - one unreadable checkpoint must not stop gc
            log.warning("gc: skipped %s: its manifest cannot be read: %s", join_uri(backend.uri, prefix), e)
    return unused


def run_gc(backend: Backend, plan: GcPlan) -> list[str]:
    """Carry out ``plan``, every deletion on its own: one that fails is logged and the
    rest go on (a file that cannot be deleted must not stop retention or a save).
    Returns the failures, one line each."""
    failures: list[str] = []

    def attempt(what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - each failure is reported; the others still run
            log.warning("gc: could not delete %s: %s", what, e)
            failures.append(f"{what}: {e}")

    for step in plan.expired:
        attempt(f"step {step}", delete_step, backend, step)
    for step in plan.incomplete:
        attempt(f"incomplete step {step}", commit.delete_uncommitted, backend, f"{step_name(step)}/")
    for name in plan.unfinished:  # first: some lie in the unused generations below
        attempt(f"partial file {name}", backend.delete_unfinished, name)
    for generation in plan.orphan_generations:
        attempt(f"unused generation {generation}", commit.delete_generation, backend, generation)
    return failures


# -- what `bcp ls` and `bcp rm` show -------------------------------------------------------------


@dataclasses.dataclass
class ListedCheckpoint:
    """A checkpoint found under a root, with what its manifest says (:func:`list_checkpoints`)."""

    #: as in :class:`FoundCheckpoint`
    path: str
    kind: str
    step: int | None
    #: ``committed``, ``incomplete``, or ``unreadable`` (a manifest that cannot be read)
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
    rows = []
    for c in found.checkpoints:
        row = ListedCheckpoint(c.path, c.kind, c.step, "committed" if c.committed else "incomplete", c.objects, c.bytes)
        if c.committed:
            try:
                manifest = commit.read_manifest(backend, f"{c.path}/" if c.path else "")
                row.created = manifest.created if manifest else None
                row.created_at = _created_at(row.created)
            except Exception as e:  # one bad manifest is shown as such; the listing goes on
                log.debug("checkpoint %r of %s is unreadable", c.path, backend.uri, exc_info=True)
                row.status, row.created, row.created_at, row.error = "unreadable", None, None, e
        rows.append(row)
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
