"""Which checkpoints under a root to keep, and deleting the rest: the retention policy
of :class:`bcp.CheckpointManager` and ``bcp gc``'s plan.

Deleting a checkpoint removes its manifest first, so a deletion that stops halfway
leaves an incomplete step (garbage, never loaded), not a committed one with missing
data. Nothing younger than the grace period (``grace_seconds``, by the start time in
each save's generation name, or a partial file's age) is garbage: it may be a save
in progress of another process (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from typing import TypedDict, Unpack

from bcp import commit, holds
from bcp.backends import Backend, Unfinished, join_uri
from bcp.commit import DEFAULT_GRACE_SECONDS
from bcp.discovery import StepInfo, checkpoint_prefix_of, kind_of, scan, step_and_generation, step_metrics
from bcp.metadata.keys import (
    LATEST_KEY,
    STEP_PREFIX,
    generation_of,
    manifest_key,
    step_name,
)

log = logging.getLogger(__name__)


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


class RetentionPolicy(TypedDict, total=False):
    """The retention keywords ``plan_gc`` passes on to :func:`select_kept`."""

    keep_last: int | None
    keep_every: int | None
    keep_best: tuple[str, int, str] | None


def check_policy(keep_last: int | None, keep_every: int | None, keep_best: tuple[str, int, str] | None) -> None:
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1, got {keep_every}")
    if keep_best is not None and (len(keep_best) != 3 or keep_best[2] not in ("min", "max") or keep_best[1] < 1):
        raise ValueError(f"keep_best must be (metric, N >= 1, 'min' or 'max'), got {keep_best!r}")


def delete_step(backend: Backend, step: int, checker: holds.HoldChecker | None = None) -> holds.Deletion:
    """Delete one step by the holds' rule (:func:`bcp.holds.delete_checkpoint`): its
    manifest first, then its generations that no newer checkpoint holds."""
    return holds.delete_checkpoint(backend, step_name(step), checker, only_bcp=False)


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
    #: generations kept whole because newer checkpoints read their bytes (FORMAT.md,
    #: "Holds"): of steps without a manifest, and unused ones of committed checkpoints
    retired: list[str] = dataclasses.field(default_factory=list)
    #: holds no live referrer stands behind, on the generations of kept checkpoints
    stale_holds: list[str] = dataclasses.field(default_factory=list)
    #: the grace period the plan was made with (a save younger than it keeps its holds live)
    grace_seconds: float = DEFAULT_GRACE_SECONDS

    @property
    def empty(self) -> bool:
        return not (self.incomplete or self.expired or self.orphan_generations or self.unfinished or self.stale_holds)


def plan_gc(
    backend: Backend,
    *,
    busy: Iterable[int] = (),
    generations_of: Iterable[int] | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    **policy: Unpack[RetentionPolicy],
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
    checker = holds.HoldChecker(backend, grace_seconds=grace_seconds)
    uncommitted = [s for s, i in sorted(found.items()) if not i.committed and s not in busy]
    # a step with holds and no manifest is retired (or was): judged generation by generation
    held_steps = [s for s in uncommitted if found[s].holds]
    uncommitted = [s for s in uncommitted if not found[s].holds]
    young = [s for s in uncommitted if _is_busy(found[s], grace_seconds)]
    incomplete = [s for s in uncommitted if s not in young]
    retired: list[str] = []
    unused_retired: list[str] = []
    for s in held_steps:
        live = {h.generation for h in found[s].holds if checker.live(h)}
        for g in sorted(found[s].generations):
            where = f"{step_name(s)}/{g}/"
            (retired if g in live else unused_retired).append(where)
    expired = [s for s in committed if s not in kept]
    whole = {step_name(s) for s in (*incomplete, *expired)}
    spared = busy | set(young)

    def stale(name: str) -> bool:
        step, generation = step_and_generation(name)
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
    stale_holds = [
        h.key
        for s in sorted(check)
        for h in found[s].holds
        if holds.owns_generation(checker, step_name(s), h.generation) and not checker.live(h)
    ]
    if keys is not None:
        unused += _unused_elsewhere(backend, keys, pending)
        # holds in the live generations of the other checkpoints under the root (a replaced referrer's)
        stale_holds += [
            h.key
            for h in holds.holds_in(keys)
            if step_and_generation(h.key)[0] is None
            and holds.owns_generation(checker, h.owner, h.generation)
            and not checker.live(h)
        ]
    # an unused generation that a newer checkpoint reads is retired, not garbage
    held = {f"{holds.prefix_of(h.owner)}{h.generation}/" for h in holds.holds_in(keys or ()) if checker.live(h)}
    held |= {f"{holds.prefix_of(h.owner)}{h.generation}/" for s in check for h in found[s].holds if checker.live(h)}
    retired += [g for g in unused if g in held]
    unused = [g for g in unused if g not in held] + unused_retired
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
        retired=sorted(retired),
        stale_holds=stale_holds,
        grace_seconds=grace_seconds,
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
        if path is None or ("/" not in path and kind_of(path)[0] == "step"):
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

    def attempt(what: str, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - each failure is reported; the others still run
            log.warning("gc: could not delete %s: %s", what, e)
            failures.append(f"{what}: {e}")

    checker = holds.HoldChecker(backend, grace_seconds=plan.grace_seconds)
    for step in plan.expired:
        attempt(f"step {step}", delete_step, backend, step, checker)
    for step in plan.incomplete:
        attempt(f"incomplete step {step}", commit.delete_uncommitted, backend, f"{step_name(step)}/")
    for name in plan.unfinished:  # first: some lie in the unused generations below
        attempt(f"partial file {name}", backend.delete_unfinished, name)
    for generation in plan.orphan_generations:
        attempt(f"unused generation {generation}", _collect, backend, generation, checker)
    for key in plan.stale_holds:
        attempt(f"stale hold {key}", backend.delete, key)
    return failures


def _collect(backend: Backend, generation: str, checker: holds.HoldChecker) -> None:
    """Delete one unused generation (``[<path>/]gen-<id>/``) unless a live hold appeared
    on it since the plan (it then stays, retired)."""
    path, _, name = generation.rstrip("/").rpartition("/")
    keepers = holds.collect_generation(backend, path, name, checker)
    if keepers:
        log.info("gc: kept %s: %s", generation, holds.describe_retired({name: keepers}))


# -- what `bcp ls` and `bcp rm` show -------------------------------------------------------------
