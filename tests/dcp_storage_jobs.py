"""Multi-process jobs for tests/test_integrations_dcp.py: an FSDP2 training state (model,
AdamW, a tensor larger than an S3 part, a step int) saved by ``dcp.save`` through
``BcpStorageWriter`` and loaded by ``dcp.load`` through ``BcpStorageReader`` (and, on the
file backend, through DCP's own ``FileSystemReader``), on 1 or 2 gloo ranks. Every job
asserts inside the workers."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from bcp.integrations.dcp import BcpStorageReader, BcpStorageWriter
from dist_jobs import assert_equal_to_reference, full_reference, restore, sharded_model, sharded_state, train

#: 6.4 MB of float32: more than the 5 MiB parts the S3 tests use, so it is a multipart upload
BIG = 1_600_000


def state_of(model, opt, step: int) -> dict:
    big = torch.randn(BIG, generator=torch.Generator().manual_seed(step))
    return {**sharded_state(model, opt), "big": big, "step": step}


def _load_and_check(world: int, rank: int, reader, ref: dict, big: torch.Tensor, where: str) -> None:
    model, opt = sharded_model(world, "fsdp")
    state = {**sharded_state(model, opt), "big": torch.zeros(BIG), "step": 0}
    dcp.load(state, storage_reader=reader)
    restore(model, opt, state)
    assert_equal_to_reference(full_reference(model, opt), ref, f"rank {rank}: {where}")
    assert torch.equal(state["big"], big), f"rank {rank}: {where}: 'big' differs"
    assert state["step"] == 3, f"rank {rank}: {where}: step {state['step']}"


def round_trip_job(rank: int, world: int, uri: str, dcp_dir: str | None) -> None:
    """Train 3 steps, save through bcp, load into a fresh model through bcp (and through
    DCP's FileSystemReader from ``dcp_dir``, the same checkpoint as a directory)."""
    model, opt = sharded_model(world, "fsdp")
    train(model, opt, range(3), rank)
    state = state_of(model, opt, 3)
    dcp.save(state, storage_writer=BcpStorageWriter(uri))
    ref = full_reference(model, opt)
    _load_and_check(world, rank, BcpStorageReader(uri), ref, state["big"], uri)
    if dcp_dir is not None:
        _load_and_check(world, rank, dcp.FileSystemReader(dcp_dir), ref, state["big"], f"FileSystemReader({dcp_dir})")


def async_process_job(rank: int, world: int, uri: str) -> None:
    """``dcp.async_save`` in process mode: DCP pickles the writer for its checkpointing
    process (a lock and an open backend inside made that a TypeError)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"w": torch.arange(12.0).reshape(3, 4) + rank, "step": torch.tensor(7)}
    writer = BcpStorageWriter(uri)
    dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    loaded = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=BcpStorageReader(uri))  # verified against the sidecar's checksums
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4)) and int(loaded["step"]) == 7, loaded
