"""Multi-process jobs for tests/test_lowest_rank.py (gloo on CPU, spawned with
dist_jobs.spawn): tensors whose copies differ per rank on purpose (BatchNorm's running
statistics) are stored from their lowest-ranked holder, under DDP, FSDP2, plain
``bcp.LowestRankCopy`` leaves and pipeline-like groups of holders."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bcp


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(2):
        gen = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own batches
        model(torch.randn(6, 8, generator=gen) * (rank + 1)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _rank0_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's buffers (bare names), on every rank."""
    mine = {k.removeprefix("module."): b.detach().clone() for k, b in model.named_buffers()}
    out = [mine]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def batchnorm_job(rank: int, world: int, root: str) -> None:
    """DDP and FSDP2 models with BatchNorm, trained on each rank's own data: the buffers
    differ between ranks, TrainingState saves them from rank 0, and a resume puts rank 0's
    on every rank. A plain save of the same differing buffers is still refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_bn_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    _train(ddp, opt, rank)
    expected = _rank0_buffers(ddp)
    mine = ddp.module[1].running_mean.clone()
    differs = [None] * world
    dist.all_gather_object(differs, not torch.equal(mine, expected["1.running_mean"]))
    assert any(differs), "the ranks' running statistics must differ for this test to mean anything"

    with pytest.raises(bcp.ReplicaMismatchError, match="running_mean") as refused:
        bcp.save({"model": ddp.module.state_dict()}, f"{root}/plain")
    assert "bcp.LowestRankCopy" in str(refused.value)

    bcp.TrainingState(ddp, opt).save(f"{root}/ddp")
    assert torch.equal(ddp.module[1].running_mean, mine), "the save must leave the model's own buffers alone"
    with bcp.open(f"{root}/ddp") as reader:
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(reader.read_tensors([f"model.{name}"])[f"model.{name}"], expected[name]), name

    fresh = DistributedDataParallel(_bn_model())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    bcp.TrainingState(fresh, fresh_opt).load(f"{root}/ddp")
    for name, value in expected.items():
        assert torch.equal(dict(fresh.module.named_buffers())[name], value), f"rank {rank}: {name}"

    model = _bn_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    fopt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, fopt, rank)
    expected = _rank0_buffers(model)
    info = bcp.TrainingState(model, fopt).save(f"{root}/fsdp2")
    bcp.TrainingState(model, fopt).save(f"{root}/fsdp2-again")  # the kept plan: rank 0's still
    for uri in (f"{root}/fsdp2", f"{root}/fsdp2-again"):
        with bcp.open(uri) as reader:
            assert torch.equal(
                reader.read_tensors(["model.1.running_var"])["model.1.running_var"], expected["1.running_var"]
            ), uri
    assert info.save_id


def leaves_job(rank: int, world: int, root: str) -> None:
    """LowestRankCopy leaves: the lowest holder's copy, whatever the balance would have
    chosen, in sync and async saves and a save that reuses its plan; holders that are a
    later group of ranks (a pipeline stage) give their own lowest; a load fills the
    wrapped tensor."""
    big = torch.ones(4096)  # equal everywhere, larger: LPT gives it rank 0 and "a" another rank
    for attempt in range(2):
        state = {"big": big, "a": bcp.LowestRankCopy(torch.full((512,), float(rank + 10 * attempt)))}
        if rank >= 1:
            state["stage"] = bcp.LowestRankCopy(torch.full((3,), float(rank)))
        uri = f"{root}/leaves{attempt}"
        if attempt:
            bcp.async_save(state, uri).wait()
        else:
            bcp.save(state, uri)
        with bcp.open(uri) as reader:
            assert torch.equal(reader.read_tensors(["a"])["a"], torch.full((512,), 10.0 * attempt)), attempt
            assert torch.equal(reader.read_tensors(["stage"])["stage"], torch.full((3,), 1.0)), (
                "ranks 1.. hold it: rank 1's"
            )
    target = torch.zeros(512)
    bcp.load({"a": bcp.LowestRankCopy(target)}, f"{root}/leaves1", strict=False)
    assert torch.equal(target, torch.full((512,), 10.0)), "loaded into the wrapped tensor"
    assert dist.get_world_size() == world
