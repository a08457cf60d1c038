"""Coordination between the ranks of a job, over a gloo process group.

Save and load are collective: every rank calls them. One coordinator (rank 0 of the
group) plans and commits; the others follow. Every phase ends with a status exchange
so that a failure on any rank raises on every rank (no rank waits forever: the group
has a timeout, ``BCP_COLLECTIVE_TIMEOUT`` seconds, default 600). Without an
initialised process group the same code runs with a single-rank coordinator.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    IncompleteCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)

_GROUPS: dict[Any, Any] = {}


class RankFailedError(CheckpointError):
    """Another rank (or this one) failed during a collective checkpoint operation."""


class Coordinator:
    """Single-process coordinator: every collective is the identity."""

    rank = 0
    world_size = 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather(self, obj: Any) -> list[Any] | None:
        return self.all_gather(obj) if self.world_size == 1 else None

    def broadcast(self, obj: Any) -> Any:
        return obj

    def scatter(self, objs: list[Any] | None) -> Any:
        """(coordinator passes one object per rank) -> this rank's object."""
        return objs[0]

    def check(self, error: BaseException | None, phase: str) -> None:
        """Raise on every rank if any rank failed ``phase``; a rank's own error is chained."""
        statuses = self.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, msg) for r, msg in enumerate(statuses) if msg is not None]
        if not failed:
            return
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        if error is not None:  # this rank's own error keeps its type; the note tells about the others
            if self.world_size > 1:
                error.add_note(f"{phase} failed on {len(failed)} of {self.world_size} ranks: {detail}")
            raise error
        raise RankFailedError(f"{phase} failed on {len(failed)} of {self.world_size} ranks: {detail}")


class GroupCoordinator(Coordinator):
    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=self._root, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        self.dist.scatter_object_list(out, objs if self.rank == 0 else None, src=self._root, group=self.group)
        return out[0]


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("BCP_COLLECTIVE_TIMEOUT", "600")))


def coordinator_for(process_group: Any = None, slot: int = 0) -> Coordinator:
    """The coordinator for this call: single-rank without torch.distributed, else a
    gloo group with bcp's timeout (created once per job, process group and slot,
    collectively, on first use). Async saves alternate between two slots so one
    save's background commit never shares a group with the next save's planning."""
    try:
        import torch.distributed as dist
    except ImportError:
        return Coordinator()
    if not (dist.is_available() and dist.is_initialized()):
        return Coordinator()
    # Keyed by the job's default group too, so a re-initialised job gets fresh groups.
    key = (id(dist.group.WORLD), id(process_group) if process_group is not None else None, slot)
    group = _GROUPS.get(key)
    if group is None:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=collective_timeout())
        _GROUPS[key] = group
        if len(_GROUPS) == 1:
            atexit.register(release_groups)
    return GroupCoordinator(group)


def release_groups() -> None:
    """Destroy bcp's gloo groups. Runs at exit: a process group left to interpreter
    finalisation can abort the process while gloo threads are still running."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already destroyed with the default group
                pass


def run_phase(coord: Coordinator, phase: str, fn, *args, **kwargs):
    """Run ``fn`` on this rank, then agree with every rank whether all succeeded."""
    try:
        result = fn(*args, **kwargs)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        result, error = None, e
    coord.check(error, phase)
    return result


#: Errors a coordinator result may carry to the other ranks with their own type
#: (their constructors take one message).
_SHAREABLE_ERRORS = (
    CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError,
    FormatError, UnsupportedStateError, ValueError, TypeError, FileNotFoundError,
)


def share_result(coord: Coordinator, result: Any, phase: str) -> Any:
    """Send the coordinator's result (or the exception it raised) to every rank; an
    exception raises on every rank, with its own type where that is one message-only type."""
    if coord.world_size == 1:
        if isinstance(result, BaseException):
            raise result
        return result
    if coord.is_coordinator:
        if isinstance(result, BaseException):
            if isinstance(result, _SHAREABLE_ERRORS) and not isinstance(result, StateMismatchError):
                coord.broadcast(("error", type(result), str(result)))
            else:
                coord.broadcast(("error", RankFailedError, f"{phase} failed on the coordinator: {type(result).__name__}: {result}"))
            raise result
        coord.broadcast(("ok", result))
        return result
    tag, *payload = coord.broadcast(None)
    if tag == "ok":
        return payload[0]
    cls, message = payload
    try:
        error = cls(message)
    except TypeError:
        error = RankFailedError(message)
    raise error
