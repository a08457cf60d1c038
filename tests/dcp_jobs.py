"""Multi-process jobs for tests/test_dcp_roundtrip.py: FSDP2 training state (model,
AdamW with param groups, a StepLR scheduler, a step int) saved and loaded by PyTorch
DCP and by bcp on 2 and 3 gloo ranks; and for tests/test_interop_per_rank.py: a
bcp.TrainingState with per-rank RNG and data positions and a transformers LambdaLR
schedule. Every job asserts inside the workers."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import bcp
from dist_jobs import assert_equal_to_reference, full_reference, restore, sharded_model, sharded_state, train

STEPS = 3


def training_state(world: int):
    """A fresh FSDP2 model, optimizer and scheduler over ``world`` ranks, and the
    state dict holding all of them plus a step int."""
    model, opt = sharded_model(world, "fsdp")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def full_state(model, opt, sched, step: int) -> dict:
    return {**sharded_state(model, opt), "sched": sched.state_dict(), "step": step}


def save_both_job(rank: int, world: int, dcp_dir: str, bcp_uri: str, ref_path: str) -> None:
    """Train a few steps; save the same state with DCP and with bcp; rank 0 writes the
    full reference (tensors, scheduler state, step, learning rate)."""
    model, opt, sched = training_state(world)
    for step in range(STEPS):
        train(model, opt, range(step, step + 1), rank)
        sched.step()
    state = full_state(model, opt, sched, STEPS)
    dcp.save(state, checkpoint_id=dcp_dir)
    bcp.save(state, bcp_uri)
    ref = {**full_reference(model, opt), "sched": sched.state_dict(), "step": STEPS, "lr": opt.param_groups[0]["lr"]}
    assert ref["lr"] != 0.01, "the scheduler changed the learning rate"
    if rank == 0:
        torch.save(ref, ref_path)


def _check(model, opt, sched, state: dict, ref_path: str, where: str) -> None:
    restore(model, opt, state)
    sched.load_state_dict(state["sched"])
    ref = torch.load(ref_path, weights_only=True)
    assert_equal_to_reference(full_reference(model, opt), {"model": ref["model"], "optim": ref["optim"]}, where)
    assert state["step"] == ref["step"], f"{where}: step {state['step']} != {ref['step']}"
    assert sched.state_dict() == ref["sched"], f"{where}: scheduler {sched.state_dict()} != {ref['sched']}"
    assert opt.param_groups[0]["lr"] == ref["lr"], f"{where}: lr {opt.param_groups[0]['lr']} != {ref['lr']}"


def bcp_load_job(rank: int, world: int, bcp_uri: str, ref_path: str) -> None:
    """A strict bcp load of the whole nested state (what DCP -> bcp must make possible)."""
    model, opt, sched = training_state(world)
    state = full_state(model, opt, sched, 0)
    state = bcp.load(state, bcp_uri)
    _check(model, opt, sched, state, ref_path, f"bcp load, rank {rank} of {world}")


def dcp_load_job(rank: int, world: int, dcp_dir: str, ref_path: str) -> None:
    """DCP's own load of a checkpoint (what bcp -> DCP must make possible)."""
    model, opt, sched = training_state(world)
    state = full_state(model, opt, sched, 0)
    dcp.load(state, checkpoint_id=dcp_dir)
    _check(model, opt, sched, state, ref_path, f"DCP load, rank {rank} of {world}")


# -- per-rank objects and LambdaLR schedulers (tests/test_interop_per_rank.py) ----------------------


class Position:
    """A dataloader's position: different on every rank, which is what PerRank is for."""

    def __init__(self, pos: int) -> None:
        self.pos, self.epoch = pos, 0

    def state_dict(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


def lambda_training(schedule: str, seed: int):
    """A small model, AdamW with two param groups and a transformers LambdaLR schedule
    (``cosine`` or ``linear`` warmup): its state_dict holds ``lr_lambdas: [{}, {}]``."""
    import transformers

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.005}]
    opt = torch.optim.AdamW(groups, lr=0.01)
    make = getattr(transformers, f"get_{schedule}_schedule_with_warmup")
    return model, opt, make(opt, num_warmup_steps=2, num_training_steps=10)


