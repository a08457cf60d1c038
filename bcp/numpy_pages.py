"""NumPy's huge-page advice held off while the share_reads coordinator plans.

NumPy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every
array of 4 MiB or more. Where the host's huge-page defrag setting is ``madvise`` (a
common default), the first touch of such memory may stall while the kernel compacts
memory to find a free 2 MiB page. The coordinator's plan for 4,096 ranks x 2,000
tensors allocates and frees about a gigabyte of short-lived arrays: on this project's
test host those stalls were 0.8-1.2 s of kernel time against 0.2-0.3 s with ordinary
pages, for 0.1 s more user time (more TLB misses in its gathers). So the plan's arrays
are allocated without the advice.

NumPy's public switch is the ``NUMPY_MADVISE_HUGEPAGE`` environment variable, read once
at import; the switch at run time is private (``_set_madvise_hugepage`` in NumPy's
multiarray module, present from NumPy 1.19 to 2.x). It is used here and nowhere else;
where a NumPy lacks it, nothing changes. The setting is process-wide: arrays other
threads allocate while a plan runs get ordinary pages too (a TLB cost, no error).
Held off as :mod:`bcp.gc_pause` holds the collector off (:class:`~bcp.gc_pause.HeldOff`): nested or
concurrent plans restore the advice only when the last one leaves, and only if it was on
when the first entered.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from bcp.gc_pause import HeldOff

P = ParamSpec("P")
R = TypeVar("R")


def _setter() -> Callable[[bool], bool] | None:
    """NumPy's run-time switch (returns the previous setting), or None where absent."""
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found = getattr(importlib.import_module(module), "_set_madvise_hugepage", None)
        except ImportError:
            continue
        if callable(found):
            return found
    return None


_set_advice = _setter()


def _advice_off() -> bool:
    return _set_advice is not None and bool(_set_advice(False))


def _advice_on() -> None:
    if _set_advice is not None:
        _set_advice(True)


_advice = HeldOff(_advice_off, _advice_on)


#: ``with ordinary_pages():`` arrays allocated inside get no huge-page advice (module docstring)
ordinary_pages = _advice.held


def with_ordinary_pages(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``fn`` so that its calls run in :func:`ordinary_pages` (a fresh one each call)."""
    return _advice.during(fn)
