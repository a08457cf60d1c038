"""Multi-process jobs for tests/test_manager_incremental.py (gloo, started with
dist_jobs.spawn): an incremental CheckpointManager on 2 ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import bcp

ROWS = 64  # a sharded tensor of 64 rows of 16 float32 values (4 KiB), 2 KiB per rank


def sharded_state(rank: int, world: int, step: int) -> dict:
    """Rank ``rank``'s part of step ``step``'s state: a frozen sharded tensor, an
    adapter sharded by rows that changes every step, a replicated frozen tensor."""
    rows = ROWS // world
    frozen = torch.arange(ROWS * 16, dtype=torch.float32).reshape(ROWS, 16)
    adapter = torch.full((ROWS, 4), float(step)) + torch.arange(ROWS, dtype=torch.float32)[:, None]
    part = slice(rank * rows, (rank + 1) * rows)
    return {
        "frozen": bcp.TensorShard(frozen[part].clone(), (ROWS, 16), (rank * rows, 0)),
        "adapter": bcp.TensorShard(adapter[part].clone(), (ROWS, 4), (rank * rows, 0)),
        "table": torch.ones(8, 8),
        "step": step,
    }


def manager_job(rank: int, world: int, root: str) -> None:
    written = []
    m = bcp.CheckpointManager(root, keep_last=2, incremental=True, metrics=lambda r: written.append(r.bytes))
    for step in range(4):
        m.save(step, sharded_state(rank, world, step))
    m.close()
    dist.barrier()
    assert m.steps() == [2, 3], m.steps()
    # this rank's bytes per save: everything at first, then only its rows of the adapter
    assert written[0] == (ROWS // world) * (16 + 4) * 4 + (8 * 8 * 4 if rank == 0 else 0), written
    assert written[1:] == [(ROWS // world) * 4 * 4] * 3, written


def load_three_job(rank: int, world: int, root: str) -> None:
    """Step 3, saved by 2 ranks, loaded as 3 ranks' shards (rows 64 over 3: uneven)."""
    bounds = [0, 22, 43, 64]
    lo, hi = bounds[rank], bounds[rank + 1]
    target = {
        "frozen": bcp.TensorShard(torch.zeros(hi - lo, 16), (ROWS, 16), (lo, 0)),
        "adapter": bcp.TensorShard(torch.zeros(hi - lo, 4), (ROWS, 4), (lo, 0)),
        "table": torch.zeros(8, 8),
        "step": 0,
    }
    got = bcp.load(target, f"{root}/step_{3:010d}")
    whole = sharded_state(0, 1, 3)
    assert torch.equal(got["frozen"].local, whole["frozen"].local[lo:hi])
    assert torch.equal(got["adapter"].local, whole["adapter"].local[lo:hi])
    assert torch.equal(got["table"], torch.ones(8, 8)) and got["step"] == 3
    dist.barrier()