def per_rank_save_job(rank: int, world: int, schedule: str, bcp_uri: str, dcp_dir: str, ref_dir: str) -> None:
    """Train a few identical steps, then give every rank its own RNG and data position;
    save a bcp.TrainingState with bcp, and the same model, optimizer and schedule with
    DCP. Each rank writes what it saved (ref_dir/rank<r>.pt)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = lambda_training(schedule, seed=0)
    for step in range(STEPS):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)
    loader = Position(1000 * (rank + 1))
    ts = bcp.TrainingState(model, opt, sched, dataloader=loader, extra={"step": STEPS})
    ref = {
        "rng": bcp.training.rng_state(),
        "loader": loader.state_dict(),
        "sched": sched.state_dict(),
        "lr": [g["lr"] for g in opt.param_groups],
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    ts.save(bcp_uri)
    bcp.save({"sub": {"t": torch.ones(2), "pos": bcp.PerRank(rank)}}, bcp_uri + "-sub")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "step": STEPS}, checkpoint_id=dcp_dir)
    torch.save(ref, f"{ref_dir}/rank{rank}.pt")


def _check_lambda(model, opt, sched, ref: dict, where: str) -> None:
    assert sched.state_dict() == ref["sched"], f"{where}: scheduler {sched.state_dict()} != {ref['sched']}"
    assert [g["lr"] for g in opt.param_groups] == ref["lr"], f"{where}: lr differs"
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["model"][k]), f"{where}: {k} differs"
    opt.step()  # the restored schedule drives the optimizer
    sched.step()


def per_rank_load_job(
    rank: int, world: int, schedule: str, exported: str, imported: str, ref_dir: str, bcp_uri: str
) -> None:
    """bcp -> DCP: the recipe of docs/interop.md gives this rank its own RNG and data
    position, and the schedule back. DCP -> bcp: a strict bcp.load, then
    sched.load_state_dict. A per-rank object inside a subtree the template leaves
    empty goes to its own rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from bcp.convert import rank_key

    assert bcp.load({"sub": {}}, bcp_uri + "-sub")["sub"]["pos"] == rank
    ref = torch.load(f"{ref_dir}/rank{rank}.pt", weights_only=False)
    where = f"DCP load of the export, rank {rank} of {world}"
    model, opt, sched = lambda_training(schedule, seed=1)
    loader = Position(-1)
    ts = bcp.TrainingState(model, opt, sched, dataloader=loader, extra={"step": 0})
    state = ts.state_dict()
    mine = rank_key(dist.get_rank())
    for key in ("rng", "dataloader"):  # per-rank objects: ask for this rank's own value
        state[key] = {mine: state[key].value}
    dcp.load(state, checkpoint_id=exported)
    for key in ("rng", "dataloader"):
        state[key] = state[key][mine]
    ts.load_state_dict(state)
    assert loader.state_dict() == ref["loader"] == {"pos": 1000 * (rank + 1), "epoch": 0}, f"{where}: position"
    assert torch.equal(torch.get_rng_state(), ref["rng"]["torch"]), f"{where}: torch RNG"
    assert random.getstate() == ref["rng"]["python"], f"{where}: python RNG"
    assert ts.extra["step"] == STEPS
    _check_lambda(model, opt, sched, ref, where)

    where = f"bcp load of the DCP import, rank {rank} of {world}"
    model, opt, sched = lambda_training(schedule, seed=2)
    msd, osd = get_state_dict(model, opt)
    state = bcp.load({"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 0}, imported)  # strict
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    assert state["step"] == STEPS
    _check_lambda(model, opt, sched, ref, where)
