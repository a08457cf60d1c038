"""Pausing Python's cyclic garbage collector for the span of a save or a load.

A save or load of n tensors allocates a few objects per tensor (plans, rows, pieces,
views); every 700 allocations the collector runs, and its older generations walk
every object the process holds (the caller's model and optimizer included). At
10,000 tensors that was 40% of a save's CPU time and grew faster than the work
itself. Nothing a save or load creates needs the cycle collector to be freed in
time (reference counting frees it), so the collector is held off while the calling
thread is inside one and runs as usual afterwards. Reference counted: nested or
concurrent saves and loads re-enable it only when the last one leaves, and only
when it was enabled when the first one entered (``gc.disable()`` by the caller is
respected). The same reference-counted hold (:class:`HeldOff`) serves another
process-wide switch: NumPy's huge-page advice (:mod:`bcp.numpy_pages`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class HeldOff:
    """A process-wide switch held off while any caller is inside :meth:`held`: turned off
    by the first to enter (``turn_off`` returns whether it was on), turned on again by
    the last to leave, and only if it was on when the first entered."""

    def __init__(self, turn_off: Callable[[], bool], turn_on: Callable[[], object]) -> None:
        self._turn_off, self._turn_on = turn_off, turn_on
        self._lock = threading.Lock()
        self._depth = 0
        self._restore = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._restore = self._turn_off()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._restore:
                    self._turn_on()

    def during(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorate ``fn`` so that its calls run in :meth:`held` (a fresh one each call)."""
        return self.held()(fn)


def _collector_off() -> bool:
    was = gc.isenabled()
    gc.disable()
    return was


_collector = HeldOff(_collector_off, gc.enable)


#: ``with paused():`` holds the cyclic collector off inside the block (the module's docstring)
paused = _collector.held


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``fn`` so that its calls run in :func:`paused` (a fresh one each call)."""
    return _collector.during(fn)
