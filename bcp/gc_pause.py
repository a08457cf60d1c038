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
respected).
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_lock = threading.Lock()
_depth = 0
_reenable = False

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def paused() -> Iterator[None]:
    """Hold the cyclic collector off inside the block (see the module's docstring)."""
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _reenable:
                gc.enable()


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``fn`` so that its calls run in :func:`paused`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)

    return wrapper
