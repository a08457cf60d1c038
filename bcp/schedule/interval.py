"""``interval="auto"``: each tier's save interval, chosen from what the manager measures.

:class:`IntervalPolicy` keeps exponential moving averages (weight ``alpha`` for the
newest value) of the step time, each tier's save cost (what the training loop waited
for) and commit lag, and the recovery time; the failure rate is ``mtbf_seconds`` when
given, else learned from the failures seen (``observe_restart``: the restarts recorded
under the root, ``bcp.schedule.restarts``) as ``(exposure + w M0) / (failures + w)``:
the mean time between failures with a prior of ``w`` failures at ``M0``
(``prior_mtbf_seconds``), so a run that has not failed yet saves as if its failures
were ``M0`` apart, plus its own life. The cost model and the optimum are
``bcp.schedule.waste``'s.

Every rank must choose the same steps without a collective per step: decisions use only
the *agreed* estimates, which change only at :meth:`agree` (the manager calls it at
each save: one broadcast of the coordinator's estimates, a few hundred bytes), and the
steps each tier last saved, which all ranks know.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from bcp.schedule.waste import Method, best_steps, waste_fraction

#: the tiers a policy chooses intervals for
TIERS = ("local", "persistent")
#: a learned mean time between failures is kept inside this range (seconds; a given one: 1 s .. 1 year)
MTBF_RANGE = (60.0, 365 * 86_400.0)
#: no measured time (a step, a save, a recovery) is believed beyond a day
MAX_SECONDS = 86_400.0
#: the share of failures that lose the local tier is kept inside this range
LOSS_SHARE_RANGE = (0.01, 1.0)


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def _duration(seconds: float | None) -> str:
    """Seconds as people read them: 850 ms, 42 s, 3.5 min, 2.0 h."""
    if seconds is None:
        return "?"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.3g} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclasses.dataclass(frozen=True)
class TierInterval:
    """One tier's chosen interval and the inputs it came from."""

    tier: str
    #: steps between saves (None: not measured enough yet: the first save is due now)
    steps: int | None
    #: the same in seconds of training (steps x step time)
    seconds: float | None
    #: what a save to this tier kept training waiting (C), and where the number came from
    save_seconds: float | None
    save_source: str
    #: seconds from a save's end to its commit (async saves)
    lag_seconds: float
    #: the recovery time (R) the model uses for this tier, and its source
    recovery_seconds: float
    recovery_source: str
    #: the failures this tier recovers (the local tier: those that keep a host's copies)
    mtbf_seconds: float


@dataclasses.dataclass(frozen=True)
class IntervalReport:
    """``CheckpointManager.report()``: the chosen intervals, the expected waste and the inputs."""

    tiers: tuple[TierInterval, ...]
    #: expected seconds lost per hour of wall time (saves, lost work, recoveries); None until measured
    waste_seconds_per_hour: float | None
    mtbf_seconds: float
    mtbf_source: str
    step_seconds: float | None
    step_source: str
    method: str

    def lines(self) -> list[str]:
        """The report as ``bcp ls`` prints it: one line for the choice, one per tier's inputs."""
        chosen = ", ".join(
            f"{t.tier} every {t.steps} steps ({_duration(t.seconds)})"
            if t.steps is not None
            else f"{t.tier} not chosen yet"
            for t in self.tiers
        )
        waste = self.waste_seconds_per_hour
        head = f"interval auto: {chosen}; expected waste {_duration(waste)}/hour" if waste is not None else ""
        head = head or f"interval auto: {chosen}"
        out = [
            head,
            f"  from: MTBF {_duration(self.mtbf_seconds)} ({self.mtbf_source}), "
            f"step {_duration(self.step_seconds)} ({self.step_source}), model {self.method}",
        ]
        out += [
            f"  {t.tier}: save {_duration(t.save_seconds)} ({t.save_source}), commit lag {_duration(t.lag_seconds)}, "
            f"recovery {_duration(t.recovery_seconds)} ({t.recovery_source})"
            for t in self.tiers
        ]
        return out


