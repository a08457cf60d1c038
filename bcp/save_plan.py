"""The coordinator's save plan (pure; no process group, no I/O).

Every rank sends a LocalPlan: the boxes of each tensor it holds. The coordinator
checks that ranks agree on each tensor, that the distinct boxes tile the tensor
exactly (no gap, no partial overlap), writes each distinct box once, and spreads
replicated boxes over their holders so bytes per rank are balanced (largest box to
the least-loaded holder). Cost: O(F log F) in the number of local boxes F for the
layouts training uses (boxes disjoint along some dimension).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

from bcp.metadata import itemsize

from .boxes import Box
from .errors import ShardingError


@dataclasses.dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor as one rank holds it."""

    fqn: str
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    #: an earlier FQN whose local memory is this very tensor (tied weights), else None
    alias_of: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LocalPlan:
    rank: int
    tensors: tuple[TensorPlan, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class GlobalPlan:
    #: rank -> the (fqn, box) pairs it writes, in a stable order
    writes: dict[int, list[tuple[str, Box]]]
    #: rank -> bytes it writes
    bytes_per_rank: dict[int, int]
    tensors: int
    total_bytes: int


def _describe(box: Box) -> str:
    return f"offsets={list(box[0])} lengths={list(box[1])}"


def find_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two distinct boxes that share an element, or None. Sort-and-sweep on the first
    dimension; only boxes whose first-dimension intervals overlap are compared."""
    live = [b for b in boxes if math.prod(b[1]) > 0]
    if not live:
        return None
    if len(live[0][0]) == 0:
        return (live[0], live[1]) if len(live) > 1 else None
    live.sort(key=lambda b: b[0][0])
    active: list[tuple[int, int, Box]] = []  # heap of (end in dim 0, seq, box)
    for seq, box in enumerate(live):
        start = box[0][0]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _end, _s, other in active:
            if all(
                max(a, b) < min(a + x, b + y) for a, x, b, y in zip(box[0], box[1], other[0], other[1], strict=True)
            ):
                return other, box
        heapq.heappush(active, (start + box[1][0], seq, box))
    return None


def check_tiling(fqn: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    """Raise ShardingError unless the distinct ``boxes`` tile ``shape`` exactly."""
    for off, lens in boxes:
        if (
            len(off) != len(shape)
            or len(lens) != len(shape)
            or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(off, lens, shape, strict=True))
        ):
            raise ShardingError(
                f"tensor {fqn!r}: shard {_describe((off, lens))} lies outside the global shape {list(shape)}"
            )
    pair = find_overlap(boxes)
    if pair is not None:
        raise ShardingError(
            f"tensor {fqn!r}: shards {_describe(pair[0])} and {_describe(pair[1])} overlap but are not identical "
            "(replicas must hold exactly the same box)"
        )
    have, want = sum(math.prod(n) for _o, n in boxes), math.prod(shape)
    if have != want:
        raise ShardingError(
            f"tensor {fqn!r}: shards cover {have} of its {want} elements (global shape {list(shape)}); "
            "some part of the tensor is held by no rank"
        )


def plan_save(local_plans: Sequence[LocalPlan]) -> GlobalPlan:
    """Deduplicate, validate and balance (runs on the coordinator)."""
    world = len(local_plans)
    meta: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    for plan in local_plans:
        for t in plan.tensors:
            seen = meta.get(t.fqn)
            if seen is None:
                meta[t.fqn] = (t.key_path, t.dtype, t.global_shape, plan.rank)
                holders[t.fqn] = {}
            elif seen[:3] != (t.key_path, t.dtype, t.global_shape):
                raise ShardingError(
                    f"tensor {t.fqn!r}: rank {seen[3]} has {seen[1]}{list(seen[2])} but rank {plan.rank} has "
                    f"{t.dtype}{list(t.global_shape)}"
                )
            boxes = holders[t.fqn]
            for box in t.boxes:
                boxes.setdefault(box, []).append(plan.rank)

    aliases = _consistent_aliases(local_plans, world)
    items: list[tuple[int, str, Box, list[int]]] = []
    for fqn, boxes in holders.items():
        _kp, dtype, shape, _r = meta[fqn]
        check_tiling(fqn, shape, list(boxes))
        size = itemsize(dtype)
        if fqn in aliases:
            continue
        for box, ranks in boxes.items():
            items.append((math.prod(box[1]) * size, fqn, box, ranks))
    # Largest first, each to its least-loaded holder: the classic LPT balance.
    items.sort(key=lambda it: (-it[0], it[1], it[2]))
    load = [0] * world
    everyone = [(0, r) for r in range(world)]  # heap for boxes every rank holds (DDP)
    writes: dict[int, list[tuple[str, Box]]] = {r: [] for r in range(world)}
    owner: dict[tuple[str, Box], int] = {}
    for nbytes, fqn, box, ranks in items:
        if len(ranks) == world > 1:
            while True:  # lazy heap: skip entries made stale by later assignments
                cur, r = heapq.heappop(everyone)
                if cur == load[r]:
                    break
        else:
            r = min(ranks, key=lambda x: (load[x], x))
        load[r] += nbytes
        if world > 1:
            heapq.heappush(everyone, (load[r], r))
        writes[r].append((fqn, box))
        owner[(fqn, box)] = r
    # Tied tensors go to the rank writing their target, which stores the bytes once.
    for fqn, target in aliases.items():
        for box, ranks in holders[fqn].items():
            r = owner[(target, box)]
            writes[r if r in ranks else min(ranks)].append((fqn, box))
    return GlobalPlan(writes=writes, bytes_per_rank=dict(enumerate(load)), tensors=len(meta), total_bytes=sum(load))


def _consistent_aliases(local_plans: Sequence[LocalPlan], world: int) -> dict[str, str]:
    """FQN -> target FQN for tensors that every holder reports as the same memory as
    the target, box for box (tied embeddings); anything inconsistent is written normally."""
    seen: dict[str, set] = {}
    boxes: dict[str, set] = {}
    for plan in local_plans:
        for t in plan.tensors:
            seen.setdefault(t.fqn, set()).add(t.alias_of)
            boxes.setdefault(t.fqn, set()).update(t.boxes)
    out = {}
    for fqn, targets in seen.items():
        if (
            len(targets) == 1
            and (target := next(iter(targets))) is not None
            and target in boxes
            and boxes[fqn] <= boxes[target]
            and target not in out
        ):
            out[fqn] = target
    return out
