"""Ranks of the multi-process tests of incremental checkpoints (tests/test_incremental_read.py)."""

from __future__ import annotations

import torch

import bcp
from dist_jobs import full_reference, sharded_model, sharded_state, train


def two_saves_job(rank: int, world: int, base_uri: str, full_uri: str, ref_path: str) -> None:
    """FSDP2: save a base, change one parameter only, save again in full; the second
    state's full reference goes to ``ref_path`` (the other tensors are as in the base)."""
    model, opt = sharded_model(world, "fsdp")
    train(model, opt, range(3), rank)
    bcp.save(sharded_state(model, opt), base_uri)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    bcp.save(sharded_state(model, opt), full_uri)
    ref = full_reference(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
