"""Save plans kept between saves: an unchanged layout reuses its plan.

A training job saves the same layout every few minutes. The plan depends only on
every rank's layout (tensors, dtypes, shapes, ties and boxes), so it is keyed by the
digest of every rank's :meth:`LocalLayout.digest`, in rank order. The coordinator
keeps the last :data:`KEEP_PLANS` plans' summaries (what the commit and the log
need, not the per-rank writes) and the decoded metadata they used; every rank keeps
its own writes of those plans. A save whose key the coordinator knows and every rank
still holds sends no box arrays and plans and scatters nothing. Each rank also keeps
its own prepared tensors of an unchanged structure (``bcp.kept_plans``).

One cache per coordinator group (process group) and process; saves run their
planning one at a time per process (``bcp.saver.start_save`` on the caller's thread), and a
lock keeps the cache consistent should two threads save at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from bcp.planning.local_layout import LayoutMeta

#: Plans kept per coordinator group (and writes per rank): the last four layouts, so
#: a job cycling through a few (e.g. with and without an optimizer state) hits too.
KEEP_PLANS = 4


@dataclasses.dataclass(frozen=True)
class PlanSummary:
    """What the coordinator keeps of a plan: enough to commit and to log."""

    bytes_per_rank: Mapping[int, int]
    tensors: int
    total_bytes: int
    #: every tensor's FQN in save order (the catalog's row order)
    order: tuple[str, ...]
    #: the decoded metadata of the plan's layouts, by meta digest (the commit maps
    #: each writer's tensor indices through it)
    metas: Mapping[bytes, LayoutMeta]


def plan_key(digests: Sequence[bytes]) -> bytes:
    """The cache key of a job-wide layout: every rank's layout digest, in rank order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(digests).to_bytes(8, "little"))
    for d in digests:
        h.update(len(d).to_bytes(1, "little"))
        h.update(d)
    return h.digest()


def save_order(meta_digests: Iterable[bytes], metas: Mapping[bytes, LayoutMeta]) -> tuple[str, ...]:
    """Tensors in the order ranks list them, rank by rank (each distinct meta once)."""
    order: dict[str, None] = {}
    for d in dict.fromkeys(meta_digests):
        order.update(dict.fromkeys(metas[d].fqns))
    return tuple(order)


class Clearable(Protocol):
    def clear(self) -> None: ...


L = TypeVar("L", bound=Clearable)


class PlanCache:
    """One process's cache for one coordinator group (see the module docstring)."""

    def __init__(self, keep: int = KEEP_PLANS) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        #: (coordinator) key -> summary, oldest first
        self._plans: OrderedDict[bytes, PlanSummary] = OrderedDict()
        #: (coordinator) decoded metadata of the kept plans, by meta digest
        self._metas: dict[bytes, LayoutMeta] = {}
        #: (every rank) key -> this rank's writes (indices into its flat box list)
        self._writes: OrderedDict[bytes, np.ndarray] = OrderedDict()
        #: (every rank) this rank's prepared tensors by structure (``bcp.kept_plans``,
        #: made by the save on first use: planning knows nothing of tensors)
        self._local: Clearable | None = None

    # -- every rank -----------------------------------------------------------------------

    def local(self, make: Callable[[], L]) -> L:
        """This rank's kept local plans, made by ``make()`` on first use."""
        with self._lock:
            if self._local is None:
                self._local = make()
            return self._local  # type: ignore[return-value]  # the one kind the save makes

    def held(self) -> dict[bytes, np.ndarray]:
        """This rank's writes by key, as they are now (what it tells the coordinator
        it holds, and what it uses if the coordinator answers with one of them)."""
        with self._lock:
            return dict(self._writes)

    def remember_writes(self, key: bytes, writes: np.ndarray) -> None:
        """Keep this rank's writes of plan ``key`` (a copy: on the coordinator they may
        be a view of every rank's writes, which must not stay alive)."""
        writes = np.array(writes, copy=True)
        with self._lock:
            self._writes[key] = writes
            self._writes.move_to_end(key)
            while len(self._writes) > self.keep:
                self._writes.popitem(last=False)

    # -- coordinator ----------------------------------------------------------------------

    def plan(self, key: bytes) -> PlanSummary | None:
        with self._lock:
            summary = self._plans.get(key)
            if summary is not None:
                self._plans.move_to_end(key)
            return summary

    def metas(self) -> dict[bytes, LayoutMeta]:
        with self._lock:
            return dict(self._metas)

    def remember_plan(self, key: bytes, summary: PlanSummary) -> None:
        """Keep ``summary`` (and the metadata it used); forget the oldest beyond ``keep``."""
        with self._lock:
            self._plans[key] = summary
            self._plans.move_to_end(key)
            while len(self._plans) > self.keep:
                self._plans.popitem(last=False)
            self._metas.update(summary.metas)
            used = set().union(*(p.metas for p in self._plans.values()))
            for d in [d for d in self._metas if d not in used]:
                del self._metas[d]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._metas.clear()
            self._writes.clear()
            local = self._local
        if local is not None:
            local.clear()


_CACHES: dict[Any, PlanCache] = {}
_CACHES_LOCK = threading.Lock()


def plan_cache_for(key: Any) -> PlanCache:
    """This process's cache for the coordinator group ``key`` (``Coordinator.cache_key``)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(key)
        if cache is None:
            cache = _CACHES[key] = PlanCache()
        return cache


def clear_plan_caches() -> None:
    """Forget every cached plan of this process (the next save plans from scratch)."""
    with _CACHES_LOCK:
        for cache in _CACHES.values():
            cache.clear()
        _CACHES.clear()
