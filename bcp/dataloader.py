"""Resume a sharded dataloader at another world size, with no sample skipped or repeated.

Each rank's position in the data is a per-rank object (``bcp.PerRank``). Loaded by
the same number of ranks, every rank gets its own back. Loaded by another number,
bcp calls the ``reshard_objects`` hook with every saved rank's value; the positions
can only be re-dealt when the order of the samples is known, so the sampler is
:class:`ShardedSampler`: a seeded permutation per epoch dealt round-robin over ranks
(what ``DistributedSampler`` does), whose state says which samples were handed out.

:func:`reshard_sampler_states` pools what every saved rank consumed and deals the rest
of the epoch to the new ranks. :func:`reshard_dataloader_states` does the same inside
the state of torchdata's ``StatefulDataLoader`` whose sampler is a ShardedSampler
(``num_workers=0``; with workers the loader prefetches ahead of what it yielded).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from bcp.errors import UnsupportedStateError

#: marks a ShardedSampler state, so a reshard hook can tell it from other objects
SAMPLER_MARK = "bcp_sharded_sampler"


def _default_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if not 0 <= rank < world_size:
        raise ValueError(f"ShardedSampler: rank {rank} is outside a world of {world_size}")
    return rank, world_size


class ShardedSampler(torch.utils.data.Sampler[int]):
    """Deals a permutation of ``range(num_samples)`` (seeded by ``seed + epoch``)
    round-robin over ranks, counting what it handed out so that a checkpoint can
    resume it on any number of ranks. ``rank``/``world_size`` default to the
    initialised process group. Iterating resumes a partly consumed epoch; once an
    iteration has run to its end, the next one starts the epoch over in this world's
    layout (call :meth:`set_epoch` for the next epoch's order)."""

    def __init__(
        self, num_samples: int, rank: int | None = None, world_size: int | None = None, seed: int = 0, epoch: int = 0
    ) -> None:
        self.rank, self.world_size = _default_rank_world(rank, world_size)
        self.num_samples, self.seed, self.epoch = num_samples, seed, epoch
        self.consumed = 0
        #: an iteration ran to the end of this rank's stream: the next one starts over
        self.exhausted = False
        #: after a reshard: this rank's remaining ids of the epoch
        self.order: list[int] | None = None
        #: this rank's share of the epoch's permutation, built once per epoch
        self._dealt: tuple[tuple[int, int, int], list[int]] | None = None

    def _stream(self) -> list[int]:
        if self.order is not None:
            return self.order
        key = (self.num_samples, self.seed, self.epoch)
        if self._dealt is None or self._dealt[0] != key:  # take() runs per batch: not one permutation each
            self._dealt = key, dealt(epoch_order(*key), self.rank, self.world_size)
        return self._dealt[1]

    def __iter__(self) -> Iterator[int]:
        if self.exhausted:
            self.consumed, self.order, self.exhausted = 0, None, False
        stream = self._stream()
        while self.consumed < len(stream):
            self.consumed += 1
            yield stream[self.consumed - 1]
        self.exhausted = True

    def take(self, n: int) -> list[int]:
        """The next ``n`` sample ids of this rank (fewer at the end of the epoch), for
        loops that draw ids without a DataLoader."""
        stream = self._stream()
        ids = stream[self.consumed : self.consumed + n]
        self.consumed += len(ids)
        return ids

    def __len__(self) -> int:
        if self.order is not None:
            return len(self.order)
        return len(range(self.rank, self.num_samples, self.world_size))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the epoch this sampler is in, not yet run
        to its end, keeps its position (DistributedSampler's idiom calls it at the top
        of every epoch, which would repeat a resumed epoch from its start)."""
        if epoch == self.epoch and not self.exhausted:
            return
        self.epoch, self.consumed, self.order, self.exhausted = epoch, 0, None, False

    def state_dict(self) -> dict[str, Any]:
        return {
            SAMPLER_MARK: 1,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "consumed": self.consumed,
            "exhausted": self.exhausted,
            "order": None if self.order is None else list(self.order),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved position. The rank and world must be this sampler's (a state
        from another world goes through :func:`reshard_sampler_states` first)."""
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"ShardedSampler state of rank {state['rank']} of {state['world_size']} given to rank {self.rank} of "
                f"{self.world_size}: reshard it with bcp.dataloader.reshard_sampler_states"
            )
        self.num_samples, self.seed, self.epoch = state["num_samples"], state["seed"], state["epoch"]
        self.consumed, self.order = state["consumed"], state["order"]
        self.exhausted = state.get("exhausted", False)


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The permutation every rank deals from in ``epoch``."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def is_sampler_state(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get(SAMPLER_MARK) == 1


