"""Coordination between the ranks of a job: the coordinators and the phases.

Save and load are collective: every rank calls them. One coordinator (rank 0 of the
group) plans and commits; the others follow. Every phase ends with a status exchange
so that a failure on any rank raises on every rank (no rank waits forever: the group
has a timeout, ``BCP_COLLECTIVE_TIMEOUT`` seconds, default 600). A phase that
succeeded everywhere costs one all-reduce of a single integer; the errors themselves
are gathered only when some rank failed. Without an initialised process group, or
with ``process_group=LOCAL``, the same code runs with a single-rank coordinator.

This module holds what runs on a group once it exists: the coordinators
(:class:`Coordinator` for one process, :class:`GroupCoordinator` over a registered
gloo group, :class:`OwnGroupCoordinator` over bcp's own ``ProcessGroupGloo``), the
phases (:func:`run_phase`, :func:`decide`, :func:`share_result`) and the way errors
travel (:func:`portable`). Which group each operation uses, and when the groups are
created and released, is ``bcp.coordination.lanes``'.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from bcp.errors import RankFailedError

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("BCP_COLLECTIVE_TIMEOUT", "600")))


#: An error whose pickle is larger than this travels as its message only (it may hold
#: tensors or user objects; every rank receives every rank's error).
MAX_ERROR_PICKLE_BYTES = 256 << 10


@dataclasses.dataclass(frozen=True)
class SentError:
    """An error on its way to other ranks: its pickle when small and picklable, and
    always its type name and message, so the receiver can rebuild it or fall back."""

    type_name: str
    message: str
    pickled: bytes | None

    def restore(self) -> BaseException:
        """The error with its type and fields, or a RankFailedError with its message
        when it cannot be rebuilt here (an unknown class, a device this rank lacks)."""
        if self.pickled is not None:
            try:
                error = pickle.loads(self.pickled)  # unsafe-ok: sent by a rank of this job, not read from storage
                if isinstance(error, BaseException):
                    return error
            except Exception:  # noqa: BLE001 - any failure to rebuild falls back to the message
                pass
        return RankFailedError(f"{self.type_name}: {self.message}")


def portable(error: BaseException) -> SentError:
    """``error`` packed for other ranks (see :class:`SentError`)."""
    pickled: bytes | None
    try:
        data = pickle.dumps(error)
        pickle.loads(data)  # unsafe-ok: our own pickle; rebuilds here, so it most likely does there
        pickled = data if len(data) <= MAX_ERROR_PICKLE_BYTES else None
    except Exception:  # noqa: BLE001 - an error holding a socket, a lock, a lambda...
        pickled = None
    return SentError(type(error).__name__, str(error), pickled)


class Coordinator:
    """Single-process coordinator: every collective is the identity."""

    rank = 0
    world_size = 1
    #: which cache of save plans this coordinator's saves use (one per process group)
    cache_key: Any = "local"

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
        assert objs is not None, "the only rank is the coordinator"
        return objs[0]

    def isend(self, tensor: Any, peer: int) -> Any:
        """Send ``tensor`` (CPU) to rank ``peer``; the work to wait on. One rank has no peer."""
        raise RuntimeError(f"a single-rank coordinator has no rank {peer} to send to")

    def irecv(self, tensor: Any, peer: int) -> Any:
        """Receive into ``tensor`` (CPU) from rank ``peer``; the work to wait on."""
        raise RuntimeError(f"a single-rank coordinator has no rank {peer} to receive from")

    def any_failed(self, failed: bool) -> bool:
        """Whether any rank passed ``failed=True`` (collective). This generic version
        gathers every flag; a process group does it with one all-reduce."""
        return any(self.all_gather(failed))

    def check(self, error: BaseException | None, phase: str) -> None:
        """Raise on every rank if any rank failed ``phase``. A failed rank raises its own
        error (a note names the others); the rest raise RankFailedError whose
        ``errors`` holds each failed rank's error with its type and fields."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        if not self.any_failed(error is not None):
            return  # the common case: O(1) bytes per rank
        statuses = self.all_gather(None if error is None else portable(error))
        failed = {r: sent.restore() for r, sent in enumerate(statuses) if sent is not None}
        if not failed:
            return
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failed.items())
        summary = f"{phase} failed on {len(failed)} of {self.world_size} ranks: {detail}"
        if error is not None:
            error.add_note(summary)
            raise error
        first = next(iter(failed.values()))
        raise RankFailedError(summary, errors=failed) from first


