"""``CheckpointManager(interval="auto")``'s side of the policy: what the manager measures
goes in, the due steps come out, and the estimates travel (docs/manager.md, "Interval").

* At the manager's start the coordinator appends its start to the root's restart record
  (``bcp.schedule.restarts``) and reads the estimates the newest step's manifest kept
  (``user_metadata["bcp_manager"]["interval"]``); every rank gets both (one decision)
  and starts from them, so every rank's first decisions agree.
* At every ``step`` call: the time since the previous call returned is a training step.
* At every save ``step`` makes: what the call kept training waiting, then one broadcast
  of the coordinator's estimates (:meth:`IntervalPolicy.agree`).
* At every commit: the commit lag; at every load: the recovery time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bcp.backends import Backend
from bcp.commit import read_manifest
from bcp.coordination.collectives import Coordinator, decide
from bcp.discovery import committed_steps
from bcp.metadata.keys import step_name
from bcp.schedule import restarts
from bcp.schedule.interval import IntervalPolicy, IntervalReport

log = logging.getLogger(__name__)

#: the key under the manifest's ``bcp_manager`` metadata
KEY = "interval"


def settings_of(policy: IntervalPolicy) -> dict[str, Any]:
    """The policy's constructor arguments, as JSON values (kept beside its estimates)."""
    return {
        "tiers": list(policy.tiers),
        "mtbf_seconds": policy.mtbf_given,
        "prior_mtbf_seconds": policy.prior_mtbf_seconds,
        "prior_weight": policy.prior_weight,
        "alpha": policy.alpha,
        "local_loss_share": policy.local_loss_share,
        "method": policy.method,
    }


def report_from_metadata(user_metadata: Any) -> IntervalReport | None:
    """The report a manifest's metadata gives (``bcp ls``); None when it has none;
    ValueError when it is there but not sane (it is read as hostile)."""
    managed = user_metadata.get("bcp_manager") if isinstance(user_metadata, dict) else None
    doc = managed.get(KEY) if isinstance(managed, dict) else None
    if doc is None:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("settings"), dict):
        raise ValueError("interval estimates: not an object with 'settings' and 'estimates'")
    s = doc["settings"]
    tiers = s.get("tiers")
    if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
        raise ValueError("interval estimates: 'tiers' is not a list of names")
    try:
        policy = IntervalPolicy(
            tiers=tuple(tiers),
            mtbf_seconds=s.get("mtbf_seconds"),
            prior_mtbf_seconds=s.get("prior_mtbf_seconds"),
            prior_weight=s.get("prior_weight"),
            alpha=s.get("alpha"),
            local_loss_share=s.get("local_loss_share"),
            method=s.get("method"),
        )
    except TypeError as e:  # a value of the wrong type compared with a number
        raise ValueError(f"interval estimates: settings are not numbers ({e})") from None
    except ValueError as e:
        raise ValueError(f"interval estimates: {e}") from None
    policy.adopt(doc.get("estimates"))
    return policy.report()


class AutoInterval:
    """One manager's interval policy and the measurements it takes (module docstring)."""

    def __init__(self, policy: IntervalPolicy, coord: Coordinator, backend: Backend) -> None:
        self.policy, self.coord, self.backend = policy, coord, backend
        self._returned: float | None = None

    def start(self) -> None:
        """(all ranks) Record this start; start from the newest step's estimates."""
        history, seed = decide(self.coord, "recording the manager's start", self._history)
        if seed is not None:
            try:
                self.policy.seed(seed)
            except ValueError as e:
                if self.coord.is_coordinator:
                    log.warning("ignoring the newest step's interval estimates: %s", e)
        found = restarts.Restarts(tuple(history))
        self.policy.observe_restart(found.exposure_seconds, found.restarts, source=f"{restarts.KEY} under the root")
        self.policy.agree()  # the same inputs on every rank: no broadcast needed

    def _history(self) -> tuple[tuple[float, ...], dict[str, Any] | None]:
        found = restarts.record_start(self.backend, time.time())
        seed = None
        try:
            steps = committed_steps(self.backend)
            manifest = read_manifest(self.backend, f"{step_name(steps[-1])}/") if steps else None
            managed = manifest.user_metadata.get("bcp_manager") if manifest is not None else None
            doc = managed.get(KEY) if isinstance(managed, dict) else None
            seed = doc.get("estimates") if isinstance(doc, dict) else None
        except Exception as e:  # noqa: BLE001 - estimates to start from, never a reason not to start
            log.warning("could not read the interval estimates of the newest step under %s: %s", self.backend.uri, e)
        return found.starts, seed

    def due(self, step: int, tiers: tuple[str, ...]) -> tuple[bool, bool]:
        """(at the start of ``step``) Take the time since the previous call returned as
        one training step; then (local due, persistent due) for ``step``."""
        now = time.perf_counter()
        if self._returned is not None:
            self.policy.observe_step(now - self._returned)
        local = "local" in tiers and step >= self.policy.next_save_step(step, "local")
        persistent = step >= self.policy.next_save_step(step, "persistent")
        return local, persistent

    def returned(self) -> None:
        """``step`` returns: training goes on from now."""
        self._returned = time.perf_counter()

    def saved(self, step: int, local: bool, persistent: bool, blocking: float) -> None:
        """(all ranks) ``step`` saved to these tiers, keeping training ``blocking``
        seconds; then the ranks agree. A drain's save is charged to the persistent tier
        less what a local save costs."""
        policy = self.policy
        known = policy.save_cost("local")
        if local and persistent and known is not None:
            policy.mark_saved("local", step)
            policy.observe_save("persistent", max(0.0, blocking - known), step=step)
        else:  # one tier, or the first local save: each tier is charged the whole wait
            for tier, made in (("local", local), ("persistent", persistent)):
                if made:
                    policy.observe_save(tier, blocking, step=step)
        policy.agree(self.coord)

    def committed(self, tier: str, blocking: float, total: float) -> None:
        if tier in self.policy.tiers:
            self.policy.observe_commit(tier, max(0.0, total - blocking))

    def loaded(self, step: int, seconds: float, tier: str) -> None:
        """(all ranks) ``load_latest`` took ``seconds`` and loaded ``step`` from ``tier``: the
        recovery time, agreed at once (the load was collective too); the next saves are
        due an interval after ``step``."""
        self.policy.observe_recovery(seconds, tier)
        for each in self.policy.tiers:
            self.policy.mark_saved(each, step)
        self.policy.agree(self.coord)

    def metadata(self) -> dict[str, Any]:
        """What a manifest keeps: the settings and the agreed estimates."""
        return {"settings": settings_of(self.policy), "estimates": self.policy.agreed()}
