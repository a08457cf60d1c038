"""Multi-process jobs for tests/test_coordination_ready.py (gloo, started by
``dist_jobs.spawn``): when bcp creates its groups, and how often a save's phases enter
the ``bcp.coordination`` package."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import bcp
from bcp.coordination import gloo_network

#: the functions through which a save's phases enter the package (bcp.coordination.collectives)
PHASE_FUNCTIONS = {"run_phase", "decide", "gather_decide", "gather_decide_scatter"}

#: > 0 while a counted group creation runs (its calls into the package are bcp's own, not entries)
_creating = [0]


@contextmanager
def counting_group_creations(timeline: list | None = None) -> Iterator[list]:
    """Every ``torch.distributed.new_group`` call and every group bcp builds itself
    (``gloo_network.create_group``: its ``new_group`` groups and its own ``ProcessGroupGloo``),
    also appended to ``timeline`` when given."""
    created: list = timeline if timeline is not None else []
    new_group, create_group = dist.new_group, gloo_network.create_group

    def counted_new_group(*args: Any, **kwargs: Any) -> Any:
        created.append(("create", "new_group", None, threading.current_thread().name))
        return new_group(*args, **kwargs)

    def counted_create_group(*args: Any, **kwargs: Any) -> Any:
        created.append(("create", "create_group", None, threading.current_thread().name))
        _creating[0] += 1
        try:
            return create_group(*args, **kwargs)
        finally:
            _creating[0] -= 1

    dist.new_group = counted_new_group
    gloo_network.create_group = counted_create_group
    try:
        yield created
    finally:
        dist.new_group, gloo_network.create_group = new_group, create_group


@contextmanager
def entries_into_coordination(entries: list | None = None) -> Iterator[list]:
    """(module, function, phase, thread) of every call into ``bcp.coordination`` from
    outside it, on every thread: the caller's and the ones started meanwhile (an async
    save's, its writers). Reading ``Coordinator.is_coordinator`` (a property: no message) is not one."""
    entries = entries if entries is not None else []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or _creating[0]:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("bcp.coordination.") or frame.f_code.co_name == "is_coordinator":
            return
        caller = frame.f_back
        if caller is not None and caller.f_globals.get("__name__", "").startswith("bcp.coordination"):
            return
        phase = frame.f_locals.get("phase")
        entries.append((module.rsplit(".", 1)[1], frame.f_code.co_name, phase, threading.current_thread().name))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield entries
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)


def _state(rank: int) -> dict[str, Any]:
    return {"w": bcp.PerRank(torch.arange(64, dtype=torch.float32) + rank), "shared": torch.ones(8)}


def no_group_created_in_manager_saves_job(rank: int, world: int, root: str, async_save: bool, tier: str) -> None:
    """After ``CheckpointManager()``, its saves (their commits, a local tier's replication
    and drains, a load) create no group."""
    local = None
    if tier:  # one host per rank; steps 2 and 4 drained to the root
        os.environ["BCP_HOST_ID"] = f"host{rank}"
        local = bcp.LocalTier(keep_free=0.0, dir=os.path.join(tier, f"host{rank}"), every=1, persist_every=2, keep=2)
    manager = bcp.CheckpointManager(root, keep_last=2, async_save=async_save, tier=local)
    with counting_group_creations() as created:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(rank))
        manager.wait()
        step, _got = manager.load_latest(_state(rank))
    assert created == [], f"rank {rank}: groups created inside the manager's saves: {created}"
    assert manager.steps() == [2, 4] if tier else [3, 4], manager.steps()
    assert step == 4


def free_async_save_groups_before_phases_job(rank: int, world: int, root: str) -> None:
    """The first ``bcp.async_save`` of a process creates its groups before its first phase."""
    timeline: list = []
    with counting_group_creations(timeline), entries_into_coordination(timeline):
        bcp.async_save(_state(rank), f"{root}/a").wait()
    names = [f"{module}.{function}" for module, function, _phase, _thread in timeline]
    created = [i for i, name in enumerate(names) if name.startswith("create.")]
    phases = [i for i, name in enumerate(names) if name.split(".")[1] in PHASE_FUNCTIONS]
    assert created, f"rank {rank}: the first async save of a process creates bcp's groups: {names}"
    assert phases and max(created) < min(phases), f"rank {rank}: a group created inside a phase: {names}"
    assert [n for n in names if n.startswith(("lanes.", "gloo_network."))] == ["lanes.ready"], names


def phases_enter_once_job(rank: int, world: int, root: str, async_save: bool) -> None:
    """Each phase of a manager's save enters bcp.coordination once, through a phase function."""
    manager = bcp.CheckpointManager(root, async_save=async_save)
    manager.save(1, _state(rank))  # the first save plans; the one measured reuses the plan or plans anew
    manager.wait()
    for step in (2, 3):
        with entries_into_coordination() as entries:
            manager.save(step, _state(rank))
            manager.wait()
        coordination = [e for e in entries if e[0] != "priority"]  # a thread's own priority: no message
        assert all(e[1] == "lower_this_thread" for e in entries if e[0] == "priority"), entries
        # no entry into the network module, and into the lanes only to open an operation
        assert all(e[0] in ("collectives", "lanes") for e in coordination), coordination
        assert all(e[1] == "ready" for e in coordination if e[0] == "lanes"), coordination
        phases = [(function, phase) for module, function, phase, _t in coordination if module == "collectives"]
        # every entry into collectives is one phase, named, and entered once
        assert all(function in PHASE_FUNCTIONS and phase for function, phase in phases), phases
        assert len(phases) == len(set(phases)), phases
        # a save: open, prepare, plan, write, commit; its retention: open, decide
        assert len(coordination) <= 7, coordination
    manager.close()
