"""Local retention, per host: keep the newest ``keep`` local steps, delete the rest.

Run by each host's first rank on its own local root only: the local tier never
deletes anything in persistent storage (and persistent retention never deletes
local steps). A step counts as kept only if this host holds its manifest; older
step directories without one (saves that failed or were killed) go too. A step
being drained is never deleted. Deleting a step removes its manifest first, so a
deletion cut short leaves a directory that is not a step here.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection

from bcp.metadata import MANIFEST_KEY

from .paths import local_steps, step_dir

log = logging.getLogger(__name__)


def remove_step(root: str, step: int) -> None:
    """Delete one local step directory, its manifest first. A failure is logged: what
    stays is only space, deleted at the next attempt."""
    path = step_dir(root, step)
    try:
        os.unlink(os.path.join(path, MANIFEST_KEY))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("local tier: could not delete step %d under %s: %s", step, root, e)
        return
    shutil.rmtree(path, ignore_errors=True)


def expired_steps(root: str, current: int, keep: int, pinned: Collection[int] = ()) -> list[int]:
    """The local steps retention deletes once ``current`` is saved: those up to
    ``current`` other than the newest ``keep`` with a manifest here, ``current`` and
    the ``pinned`` ones (being drained)."""
    steps = [s for s in local_steps(root) if s <= current]
    committed = [s for s in steps if os.path.exists(os.path.join(step_dir(root, s), MANIFEST_KEY))]
    kept = set(committed[-keep:]) | set(pinned) | {current}
    return [s for s in steps if s not in kept]


def apply_retention(root: str, current: int, keep: int, pinned: Collection[int] = ()) -> list[int]:
    """Delete the expired local steps (:func:`expired_steps`); returns them."""
    expired = expired_steps(root, current, keep, pinned)
    for s in expired:
        remove_step(root, s)
    if expired:
        log.info("local tier: deleted local steps %s under %s", expired, root)
    return expired


def remove_stale(root: str, step: int, pinned: Collection[int] = ()) -> list[int]:
    """Before saving ``step``: delete this host's copies of ``step`` and of every
    later step. They come from an earlier run of the job (a restart went back to an
    older step), and must never be mixed with, or preferred to, this run's steps."""
    stale = [s for s in local_steps(root) if s >= step and s not in pinned]
    for s in stale:
        remove_step(root, s)
    if stale:
        log.info("local tier: deleted stale local steps %s under %s (from an earlier run)", stale, root)
    return stale