class IntervalPolicy:
    """Chooses when each tier saves; see the module docstring. ``tiers``: the tiers
    saved to (``("persistent",)``, or ``("local", "persistent")`` with a local tier).
    ``local_loss_share``: the share of failures that lose a host's local copies and
    recover from the persistent tier (a guess the user may correct: docs/manager.md)."""

    def __init__(
        self,
        *,
        tiers: tuple[str, ...] = ("persistent",),
        mtbf_seconds: float | None = None,
        prior_mtbf_seconds: float = 4 * 3600.0,
        prior_weight: float = 1.0,
        alpha: float = 0.3,
        local_loss_share: float = 0.1,
        method: Method = "exact",
        max_steps: int = 10**7,
    ) -> None:
        if not tiers or any(t not in TIERS for t in tiers) or len(set(tiers)) != len(tiers):
            raise ValueError(f"tiers must be distinct names of {TIERS}, got {tiers!r}")
        if "persistent" not in tiers:
            raise ValueError("tiers must include 'persistent'")
        if mtbf_seconds is not None and not 1.0 <= mtbf_seconds <= MTBF_RANGE[1]:
            raise ValueError(f"mtbf_seconds must be in [1, {MTBF_RANGE[1]:g}], got {mtbf_seconds}")
        if not MTBF_RANGE[0] <= prior_mtbf_seconds <= MTBF_RANGE[1] or not prior_weight > 0:
            raise ValueError(
                f"prior_mtbf_seconds out of range or prior_weight <= 0: {prior_mtbf_seconds}, {prior_weight}"
            )
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not LOSS_SHARE_RANGE[0] <= local_loss_share <= LOSS_SHARE_RANGE[1]:
            raise ValueError(f"local_loss_share must be in {LOSS_SHARE_RANGE}, got {local_loss_share}")
        if method not in ("exact", "young"):
            raise ValueError(f"method must be 'exact' or 'young', got {method!r}")
        self.tiers = tuple(t for t in TIERS if t in tiers)
        self.mtbf_given = mtbf_seconds
        self.prior_mtbf_seconds = prior_mtbf_seconds
        self.prior_weight = prior_weight
        self.alpha = alpha
        self.local_loss_share = local_loss_share
        self.method: Method = method
        self.max_steps = max_steps
        #: this rank's estimates (observe_*); decisions use the agreed copy
        self._mine = self._empty()
        self._agreed = self._empty()
        self._chosen: dict[str, int] | None = None
        self._key: tuple[int, ...] | None = None
        self._last: dict[str, int] | None = None
        #: the step each tier last saved, and the first step the policy was asked about
        self._anchor: dict[str, int] = {}
        self._first: int | None = None

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {
            "step_seconds": None,
            "steps": 0,
            "save": {},  # tier -> {"cost": s, "lag": s, "n": count}
            "recovery": {},  # tier recovered from -> {"seconds": s, "n": count}
            "failures": 0,
            "exposure": 0.0,  # seconds lived before this process (restarts)
            "running": 0.0,  # seconds this process has run (steps, saves, recoveries)
            "restart_source": "",
        }

    # -- observations (this rank's) ---------------------------------------------------

    def observe_step(self, seconds: float, steps: int = 1) -> None:
        """``steps`` training steps took ``seconds`` in all (without the saves' waiting)."""
        if steps < 1 or not 0 <= seconds <= MAX_SECONDS * steps:
            return
        m = self._mine
        m["step_seconds"] = _ema(m["step_seconds"], seconds / steps, self.alpha)
        m["steps"] += steps
        m["running"] += seconds

    def observe_save(
        self, tier: str, blocking_seconds: float, *, total_seconds: float | None = None, step: int | None = None
    ) -> None:
        """A save to ``tier`` kept training waiting ``blocking_seconds`` (committed after
        ``total_seconds``, when known); ``step``: the step saved (the next is due from it)."""
        if tier not in self.tiers:
            raise ValueError(f"tier must be one of {self.tiers}, got {tier!r}")
        if step is not None:
            self._anchor[tier] = int(step)
        if not 0 <= blocking_seconds <= MAX_SECONDS:
            return
        lag = 0.0 if total_seconds is None else min(MAX_SECONDS, max(0.0, total_seconds - blocking_seconds))
        old = self._mine["save"].get(tier)
        self._mine["save"][tier] = {
            "cost": _ema(old and old["cost"], blocking_seconds, self.alpha),
            "lag": _ema(old and old["lag"], lag, self.alpha),
            "n": (old["n"] if old else 0) + 1,
        }
        self._mine["running"] += blocking_seconds

    def observe_commit(self, tier: str, lag_seconds: float) -> None:
        """A save to ``tier`` committed ``lag_seconds`` after it stopped keeping training waiting."""
        old = self._mine["save"].get(tier)
        if old is not None and 0 <= lag_seconds <= MAX_SECONDS:
            old["lag"] = _ema(old["lag"], lag_seconds, self.alpha)

    def observe_recovery(self, seconds: float, tier: str = "persistent") -> None:
        """A restart took ``seconds`` to get back to training, loading from ``tier``."""
        if tier in self.tiers and 0 <= seconds <= MAX_SECONDS:
            m = self._mine
            old = m["recovery"].get(tier)
            m["recovery"][tier] = {
                "seconds": _ema(old and old["seconds"], seconds, self.alpha),
                "n": (old["n"] if old else 0) + 1,
            }
            m["running"] += seconds

    def observe_restart(self, uptime_seconds: float, count: int = 1, source: str = "") -> None:
        """``count`` failures ended runs that lived ``uptime_seconds`` in all (the
        restarts a root recorded, or one failure a simulator saw)."""
        if count < 0 or not 0 <= uptime_seconds <= MTBF_RANGE[1] * max(count, 1):
            return
        self._mine["failures"] += count
        self._mine["exposure"] += uptime_seconds
        if source:
            self._mine["restart_source"] = source

    # -- agreement -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This rank's estimates, as plain JSON values (broadcast, kept in manifests)."""
        m = self._mine
        return {**m, **{k: {t: dict(v) for t, v in m[k].items()} for k in ("save", "recovery")}}

    def adopt(self, snapshot: Any) -> None:
        """Decide from ``snapshot`` (another rank's, or this one's) from now on; it also
        becomes this rank's estimates, so the ranks' averages go on from one value.
        ValueError when it is not what :meth:`snapshot` returns, with sane numbers."""
        clean = validate_snapshot(snapshot, self.tiers)
        self._agreed = clean
        self._mine = {**clean, **{k: {t: dict(v) for t, v in clean[k].items()} for k in ("save", "recovery")}}
        self._chosen = None

    def agreed(self) -> dict[str, Any]:
        """The agreed estimates (the same on every rank), as plain JSON values."""
        a = self._agreed
        return {**a, **{k: {t: dict(v) for t, v in a[k].items()} for k in ("save", "recovery")}}

    def seed(self, snapshot: dict[str, Any]) -> None:
        """Start from the estimates an earlier run kept (its newest manifest's): the step
        time, save costs and recovery time, not its failure history (the restart record's)."""
        clean = validate_snapshot(snapshot, self.tiers)
        clean.update(failures=0, exposure=0.0, running=0.0, restart_source="")
        self.adopt(clean)

    def mark_saved(self, tier: str, step: int) -> None:
        """``step`` is saved to ``tier`` (a resumed run's step): the next save is due an interval after it."""
        if tier not in self.tiers:
            raise ValueError(f"tier must be one of {self.tiers}, got {tier!r}")
        self._anchor[tier] = int(step)

    def agree(self, coord: Any = None) -> None:
        """(all ranks of ``coord``) Adopt the coordinator's estimates: one broadcast
        (``bcp.coordination`` Coordinator); None: this rank's own."""
        if coord is None:  # this rank's own estimates: nothing to check
            self._agreed, self._chosen = self.snapshot(), None
            return
        self.adopt(coord.broadcast(self.snapshot() if coord.is_coordinator else None))

    # -- decisions (agreed estimates only) -------------------------------------------------

    def mtbf(self) -> tuple[float, str]:
        """The mean time between failures the model uses, and where it came from."""
        if self.mtbf_given is not None:
            return self.mtbf_given, "given"
        a = self._agreed
        failures = a["failures"]
        lived = a["exposure"] + a["running"]
        value = (lived + self.prior_weight * self.prior_mtbf_seconds) / (failures + self.prior_weight)
        value = min(MTBF_RANGE[1], max(MTBF_RANGE[0], value))
        where = a["restart_source"] or "failures seen"
        return (
            value,
            f"learned: {failures} failure(s) in {_duration(lived)} ({where}), "
            f"prior {_duration(self.prior_mtbf_seconds)}",
        )

    def _tier_mtbf(self, tier: str, mtbf: float) -> float:
        if len(self.tiers) == 1:
            return mtbf
        share = self.local_loss_share if tier == "persistent" else 1.0 - self.local_loss_share
        return mtbf / max(share, 1e-9)

    def _inputs(self, tier: str) -> tuple[float | None, float, float, str, str]:
        """(cost, lag, recovery, cost source, recovery source) of one tier, agreed."""
        a = self._agreed
        save = a["save"].get(tier)
        cost, lag = (save["cost"], save["lag"]) if save else (None, 0.0)
        cost_src = f"average of {save['n']} save(s)" if save else "no save yet"
        rec = a["recovery"].get(tier)
        if rec is not None:
            return cost, lag, rec["seconds"], cost_src, f"average of {rec['n']} recovery(ies)"
        if save:  # reading back costs about what writing did
            return cost, lag, save["cost"] + save["lag"], cost_src, "assumed: the save's time"
        return cost, lag, 0.0, cost_src, "unknown"

    def save_cost(self, tier: str) -> float | None:
        """The agreed cost of a save to ``tier`` (None: not measured yet)."""
        save = self._agreed["save"].get(tier)
        return None if save is None else float(save["cost"])

    def interval_steps(self, tier: str = "persistent") -> int | None:
        """Steps between saves to ``tier`` (agreed estimates); None until the step time
        and the tier's save cost have been measured and agreed."""
        if self._chosen is None:
            self._chosen = self._choose()
        return self._chosen.get(tier)

    def _choose(self, *, keep: bool = True) -> dict[str, int]:
        step = self._agreed["step_seconds"]
        if not step:
            return {}
        mtbf, _ = self.mtbf()
        # inputs that moved less than ~1% since the last choice keep it (an optimisation
        # per save costs more than the save's bookkeeping; every rank computes the same key).
        # Only the agreed path keeps a choice (``keep``): report() on one rank must not change what it reuses
        key = tuple(round(math.log(max(x, 1e-9)) * 100) for x in self._key_inputs(step, mtbf))
        if key == self._key and self._last is not None:
            return self._last
        chosen = self._choose_now(step, mtbf)
        if keep:
            self._key, self._last = key, chosen
        return chosen

    def _key_inputs(self, step: float, mtbf: float) -> list[float]:
        out = [step, mtbf]
        for tier in self.tiers:
            cost, lag, recovery, _, _ = self._inputs(tier)
            out += [-1.0 if cost is None else cost + 1e-6, lag + 1e-6, recovery + 1e-6]
        return out

    def _choose_now(self, step: float, mtbf: float) -> dict[str, int]:
        out: dict[str, int] = {}
        unit = 1
        for tier in self.tiers:  # local first: the persistent interval is a multiple of it
            cost, lag, recovery, _, _ = self._inputs(tier)
            if cost is None:
                continue
            steps = best_steps(
                step,
                cost,
                recovery,
                self._tier_mtbf(tier, mtbf),
                lag,
                self.method,
                multiple_of=unit,
                max_steps=self.max_steps,
            )
            out[tier] = steps
            unit = steps
        return out

    def next_save_step(self, step: int, tier: str = "persistent") -> int:
        """The step at which the next save to ``tier`` is due (``step`` itself or
        earlier: due now). The first is due at the step after the first one asked about
        (one step measured); then every :meth:`interval_steps` steps after the tier's last
        save, or the step after it while the interval is not known yet."""
        if tier not in self.tiers:
            raise ValueError(f"tier must be one of {self.tiers}, got {tier!r}")
        if self._first is None:
            self._first = int(step)
        anchor = self._anchor.get(tier)
        if anchor is None:
            return self._first + 1
        n = self.interval_steps(tier)
        return anchor + (n if n is not None else 1)

    def waste_seconds_per_hour(self, chosen: Mapping[str, int] | None = None) -> float | None:
        """The model's expected waste at the chosen intervals (``chosen``: report()'s), seconds per hour."""
        step = self._agreed["step_seconds"]
        steps = {t: self.interval_steps(t) for t in self.tiers} if chosen is None else chosen
        if not step or any(steps.get(t) is None for t in self.tiers):
            return None
        mtbf, _ = self.mtbf()
        total = 0.0
        for tier in self.tiers:
            cost, lag, recovery, _, _ = self._inputs(tier)
            n = steps.get(tier)
            assert cost is not None and n is not None
            total += waste_fraction(n * step, cost, recovery, self._tier_mtbf(tier, mtbf), lag, self.method)
        return min(total, 1.0) * 3600.0

    def report(self) -> IntervalReport:
        a = self._agreed
        mtbf, mtbf_src = self.mtbf()
        step = a["step_seconds"]
        rows = []
        chosen = self._chosen if self._chosen is not None else self._choose(keep=False)  # any rank, no collective
        for tier in self.tiers:
            cost, lag, recovery, cost_src, rec_src = self._inputs(tier)
            n = chosen.get(tier)
            rows.append(
                TierInterval(
                    tier=tier,
                    steps=n,
                    seconds=n * step if n is not None and step else None,
                    save_seconds=cost,
                    save_source=cost_src,
                    lag_seconds=lag,
                    recovery_seconds=recovery,
                    recovery_source=rec_src,
                    mtbf_seconds=self._tier_mtbf(tier, mtbf),
                )
            )
        return IntervalReport(
            tiers=tuple(rows),
            waste_seconds_per_hour=self.waste_seconds_per_hour(chosen),
            mtbf_seconds=mtbf,
            mtbf_source=mtbf_src,
            step_seconds=step,
            step_source=f"average of {a['steps']} step(s)" if step else "no step yet",
            method=self.method,
        )


