"""Multi-process jobs for tests/test_interval.py (gloo ranks from dist_jobs' fork server)."""

from __future__ import annotations

import json

import torch.distributed as dist

from bcp.coordination.lanes import ready
from bcp.schedule.interval import IntervalPolicy


def agreed_policy_job(rank: int, world: int, out: str) -> None:
    """Every rank measures different times (as ranks do); after each save's agreement
    (one broadcast on bcp's own group) every rank names the same next save steps, and
    in between no collective is needed: each rank asks alone, every step."""
    coord = ready(None, "interval test").caller
    policy = IntervalPolicy(tiers=("local", "persistent"), mtbf_seconds=1800)
    due = {"local": policy.next_save_step(0, "local"), "persistent": policy.next_save_step(0, "persistent")}
    chosen = []
    for step in range(1, 400):
        policy.observe_step(0.1 + 0.05 * rank + 0.001 * step)  # this rank's own clock
        for tier in ("local", "persistent"):
            if step >= due[tier]:
                policy.observe_save(tier, (0.2 if tier == "local" else 3.0) * (1 + rank), step=step)
                policy.agree(coord)
                chosen.append((step, tier, policy.interval_steps("local"), policy.interval_steps("persistent")))
            due[tier] = policy.next_save_step(step, tier)
    everyone = [None] * world
    dist.all_gather_object(everyone, (chosen, policy.report()))
    assert all(other == everyone[0] for other in everyone), everyone
    assert len(chosen) >= 4 and chosen[-1][2] is not None and chosen[-1][3] % chosen[-1][2] == 0, chosen
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(chosen))


def auto_manager_job(rank: int, world: int, root: str, out: str) -> None:
    """``CheckpointManager(interval=...)`` on every rank, each rank's steps taking a
    different time: the ranks save the same steps (a disagreement would leave one rank
    in a save's collective alone: RanksMissingError) and report the same intervals."""
    import time

    import torch

    import bcp

    state = {"w": torch.ones(1000), "step": 0}
    policy = bcp.IntervalPolicy(mtbf_seconds=1.0, alpha=0.5)
    saved, reports = [], []
    with bcp.CheckpointManager(root, interval=policy, async_save=False) as manager:
        for step in range(60):
            time.sleep(0.02 * (1 + rank))  # rank 1 trains 2x slower by its own clock
            state["step"] = step
            assert manager.step(step, state) is False
            if manager._started == step:
                saved.append(step)
                reports.append(manager.report())
    everyone = [None] * world
    dist.all_gather_object(everyone, (saved, reports))
    assert all(other == everyone[0] for other in everyone), everyone
    assert saved[0] == 1 and len(saved) >= 2, saved
    assert all(r is not None and r.tiers[0].steps is not None for r in reports[1:]), reports
    if rank == 0:
        with open(out, "w") as f:
            f.write(json.dumps(saved))
