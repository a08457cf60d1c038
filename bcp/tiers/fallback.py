"""What a recovery from the local tier loads instead, and says, when the hosts hold
less than a job that lost nothing would (docs/tiers.md, "Recovering", step 2, and
"A corrupt or missing local copy").

The coordinator's side of :mod:`bcp.tiers.recover`: the persistent tier's newest
step (listed in a thread while the hosts list theirs), the choice between the local
candidate and it, the WARNING naming what was lost (local steps held in part, a
local tier gone, hosts without a copy, quarantined copies), and the decision after
corrupt bytes nobody could be blamed for: the persistent step, or the error.
"""

from __future__ import annotations

import errno
import logging
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from bcp.discovery import committed_steps
from bcp.errors import CorruptCheckpointError
from bcp.target import resolve_backend
from bcp.tiers.config import LocalTier
from bcp.tiers.hosts import HostMap
from bcp.tiers.inventory import LocalChoice, choose_local, local_wins
from bcp.tiers.recovery_dir import BadCopy

log = logging.getLogger(__name__)


class PersistentNewest:
    """(coordinator) The persistent root's newest committed step, listed in a thread of
    its own from construction; :meth:`result` waits for it (None: no step, no root, or
    a listing that failed, with a WARNING: the local tier may still do, and the
    fallback reports the failure again)."""

    def __init__(self, root: str | None, storage_options: Mapping[str, Any] | None) -> None:
        self.root = root
        self.storage_options = storage_options
        self._step: int | None = None
        self._thread = threading.Thread(target=self._list, name="bcp-recover-list", daemon=True)
        if root is not None:
            self._thread.start()

    def _list(self) -> None:
        assert self.root is not None
        try:
            steps = committed_steps(resolve_backend(self.root, self.storage_options))
            self._step = steps[-1] if steps else None
        except Exception as e:  # noqa: BLE001 - reported here, never raised
            log.warning("local tier: cannot list the persistent root %s: %s", self.root, e)

    def result(self) -> int | None:
        if self.root is not None:
            self._thread.join()
        return self._step


def choose(
    gathered: list[Any] | None,
    hosts: HostMap,
    newest: PersistentNewest | None,
    config: LocalTier | None,
    damaged: tuple[BadCopy, ...],
    reason: str | None,
) -> tuple[LocalChoice, str] | None:
    """(coordinator) The local step to recover and a fresh directory name, or None. A
    WARNING whenever the hosts hold less than a job that lost nothing would: local
    steps lost, hosts without a copy, or a local tier that is empty or gone while the
    persistent tier has a step. After ``damaged`` copies were quarantined (a recovery
    failed on ``reason``) with nothing left to load at all, the error."""
    assert gathered is not None and newest is not None
    listings = [gathered[ranks[0]] for ranks in hosts.ranks]
    choice = choose_local(listings)
    persistent = newest.result()
    seen = sorted({c.step for listing in listings for c in listing or ()})
    if choice is not None and local_wins(choice.step, persistent):
        lost = [s for s in seen if s > choice.step]
        without = [
            hosts.hosts[h]
            for h, listing in enumerate(listings)
            if not any((c.step, c.save_id) == (choice.step, choice.save_id) for c in listing or ())
        ]
        if lost or damaged:
            log.warning(
                "local tier: recovering step %d (save %s), not the newest the local tier held: %s",
                choice.step,
                choice.save_id,
                lost_list(lost, damaged),
            )
        elif without:
            log.warning(
                "local tier: %d of %d hosts (%s) hold no copy of step %d (new hosts, or their local tier was "
                "lost); recovering it from the other hosts' copies, no step lost",
                len(without),
                len(listings),
                ", ".join(without),
                choice.step,
            )
        else:
            log.info(
                "local tier: recovering step %d (save %s) from %d hosts (persistent tier's newest: %s)",
                choice.step,
                choice.save_id,
                len({h for holders in choice.holders for h in holders}),
                persistent,
            )
        return choice, secrets.token_hex(8)
    # the persistent tier (or nothing): say what the local tier lost
    lost = [s for s in seen if persistent is None or s > persistent]
    if damaged and persistent is None:
        raise CorruptCheckpointError(
            f"local tier: nothing left to recover after {reason}: corrupt copies quarantined: "
            + "; ".join(b.describe() for b in damaged)
            + "; no other local copy holds the step, and the persistent root has no step to load instead",
            file=damaged[0].moved_to or damaged[0].path,
        )
    if persistent is None:
        if lost:
            log.warning(
                "local tier: no local step is held entirely by the %d surviving hosts and the persistent root has "
                "no step: starting from nothing; %s",
                len(listings),
                lost_list(lost, damaged),
            )
        return None
    if choice is None and not seen:
        log.warning(
            "local tier: none of the %d hosts holds a local step (their local tier is empty or gone); loading "
            "persistent step %d instead: %s",
            len(listings),
            persistent,
            lost_after(persistent, config, lost),
        )
    elif choice is None or lost or damaged:
        log.warning(
            "local tier: %s; loading persistent step %d instead: %s",
            f"no local step is held entirely by the {len(listings)} surviving hosts"
            if choice is None
            else f"the newest local step held entirely, {choice.step}, is older than persistent step {persistent}",
            persistent,
            lost_list(lost, damaged) if lost or damaged else lost_after(persistent, config, lost),
        )
    elif config is not None and config.local_due(persistent):
        # persistent step P was saved to the local tier too (a multiple of every): its copies are gone
        log.warning(
            "local tier: the newest local step held entirely, %d, is older than persistent step %d: the local "
            "tier lost its copies of step %d and later; loading persistent step %d instead: %s",
            choice.step,
            persistent,
            persistent,
            persistent,
            lost_after(persistent, config, lost),
        )
    else:
        log.info(
            "local tier: persistent step %s is newer than local step %d; loading from the persistent tier",
            persistent,
            choice.step,
        )
    return None


