"""Multi-process jobs for tests/test_exit_and_subset.py: saves and loads called by
fewer ranks than their group (they fail within BCP_RENDEZVOUS_TIMEOUT, saying why),
``process_group=bcp.LOCAL`` on one rank of an initialised world, a group of some of
the ranks, ranks that arrive late but within the bound, and CheckpointManager.close().
Started with dist_jobs.spawn; every job asserts inside the workers."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import bcp
import bcp.save_phases
from bcp.metadata import MANIFEST_KEY
from bcp.metadata.keys import step_name
from order_jobs import check, state, template


def _alone(call) -> tuple[BaseException, float]:
    """Run ``call`` (rank 0 alone): the RanksMissingError it raises, and after how long."""
    started = time.monotonic()
    try:
        call()
    except bcp.RanksMissingError as e:
        return e, time.monotonic() - started
    raise AssertionError("a call made by rank 0 alone returned")


def _check_message(error: BaseException, operation: str, missing: list[int]) -> None:
    message = str(error)
    for needed in (operation, "process_group=", "bcp.LOCAL", "BCP_RENDEZVOUS_TIMEOUT", "Every rank"):
        assert needed in message, f"{needed!r} missing from: {message}"
    assert getattr(error, "missing", None) == missing, f"missing ranks {getattr(error, 'missing', None)}: {message}"
    assert f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not call it" in message, message


def rank0_alone_job(rank: int, world: int, root: str, what: str, bound: float) -> None:
    """Rank 0 alone calls ``what`` (the other ranks go on to the job's final
    barrier): RanksMissingError naming every other rank, within ``bound`` s. With
    ``what`` = "load" or "async_save", every rank first saves together (bcp's groups
    exist, so the monitored barrier is what notices, naming every missing rank);
    otherwise the world is fresh (the creation of bcp's rendezvous group notices).
    Afterwards bcp.LOCAL still works on rank 0."""
    uri = f"{root}/ck"
    if what in ("load", "async_save"):
        bcp.save(state(rank, world, 1), uri)
    if rank == 0:
        calls = {
            "save": ("bcp.save", lambda: bcp.save(state(0, world, 2), f"{root}/alone")),
            "async_save": ("bcp.async_save", lambda: bcp.async_save(state(0, world, 2), f"{root}/alone")),
            "load": ("bcp.load", lambda: bcp.load(template(0, world), uri)),
        }
        operation, call = calls[what]
        error, elapsed = _alone(call)
        _check_message(error, operation, list(range(1, world)))
        assert elapsed < bound, f"{what} by rank 0 alone took {elapsed:.1f} s to fail"
        with open(f"{root}/elapsed-{what}.json", "w") as f:
            json.dump({"what": what, "seconds": elapsed}, f)
        assert not os.path.exists(f"{root}/alone/{MANIFEST_KEY}")
        # the group is unusable from now on, and says so at once
        again, seconds = _alone(lambda: bcp.save(state(0, world, 3), f"{root}/again"))
        assert "cannot run collectives on this process group" in str(again) and "bcp.LOCAL" in str(again), str(again)
        assert seconds < 2, f"the second call took {seconds:.1f} s to fail"
        bcp.save({"x": torch.arange(5)}, f"{root}/local", process_group=bcp.LOCAL)
        got = bcp.load({"x": torch.zeros(5, dtype=torch.long)}, f"{root}/local", process_group=bcp.LOCAL)
        assert torch.equal(got["x"], torch.arange(5))


def local_option_job(rank: int, world: int, root: str, late: float) -> None:
    """What a framework's rank-0-only checkpoint hook does, with process_group=bcp.LOCAL:
    save, async_save, load and a CheckpointManager on rank 0 alone, in an initialised
    world. Then every rank saves together: LOCAL created no group, so bcp's groups
    are still created in the same order on every rank. In those saves the last rank
    arrives ``late`` seconds after the others (still training, say), and then the
    others arrive late: within BCP_RENDEZVOUS_TIMEOUT, nothing fails."""
    if rank == 0:
        full = {"w": torch.arange(12.0).reshape(3, 4), "step": 4, "name": "rank0"}
        bcp.save(full, f"{root}/sync", process_group=bcp.LOCAL)
        handle = bcp.async_save(full, f"{root}/async", process_group=bcp.LOCAL)
        assert handle.wait().world_size == 1
        for name in ("sync", "async"):
            got = bcp.load({"w": torch.zeros(3, 4), "step": 0, "name": ""}, f"{root}/{name}", process_group=bcp.LOCAL)
            assert torch.equal(got["w"], full["w"]) and got["step"] == 4 and got["name"] == "rank0", name
            assert bcp.open(f"{root}/{name}").manifest.world_size == 1
        manager = bcp.CheckpointManager(f"{root}/run", keep_last=1, process_group=bcp.LOCAL)
        manager.save(1, full)
        manager.save(2, {**full, "step": 5})
        manager.close()
        assert manager.steps() == [2]
        step, got = manager.load_latest({"w": torch.zeros(3, 4), "step": 0, "name": ""})
        assert step == 2 and got["step"] == 5 and torch.equal(got["w"], full["w"])
    dist.barrier()
    for tag, latecomer in ((7, world - 1), (8, 0)):
        if rank == latecomer:
            time.sleep(late)
        bcp.save(state(rank, world, tag), f"{root}/together{tag}")
    check(f"{root}/together7", rank, world, 7)
    check(f"{root}/together8", rank, world, 8)


def subgroup_job(rank: int, world: int, root: str) -> None:
    """Ranks 0 and 1 of 3 save and load through process_group= a group of just them
    (rank 2 does something else); then all 3 save together."""
    pair = dist.new_group([0, 1])  # every rank creates it, as torch requires
    if rank in (0, 1):
        tensor = torch.full((4,), float(rank))
        sharded = bcp.TensorShard(tensor, (8,), (4 * rank,))
        bcp.save({"w": sharded, "step": 3}, f"{root}/pair", process_group=pair)
        handle = bcp.async_save({"w": sharded, "step": 4}, f"{root}/pair-async", process_group=pair)
        handle.wait()
        for name, step in (("pair", 3), ("pair-async", 4)):
            got = bcp.load(
                {"w": bcp.TensorShard(torch.zeros(4), (8,), (4 * rank,)), "step": 0},
                f"{root}/{name}",
                process_group=pair,
            )
            assert torch.equal(got["w"].local, tensor) and got["step"] == step
        assert bcp.open(f"{root}/pair").manifest.world_size == 2
    dist.barrier()
    bcp.save(state(rank, world, 9), f"{root}/all")
    check(f"{root}/all", rank, world, 9)


def manager_close_job(rank: int, world: int, root: str) -> None:
    """close() returns only once the pending async save is committed, with retention
    and latest.json applied: even when the commit is slow."""
    real_commit = bcp.save_phases.SaveJob.commit_checkpoint

    def slow_commit(self, reports):
        time.sleep(0.5)
        return real_commit(self, reports)

    bcp.save_phases.SaveJob.commit_checkpoint = slow_commit  # type: ignore[method-assign]
    manager = bcp.CheckpointManager(root, keep_last=1)
    manager.save(1, state(rank, world, 1))
    manager.save(2, state(rank, world, 2))
    pending = manager._pending
    assert pending is not None and not pending[0].done(), "the save of step 2 is still in flight"
    manager.close()
    assert pending[0].done() and manager._pending is None
    assert os.path.exists(os.path.join(root, step_name(2), MANIFEST_KEY)), "close() returned before the commit"
    assert manager.steps() == [2] and manager.latest() == 2
    with open(os.path.join(root, "latest.json")) as f:
        assert json.load(f)["step"] == 2
    bcp.save_phases.SaveJob.commit_checkpoint = real_commit  # type: ignore[method-assign]
    check(manager.uri(2), rank, world, 2)