def _number(doc: dict[str, Any], key: str, lo: float, hi: float, *, optional: bool = False) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"interval estimates: {key!r} is {value!r}, not a number")
    if not lo <= value <= hi:
        raise ValueError(f"interval estimates: {key!r} is {value}, outside [{lo:g}, {hi:g}]")
    return value


def validate_snapshot(doc: Any, tiers: tuple[str, ...] = TIERS) -> dict[str, Any]:
    """A snapshot's values, checked (it may come from a manifest: hostile); ValueError
    naming the first bad field."""
    if not isinstance(doc, dict):
        raise ValueError(f"interval estimates are a {type(doc).__name__}, not an object")
    big = 1e15
    out: dict[str, Any] = {
        "step_seconds": _number(doc, "step_seconds", 0.0, MAX_SECONDS, optional=True),
        "steps": int(_number(doc, "steps", 0, big)),
        "failures": int(_number(doc, "failures", 0, big)),
        "exposure": float(_number(doc, "exposure", 0.0, big)),
        "running": float(_number(doc, "running", 0.0, big)),
    }
    source = doc.get("restart_source", "")
    if not isinstance(source, str) or len(source) > 200:
        raise ValueError("interval estimates: 'restart_source' is not a short text")
    out["restart_source"] = source
    saves = doc.get("save")
    if not isinstance(saves, dict) or any(t not in tiers for t in saves):
        raise ValueError(f"interval estimates: 'save' is not an object keyed by tiers of {tiers}")
    recovery = doc.get("recovery")
    if not isinstance(recovery, dict) or any(t not in tiers or not isinstance(v, dict) for t, v in recovery.items()):
        raise ValueError(f"interval estimates: 'recovery' is not an object keyed by tiers of {tiers}")
    out["recovery"] = {
        t: {"seconds": _number(v, "seconds", 0.0, MAX_SECONDS), "n": int(_number(v, "n", 1, big))}
        for t, v in recovery.items()
    }
    out["save"] = {}
    for tier, entry in saves.items():
        if not isinstance(entry, dict):
            raise ValueError(f"interval estimates: save[{tier!r}] is not an object")
        out["save"][tier] = {
            "cost": _number(entry, "cost", 0.0, MAX_SECONDS),
            "lag": _number(entry, "lag", 0.0, MAX_SECONDS),
            "n": int(_number(entry, "n", 1, big)),
        }
    return out
