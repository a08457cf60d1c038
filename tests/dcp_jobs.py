"""Multi-process jobs for tests/test_dcp_roundtrip.py: FSDP2 training state (model,
AdamW with param groups, a StepLR scheduler, a step int) saved and loaded by PyTorch
DCP and by bcp on 2 and 3 gloo ranks. Every job asserts inside the workers."""

from __future__ import annotations

import torch
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
