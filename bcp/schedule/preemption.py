"""Preemption: a scheduler's notice (a signal) turned into one last checkpoint, agreed by every rank.

A signal can arrive on any rank at any moment: inside a save, a load, a collective,
on one rank only. So the handler does nothing but record the notice (its time and
signal; a later one changes nothing), and ``CheckpointManager.step`` asks, once per
step, whether any rank holds one: one all-reduce (MAX) of four numbers on a gloo
group of bcp's own (the "preemption" lane, created with the manager), and none at
all when preemption is off. The same numbers carry the deadline left (the smallest
of any rank that got a notice) and each tier's measured save time (the largest of
any rank), so every rank makes the same choice of tier from the same inputs
(:func:`choose_tier`) and no second collective is needed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from bcp.coordination.collectives import Coordinator, GroupCoordinator

log = logging.getLogger(__name__)

#: the tiers a preemption save can go to, in the order of the agreement's numbers
TIERS = ("local", "persistent")


@dataclasses.dataclass(frozen=True)
class Preemption:
    """``CheckpointManager(preemption=bcp.Preemption())``: on one of ``signals`` (any
    rank), the next ``manager.step()`` saves the current step on every rank, waits for
    its commit and returns True. ``grace_seconds``: the time from the notice to the
    kill (the scheduler's grace period less what the job needs to exit); a save not
    expected to commit within what is left is not started (docs/manager.md,
    "Preemption")."""

    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
    grace_seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.signals, tuple):
            raise ValueError(f"Preemption.signals must be a tuple of signals, got {self.signals!r}")
        valid = set(signal.valid_signals())
        for sig in self.signals:
            if isinstance(sig, bool) or not isinstance(sig, int) or sig not in valid:
                raise ValueError(f"Preemption.signals: {sig!r} is not a signal of this platform")
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"Preemption.signals: {signal.Signals(sig).name} cannot be caught")
        g = self.grace_seconds
        if g is not None and (isinstance(g, bool) or not isinstance(g, int | float) or not g > 0 or math.isinf(g)):
            raise ValueError(f"Preemption.grace_seconds must be a number > 0 or None, got {g!r}")


@dataclasses.dataclass(frozen=True)
class Notice:
    """The first notice this process received."""

    #: the signal's number; None for ``Watch.notify`` (a notice from code, not a signal)
    signum: int | None
    #: ``time.monotonic()`` when it arrived
    at: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a notice (Watch.notify)"


Handler = Callable[[int, FrameType | None], Any] | int | None


def _live(handler: Handler, sig: int) -> Handler:
    """``handler``, or, while it is an uninstalled Watch's, the one that Watch found at its install."""
    while (watch := getattr(handler, "__self__", None)) is not None and isinstance(watch, Watch):
        if watch._installed or getattr(handler, "__func__", None) is not Watch._handle:
            break
        handler = watch._previous.get(sig)
    return handler if handler is not None else signal.SIG_DFL


class Watch:
    """The handlers of one manager's :class:`Preemption`, from :meth:`install` to :meth:`uninstall`."""

    def __init__(self, config: Preemption) -> None:
        self.config = config
        #: the first notice, None until one arrives (written by the handler, read by ``step``)
        self.notice: Notice | None = None
        #: notices after the first (recorded, never acted on twice)
        self.repeats = 0
        self._previous: dict[int, Handler] = {}
        #: between install and uninstall; after, a handler chained to ours only passes signals on
        self._installed = False

    def install(self) -> None:
        """Install the handlers (Python runs handlers in the main thread, and only the
        main thread may install them). Elsewhere a WARNING: no signal is caught, and
        only :meth:`notify` gives a notice."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption: the CheckpointManager was made outside the main thread, so no signal handler is "
                "installed (%s); only Watch.notify() gives a notice",
                ", ".join(signal.Signals(s).name for s in self.config.signals),
            )
            return
        for sig in self.config.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        """Put back the handlers found at :meth:`install` where ours is still the one installed, past any
        uninstalled Watch among them (managers closed in any order leave the handler found before the first).
        Where another handler was installed over ours, ours stays in its chain, passing signals on only."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, _live(handler, sig))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Record the notice (installed only); nothing else here (it may run inside a save, a load or a
        collective). Then the handler found at install time, when it is Python code: the default action
        (terminate) and ``SIG_IGN`` are what this replaces."""
        if self._installed:
            self._record(signum)
        previous = _live(self._previous.get(signum), signum)
        if callable(previous):
            previous(signum, frame)

    def notify(self) -> None:
        """Record a notice from code (a cloud's spot notice polled by the job): as a signal would."""
        self._record(None)

    def _record(self, signum: int | None) -> None:
        if self.notice is None:
            self.notice = Notice(signum, time.monotonic())
        else:
            self.repeats += 1

    def remaining(self) -> float | None:
        """Seconds left of ``grace_seconds`` since the notice (None: no deadline or no notice)."""
        if self.notice is None or self.config.grace_seconds is None:
            return None
        return self.config.grace_seconds - (time.monotonic() - self.notice.at)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What every rank agreed at one step: the same on every rank."""

    #: whether any rank holds a notice
    stop: bool
    #: the smallest deadline left of any rank with a notice (None: no deadline)
    remaining: float | None
    #: each tier's save time (the largest any rank measured; None: not measured)
    estimates: Mapping[str, float | None]


class Agreement:
    """The per-step exchange of one manager (``coord``: its "preemption" lane)."""

    def __init__(self, coord: Coordinator) -> None:
        import torch

        self.coord = coord
        self._torch = torch
        self._group = coord if isinstance(coord, GroupCoordinator) else None

    def exchange(self, watch: Watch, estimates: Mapping[str, float | None]) -> Verdict:
        """(every rank, every step) One all-reduce MAX of [notice, -deadline left,
        each tier's save time]: whether any rank got a notice, the smallest deadline
        left, the slowest rank's measurement. Without a group, this rank's own."""
        remaining = watch.remaining()
        measured = [estimates.get(t) for t in TIERS]
        values: list[float] = [
            1.0 if watch.notice is not None else 0.0,
            -remaining if remaining is not None else -math.inf,
            *(m if m is not None else -1.0 for m in measured),
        ]
        if self._group is not None:
            flags = self._torch.tensor(values, dtype=self._torch.float64)
            self._group.dist.all_reduce(flags, op=self._group.dist.ReduceOp.MAX, group=self._group.group)
            values = flags.tolist()
        left = -values[1] if values[1] != -math.inf else None
        agreed = {t: (v if v >= 0 else None) for t, v in zip(TIERS, values[2:], strict=True)}
        return Verdict(stop=values[0] > 0, remaining=left, estimates=agreed)


def choose_tier(verdict: Verdict, has_local: bool) -> tuple[str | None, float | None]:
    """The tier a preemption save goes to, and its expected time: the fastest that is
    expected to commit within the deadline. A tier not measured yet: the local tier
    counts as the fastest (memory), the persistent one as the slowest; neither is
    ruled out by the deadline (nothing says it is too slow). None: no tier fits, with
    the fastest expected time (for the WARNING)."""
    tiers = [t for t in TIERS if has_local or t != "local"]
    ordered = sorted(
        tiers,
        key=lambda t: (
            verdict.estimates[t] is None and t != "local",
            verdict.estimates[t] if verdict.estimates[t] is not None else 0.0,
        ),
    )
    for tier in ordered:
        expected = verdict.estimates[tier]
        if verdict.remaining is None or expected is None or expected <= verdict.remaining:
            return tier, expected
    return None, min(e for t in tiers if (e := verdict.estimates[t]) is not None)
