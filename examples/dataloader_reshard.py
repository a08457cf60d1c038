"""Worked example: resume a sharded data position and per-rank RNG at another world size.

Each rank's sampler (``bcp.dataloader.ShardedSampler``, also usable as the sampler of
torchdata's ``StatefulDataLoader``) walks its share of a shuffled epoch and is saved
as a per-rank object (``bcp.PerRank``). Loaded by the same number of ranks, every rank
gets its own position back. Loaded by another number, bcp hands the
``reshard_objects`` hook every saved rank's value; :func:`reshard_sampler_state` pools
the samples already consumed and deals the rest of the epoch to the new ranks, so no
sample is skipped or seen twice, and gives each rank a distinct RNG state.
``bcp.TrainingState`` does all of this for a whole training job (its hook is
``bcp.reshard_per_rank``).

    python examples/dataloader_reshard.py      # simulated 4 -> 3 and 2 -> 5 ranks, no processes
"""

from __future__ import annotations

from typing import Any

import torch

from bcp.dataloader import ShardedSampler, consumed_ids, reshard_dataloader_states
from bcp.training import reshard_per_rank, reshard_rng_states

__all__ = ["ShardedSampler", "consumed_ids", "reshard_sampler_state"]


def reshard_sampler_state(fqn: str, values: dict[int, Any], rank: int, world: int) -> Any:
    """bcp ``reshard_objects`` hook: sampler (or StatefulDataLoader) positions are
    re-dealt; a bare ``torch.get_rng_state()`` goes to the rank of the same number, and
    a rank beyond the saved count gets a fresh one derived from the saved states and
    its rank (never a copy of another rank's); anything else goes to bcp's own hook."""
    first = values[min(values)]
    if isinstance(first, torch.Tensor):
        wrapped = {r: {"torch": v, "cuda": []} for r, v in values.items()}
        return reshard_rng_states(wrapped, rank, world)["torch"]
    if isinstance(first, dict) and ("consumed" in first or "_sampler_iter_state" in first):
        return reshard_dataloader_states(values, rank, world, fqn=fqn)
    return reshard_per_rank(fqn, values, rank, world)


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
    rngs = {r: torch.Generator().manual_seed(r).get_state() for r in range(2)}
    grown = [reshard_sampler_state("rng", rngs, r, 5) for r in range(5)]
    assert len({bytes(g.numpy()) for g in grown}) == 5, "two ranks share an RNG state"
    print(
        f"4 ranks consumed {len(seen)} samples; 3 ranks resume with {[len(s) for s in resumed]} left each; "
        "every sample seen exactly once; 2 -> 5 ranks: 5 distinct RNG states"
    )


if __name__ == "__main__":
    main()
