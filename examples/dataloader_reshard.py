"""Worked example: resume a sharded dataloader at a different world size.

Each rank's sampler walks its own share of a shuffled epoch and saves how far it got
as a per-rank object (``bcp.PerRank``). Loaded by the same number of ranks, every
rank gets its own position back. Loaded by a different number, bcp hands the
``reshard_objects`` hook every saved rank's position; :func:`reshard_sampler_state`
pools the samples already consumed and deals the rest of the epoch to the new ranks,
so no sample is skipped or seen twice.

    python examples/dataloader_reshard.py      # simulated 4 -> 3 ranks, no processes
"""

from __future__ import annotations

from typing import Any

import torch


class ShardedSampler:
    """Deals a seeded permutation of ``num_samples`` ids round-robin over ranks."""

    def __init__(self, num_samples: int, rank: int, world: int, seed: int = 0, epoch: int = 0) -> None:
        self.num_samples, self.rank, self.world, self.seed, self.epoch = num_samples, rank, world, seed, epoch
        self.consumed = 0
        self.order: list[int] | None = None  # set after a reshard: this rank's remaining ids

    def _stream(self) -> list[int]:
        if self.order is not None:
            return self.order
        perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return perm.tolist()[self.rank :: self.world]

    def take(self, n: int) -> list[int]:
        """The next ``n`` sample ids of this rank (fewer at the end of the epoch)."""
        ids = self._stream()[self.consumed : self.consumed + n]
        self.consumed += len(ids)
        return ids

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "epoch": self.epoch,
            "world": self.world,
            "rank": self.rank,
            "consumed": self.consumed,
            "order": self.order,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_samples, self.seed, self.epoch = state["num_samples"], state["seed"], state["epoch"]
        self.consumed, self.order = state["consumed"], state["order"]


def consumed_ids(state: dict[str, Any]) -> list[int]:
    """The sample ids a saved sampler state had already handed out."""
    sampler = ShardedSampler(state["num_samples"], state["rank"], state["world"], state["seed"], state["epoch"])
    sampler.order = state["order"]
    return sampler._stream()[: state["consumed"]]


def reshard_sampler_state(fqn: str, values: dict[int, Any], rank: int, world: int) -> Any:
    """bcp ``reshard_objects`` hook: pool what every saved rank consumed, deal the rest.

    ``values`` maps each saving rank to its saved object. Objects other than sampler
    states fall back to saving rank ``rank % len(values)``'s value (RNG states, say):
    a choice this hook makes explicitly rather than bcp silently.
    """
    first = values[min(values)]
    if not (isinstance(first, dict) and "consumed" in first and "num_samples" in first):
        return values[sorted(values)[rank % len(values)]]
    done = {i for state in values.values() for i in consumed_ids(state)}
    perm = torch.randperm(first["num_samples"], generator=torch.Generator().manual_seed(first["seed"] + first["epoch"]))
    remaining = [i for i in perm.tolist() if i not in done]
    return {**first, "world": world, "rank": rank, "consumed": 0, "order": remaining[rank::world]}


def main() -> None:
    saved = [ShardedSampler(100, r, 4, seed=7) for r in range(4)]
    seen = [i for s in saved for i in s.take(9 + s.rank)]  # uneven progress per rank
    states = {r: s.state_dict() for r, s in enumerate(saved)}
    resumed = []
    for r in range(3):
        s = ShardedSampler(100, r, 3)
        s.load_state_dict(reshard_sampler_state("loader", states, r, 3))
        resumed.append(s)
    rest = [i for s in resumed for i in s.take(1000)]
    assert sorted(seen + rest) == list(range(100)), "a sample was lost or repeated"
    print(
        f"4 ranks consumed {len(seen)} samples; 3 ranks resume with {[len(s.order) for s in resumed]} left each; "
        "every sample seen exactly once"
    )


if __name__ == "__main__":
    main()