class GroupCoordinator(Coordinator):
    """Collectives over one of bcp's gloo groups (one lane of one process group)."""

    def isend(self, tensor: Any, peer: int) -> Any:
        """Send ``tensor`` (CPU) to rank ``peer`` of this group; the work to wait on."""
        return self.dist.isend(tensor, group=self.group, group_dst=peer)

    def irecv(self, tensor: Any, peer: int) -> Any:
        """Receive into ``tensor`` (CPU) from rank ``peer`` of this group; the work to wait on."""
        return self.dist.irecv(tensor, group=self.group, group_src=peer)

    def __init__(self, group: Any, cache_key: Any = None, process_group: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        #: the caller's process group this coordinator serves (None: the whole job)
        self.process_group = process_group
        self.cache_key = cache_key if cache_key is not None else ("group", id(group))
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

    def any_failed(self, failed: bool) -> bool:
        """One all-reduce (MAX) of a one-element tensor over bcp's gloo group."""
        import torch

        flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def scatter(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        self.dist.scatter_object_list(out, objs if self.rank == 0 else None, src=self._root, group=self.group)
        return out[0]


class OwnGroupCoordinator(Coordinator):
    """Collectives over a ``ProcessGroupGloo`` of bcp's own (built by
    ``bcp.coordination.lanes.background_coordinator``), called directly: torch's
    object collectives accept only registered groups, so
    objects travel as pickles framed with their length and padded to the longest."""

    def __init__(self, pg: Any, rank: int, world_size: int, cache_key: Any) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.pg = torch, dist, pg
        self.rank, self.world_size, self.cache_key = rank, world_size, cache_key

    def _max(self, value: int) -> int:
        """The largest ``value`` of any rank (an all-gather of one integer each)."""
        mine = self.torch.tensor([value], dtype=self.torch.int64)
        out = [self.torch.empty_like(mine) for _ in range(self.world_size)]
        self.pg.allgather([out], [mine]).wait()
        return max(int(t.item()) for t in out)

    def any_failed(self, failed: bool) -> bool:
        return bool(self._max(1 if failed else 0))

    def isend(self, tensor: Any, peer: int) -> Any:
        """Point-to-point on the process group itself (it is not registered with torch)."""
        return self.pg.send([tensor], peer, 0)

    def irecv(self, tensor: Any, peer: int) -> Any:
        return self.pg.recv([tensor], peer, 0)

    def _frame(self, data: bytes, size: int) -> Any:
        """``data`` with its length in front, padded to ``size`` bytes of payload."""
        frame = self.torch.zeros(8 + size, dtype=self.torch.uint8)
        frame[:8] = self.torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=self.torch.uint8)
        if data:
            frame[8 : 8 + len(data)] = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
        return frame

    @staticmethod
    def _unframe(frame: Any) -> Any:
        raw = frame.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        return pickle.loads(raw[8 : 8 + n])  # unsafe-ok: sent by a rank of this job, as torch object collectives do

    def _padded(self, obj: Any) -> Any:
        """This rank's frame, padded to the longest of any rank (gloo moves equal sizes)."""
        data = pickle.dumps(obj)
        return self._frame(data, self._max(len(data)))

    def all_gather(self, obj: Any) -> list[Any]:
        frame = self._padded(obj)
        out = [self.torch.empty_like(frame) for _ in range(self.world_size)]
        self.pg.allgather([out], [frame]).wait()
        return [self._unframe(f) for f in out]

    def gather(self, obj: Any) -> list[Any] | None:
        frame = self._padded(obj)
        out = [self.torch.empty_like(frame) for _ in range(self.world_size)] if self.rank == 0 else []
        opts = self.dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather([out] if self.rank == 0 else [], [frame], opts).wait()
        return [self._unframe(f) for f in out] if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = self.torch.tensor([len(data)], dtype=self.torch.int64)
        opts = self.dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([size], opts).wait()
        frame = self._frame(data, int(size.item()))
        self.pg.broadcast([frame], opts).wait()
        return self._unframe(frame)

    def scatter(self, objs: list[Any] | None) -> Any:
        everything = self.broadcast(objs)  # unused by the commit; correct, not lean
        return everything[self.rank]


def run_phase(coord: Coordinator, phase: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run ``fn`` on this rank, then agree with every rank whether all succeeded."""
    result: _T | None = None
    try:
        result = fn(*args, **kwargs)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        error = e
    coord.check(error, phase)
    return cast(_T, result)  # fn returned it: check() raised on every rank otherwise


def share_result(coord: Coordinator, result: Any, phase: str) -> Any:
    """Send the coordinator's result, or the exception it raised, to every rank; an
    exception raises on every rank with its own type and fields."""
    if coord.world_size == 1:
        if isinstance(result, BaseException):
            raise result
        return result
    if coord.is_coordinator:
        if isinstance(result, BaseException):
            coord.broadcast(("error", portable(result)))
            raise result
        coord.broadcast(("ok", result))
        return result
    tag, payload = coord.broadcast(None)
    if tag == "ok":
        return payload
    error = payload.restore()
    error.add_note(f"raised on the coordinator while {phase}")
    raise error


def decide(
    coord: Coordinator, phase: str, fn: Callable[..., Any], *args: Any, share: Callable[[Any], Any] | None = None
) -> Any:
    """The coordinator runs ``fn(*args)``; if it raises, every rank raises that error.
    Otherwise the coordinator gets the result and the other ranks get ``share(result)``
    (the whole result when ``share`` is None): what they need, not what they don't."""
    outcome: Any = None
    result: Any = None
    if coord.is_coordinator:
        try:
            result = fn(*args)
            outcome = result if share is None else share(result)
        except Exception as e:  # noqa: BLE001 - shared with every rank, raised there
            outcome = e
    shared = share_result(coord, outcome, phase)
    return result if coord.is_coordinator else shared


def gather_decide(
    coord: Coordinator,
    phase: str,
    mine: Any,
    fn: Callable[[Any], Any],
    *,
    share: Callable[[Any], Any] | None = None,
    sent: Callable[[], None] | None = None,
) -> Any:
    """One phase that the coordinator settles from what every rank sends: each rank's
    ``mine`` is gathered on the coordinator, which runs ``fn(gathered)``; then as
    :func:`decide`. ``sent()`` runs on every rank once the gather is done (a save
    records that its report reached the coordinator). The collectives are those of
    ``coord.gather`` then ``decide``, in that order."""
    gathered = coord.gather(mine)
    if sent is not None:
        sent()
    return decide(coord, phase, fn, gathered, share=share)


def gather_decide_scatter(
    coord: Coordinator,
    phase: str,
    mine: Any,
    fn: Callable[[Any], Any],
    parts: Callable[[Any], list[Any]],
) -> tuple[Any, Any]:
    """:func:`gather_decide` whose result stays on the coordinator (the other ranks get
    None), followed by a scatter of ``parts(result)``, one object per rank: returns
    ``(result, this rank's part)``."""
    result = gather_decide(coord, phase, mine, fn, share=lambda _result: None)
    part = coord.scatter(parts(result) if coord.is_coordinator else None)
    return result, part