def dealt(order: list[int], rank: int, world_size: int) -> list[int]:
    """The ids of ``order`` that rank ``rank`` of ``world_size`` deals (round-robin)."""
    return order[rank::world_size]


def consumed_ids(state: Mapping[str, Any], order: list[int] | None = None) -> list[int]:
    """The sample ids a saved sampler state had already handed out (``order``: its
    epoch's permutation, when the caller has it already)."""
    if state["order"] is not None:
        return list(state["order"][: state["consumed"]])
    if order is None:
        order = epoch_order(state["num_samples"], state["seed"], state["epoch"])
    return dealt(order, state["rank"], state["world_size"])[: state["consumed"]]


def reshard_sampler_states(values: Mapping[int, Mapping[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's sampler state in a world of ``world_size``: the samples no saved
    rank consumed, in the epoch's order, dealt round-robin. The saved ranks must be
    in the same epoch of the same data and seed."""
    first = values[min(values)]
    same = {(v["num_samples"], v["seed"], v["epoch"]) for v in values.values()}
    if len(same) != 1:
        raise UnsupportedStateError(
            f"sampler states of {len(values)} ranks disagree on (num_samples, seed, epoch): {sorted(same)}"
        )
    permutation = epoch_order(first["num_samples"], first["seed"], first["epoch"])  # the same for every rank
    done = {i for state in values.values() for i in consumed_ids(state, permutation)}
    order = dealt([i for i in permutation if i not in done], rank, world_size)
    return {**first, "world_size": world_size, "rank": rank, "consumed": 0, "exhausted": False, "order": order}


def is_dataloader_state(value: Any) -> bool:
    """A torchdata ``StatefulDataLoader.state_dict()`` whose sampler is a ShardedSampler."""
    if not isinstance(value, Mapping) or not isinstance(value.get("_sampler_iter_state"), Mapping):
        return False
    return is_sampler_state(value["_sampler_iter_state"].get("sampler_state"))


def reshard_dataloader_states(values: Mapping[int, Any], rank: int, world_size: int, *, fqn: str = "") -> Any:
    """This rank's state, in a world of ``world_size``, of a ShardedSampler or of a
    ``StatefulDataLoader`` built on one. The loader's own counters restart at 0: its
    sampler holds the position."""
    first = values[min(values)]
    if all(is_sampler_state(v) for v in values.values()):
        return reshard_sampler_states(values, rank, world_size)
    if not all(is_dataloader_state(v) for v in values.values()):
        raise UnsupportedStateError(
            f"per-rank object {fqn!r} saved by {len(values)} ranks is neither a bcp.dataloader.ShardedSampler state "
            "nor a StatefulDataLoader state built on one, so its position cannot be re-dealt to "
            f"{world_size} ranks; use ShardedSampler as the loader's sampler or pass your own reshard_objects hook"
        )
    samplers = {r: v["_sampler_iter_state"]["sampler_state"] for r, v in values.items()}
    state = copy.deepcopy(dict(first))
    state["_sampler_iter_state"] = {
        **state["_sampler_iter_state"],
        "samples_yielded": 0,
        "sampler_state": reshard_sampler_states(samplers, rank, world_size),
    }
    state.update(_sampler_iter_yielded=0, _num_yielded=0, _iterator_finished=False)
    return state
