"""Checkpoints under one root: find them, decide which to keep, delete the rest.

Shared by :class:`bcp.CheckpointManager` and the ``bcp ls / rm / gc`` commands.
Works on every backend through the object contract alone (list, read, delete; no
rename): a step is *committed* exactly when its ``manifest.json`` exists.

Deleting a checkpoint removes its manifest first, so a deletion that stops halfway
leaves an incomplete step (garbage, never loaded), not a committed one with missing
data.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

from bcp.backends import Backend, ObjectNotFoundError
from bcp.metadata import Manifest
from bcp.metadata.layout import LATEST_KEY, STEP_PREFIX, manifest_key, step_name, step_of

from . import commit


@dataclasses.dataclass
class StepInfo:
    step: int
    committed: bool
    objects: int = 0
    bytes: int = 0
    created: str | None = None  # from the manifest
    metrics: dict | None = None


def scan(backend: Backend, *, sizes: bool = False) -> dict[int, StepInfo]:
    """Every step directory under the root, committed or not (one listing)."""
    found: dict[int, StepInfo] = {}
    for key in backend.list(STEP_PREFIX):
        step = step_of(key)
        if step is None:
            continue
        info = found.setdefault(step, StepInfo(step, committed=False))
        info.objects += 1
        if key == manifest_key(f"{step_name(step)}/"):
            info.committed = True
        if sizes:
            try:
                info.bytes += backend.size(key)
            except ObjectNotFoundError:
                pass
    return found


def committed_steps(backend: Backend) -> list[int]:
    return sorted(s for s, info in scan(backend).items() if info.committed)


def read_manifest(backend: Backend, step: int) -> Manifest | None:
    """The manifest of ``step``; None when the step is not committed."""
    return commit.read_manifest(backend, f"{step_name(step)}/")


def step_metrics(backend: Backend, step: int) -> dict:
    manifest = read_manifest(backend, step)
    if manifest is None:
        return {}
    return dict((manifest.user_metadata.get("bcp_manager") or {}).get("metrics") or {})


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


def orphan_generations(backend: Backend, step: int) -> list[str]:
    """Generation prefixes in a committed step that its manifest does not use
    (left by an overwrite that was killed)."""
    return commit.unused_generations(backend, f"{step_name(step)}/")


def write_latest(backend: Backend, step: int) -> None:
    backend.write(LATEST_KEY, json.dumps({"step": step, "path": step_name(step)}).encode())


@dataclasses.dataclass
class GcPlan:
    committed: list[int]  # what the listing found, before anything is deleted
    incomplete: list[int]
    expired: list[int]
    orphan_generations: list[str]

    @property
    def empty(self) -> bool:
        return not (self.incomplete or self.expired or self.orphan_generations)


def plan_gc(
    backend: Backend, *, busy: Iterable[int] = (), generations_of: Iterable[int] | None = None, **policy
) -> GcPlan:
    """What ``gc`` would delete, from one listing: incomplete steps (except ``busy``
    ones being written now), committed steps the policy no longer keeps, and unused
    generations in the kept steps of ``generations_of`` (None: every kept step; each
    costs a manifest read and a listing)."""
    found = scan(backend)
    busy = set(busy)
    committed = sorted(s for s, i in found.items() if i.committed)
    metrics = {s: step_metrics(backend, s) for s in committed} if policy.get("keep_best") else None
    kept = select_kept(committed, metrics=metrics, **policy)
    check = kept if generations_of is None else kept & set(generations_of)
    return GcPlan(
        committed=committed,
        incomplete=sorted(s for s, i in found.items() if not i.committed and s not in busy),
        expired=[s for s in committed if s not in kept],
        orphan_generations=[g for s in sorted(check) for g in orphan_generations(backend, s)],
    )


def run_gc(backend: Backend, plan: GcPlan) -> None:
    for step in plan.expired:
        delete_step(backend, step)
    for step in plan.incomplete:
        commit.delete_uncommitted(backend, f"{step_name(step)}/")
    for generation in plan.orphan_generations:
        commit.delete_generation(backend, generation)
