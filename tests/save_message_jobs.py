"""Multi-process jobs for the save's messages (tests/test_save_messages.py): status
rounds that gather nothing when every rank succeeded, and the plan cache across
saves. Started with dist_jobs.spawn; every job asserts inside the workers."""

from __future__ import annotations

import torch
import torch.distributed as dist

import bcp
import bcp.saver


def _state(rank: int, world: int, rows: int, step: int) -> dict:
    """FSDP-like: each rank holds rows [rank*rows, (rank+1)*rows) of two tensors, plus a
    replicated bias (balanced over ranks) and a tied weight."""
    w = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 1000 * rank + step
    emb = torch.full((4, 2), float(step))
    return {
        "w": bcp.TensorShard(w, (rows * world, 3), (rows * rank, 0)),
        "v": bcp.TensorShard(w[:, :2].clone(), (rows * world, 2), (rows * rank, 0)),
        "bias": torch.full((5,), float(step)),
        "emb": emb,
        "head": emb,
        "step": step,
    }


def _check(uri: str, rank: int, world: int, rows: int, step: int) -> None:
    want = _state(rank, world, rows, step)
    got = bcp.load(_state(rank, world, rows, -1), uri)
    for key in ("bias", "emb", "head"):
        assert torch.equal(got[key], want[key]), f"rank {rank}: {key} differs in {uri}"
    for key in ("w", "v"):
        assert torch.equal(got[key].local, want[key].local), f"rank {rank}: {key} differs in {uri}"
    assert got["step"] == step


def plan_cache_job(rank: int, world: int, root: str) -> None:
    """Saves 1 and 2 share a layout: the second plans nothing, sends no layout and
    scatters nothing; save 3 changes the layout and plans again; every checkpoint
    loads exactly. A successful save gathers no statuses (no all_gather_object)."""
    calls = {"plan_save": 0, "layouts": 0, "all_gather_object": 0, "scatter": 0}
    real_plan, real_all_gather, real_scatter = bcp.saver.plan_save, dist.all_gather_object, dist.scatter_object_list
    real_gather = dist.gather_object

    def plan_save(*args, **kwargs):
        calls["plan_save"] += 1
        return real_plan(*args, **kwargs)

    def all_gather_object(*args, **kwargs):
        calls["all_gather_object"] += 1
        return real_all_gather(*args, **kwargs)

    def scatter_object_list(*args, **kwargs):
        calls["scatter"] += 1
        return real_scatter(*args, **kwargs)

    def gather_object(obj, *args, **kwargs):
        if isinstance(obj, bcp.saver.LocalLayout):
            calls["layouts"] += 1
        return real_gather(obj, *args, **kwargs)

    bcp.saver.plan_save = plan_save
    dist.all_gather_object = all_gather_object
    dist.scatter_object_list = scatter_object_list
    dist.gather_object = gather_object
    try:
        bcp.save(_state(rank, world, 3, 1), f"{root}/a")
        first = dict(calls)
        bcp.save(_state(rank, world, 3, 2), f"{root}/b")
        second = {k: v - first[k] for k, v in calls.items()}
        bcp.save(_state(rank, world, 4, 3), f"{root}/c")  # other shapes: another layout
        third = {k: v - first[k] - second[k] for k, v in calls.items()}
    finally:
        bcp.saver.plan_save = real_plan
        dist.all_gather_object = real_all_gather
        dist.scatter_object_list = real_scatter
        dist.gather_object = real_gather
    assert first == {"plan_save": int(rank == 0), "layouts": 1, "all_gather_object": 0, "scatter": 1}, first
    assert second == {"plan_save": 0, "layouts": 0, "all_gather_object": 0, "scatter": 0}, second
    assert third == first, third
    dist.barrier()
    _check(f"{root}/a", rank, world, 3, 1)
    _check(f"{root}/b", rank, world, 3, 2)
    _check(f"{root}/c", rank, world, 4, 3)
    if rank == 0:
        reader = bcp.open(f"{root}/b")
        assert reader.manifest.stats["tensors"] == 5 and reader.manifest.stats["fragments"] == world * 2 + 2
        assert (
            reader.manifest.stats["tensor_bytes"] == (3 * world * 3 + 3 * world * 2 + 5 + 8 + 8) * 4
        )  # head counts, stored once


def cache_lost_on_one_rank_job(rank: int, world: int, root: str) -> None:
    """A rank that lost its cached writes (here: cleared) makes the job plan again,
    instead of writing from a plan it no longer has."""
    from bcp.planning.cache import clear_plan_caches

    bcp.save(_state(rank, world, 3, 1), f"{root}/a")
    if rank == 1:
        clear_plan_caches()
    calls = {"plan_save": 0}
    real_plan = bcp.saver.plan_save

    def plan_save(*args, **kwargs):
        calls["plan_save"] += 1
        return real_plan(*args, **kwargs)

    bcp.saver.plan_save = plan_save
    try:
        bcp.save(_state(rank, world, 3, 2), f"{root}/b")
    finally:
        bcp.saver.plan_save = real_plan
    assert calls["plan_save"] == int(rank == 0), calls
    dist.barrier()
    _check(f"{root}/b", rank, world, 3, 2)