def lost_list(lost: list[int], damaged: tuple[BadCopy, ...]) -> str:
    """The local steps known to be lost (held in part, or held only by quarantined copies)."""
    parts = []
    if lost:
        shown = ", ".join(str(s) for s in lost[-8:])
        more = f" and {len(lost) - 8} older" if len(lost) > 8 else ""
        parts.append(
            f"{len(lost)} newer local step{'s' if len(lost) != 1 else ''} lost (step{'s' if len(lost) != 1 else ''} "
            f"{shown}{more}: not held entirely by the surviving hosts)"
        )
    if damaged:
        parts.append("corrupt copies quarantined: " + "; ".join(b.describe() for b in damaged))
    return "; ".join(parts)


def lost_after(persistent: int, config: LocalTier | None, known: list[int]) -> str:
    """How many local steps after persistent step ``persistent`` may be lost, when no
    host says which: every local save from there up to the next drain."""
    if known:
        return lost_list(known, ())
    if config is None:
        return "the steps saved to the local tier after it are lost (how many: not known here)"
    every, drain = config.every, config.persist_every
    if drain is None:
        return "every step saved to the local tier after it is lost (this tier never drains: how many is not known)"
    following = (persistent // drain + 1) * drain
    most = following // every - persistent // every
    return (
        f"up to {most} step{'s' if most != 1 else ''} lost (the local saves every {every} step"
        f"{'s' if every != 1 else ''} after step {persistent}, up to the next drain at step {following})"
    )


def give_up(
    newest: PersistentNewest | None,
    config: LocalTier | None,
    step: int,
    reason: str,
    blamed: bool,
    damaged: tuple[BadCopy, ...],
) -> None:
    """(coordinator) A recovery failed on corrupt bytes (``reason``) and another attempt
    would not help: the hosts found no bad copy this time (not ``blamed``), or the
    attempts are spent. A WARNING when the persistent tier has a step to load instead,
    else the error; both name every copy ``damaged`` (quarantined) so far."""
    assert newest is not None
    persistent = newest.result()
    said = "" if blamed else "every local copy it read passed its check on its host (damaged between hosts?)"
    if damaged:
        said += ("; " if said else "") + "quarantined: " + "; ".join(b.describe() for b in damaged)
    if persistent is None:
        raise CorruptCheckpointError(
            f"local tier: cannot recover step {step}: {reason}; {said}; and the persistent root has no step to "
            "load instead",
            file=(damaged[0].moved_to or damaged[0].path) if damaged else None,
        )
    log.warning(
        "local tier: cannot recover step %d: %s; %s; loading persistent step %d instead: %s",
        step,
        reason,
        said,
        persistent,
        lost_after(persistent, config, [step]),
    )


def no_room(newest: PersistentNewest | None, config: LocalTier | None, step: int, reason: str) -> None:
    """(coordinator) A host had no room for the recovery directory (ENOSPC, EDQUOT: a full ``/dev/shm``), which
    another attempt would not change: a WARNING when the persistent tier has a step to load instead, else an
    OSError saying so."""
    assert newest is not None
    persistent = newest.result()
    if persistent is None:
        raise OSError(errno.ENOSPC, f"local tier: cannot recover step {step}: {reason}; no persistent step either")
    log.warning(
        "local tier: cannot recover step %d: %s; loading persistent step %d instead: %s",
        step,
        reason,
        persistent,
        lost_after(persistent, config, [step]),
    )
