"""Multi-process jobs for tests/test_incremental_save.py (gloo, started with
dist_jobs.spawn): an incremental save on 2 ranks with a base."""

from __future__ import annotations

import torch
import torch.distributed as dist

import bcp


def two_ranks_job(rank: int, world: int, root: str) -> None:
    rows = 64  # 16 rows of 64 bytes per piece: 4 pieces per whole tensor
    shard = torch.arange(rows * 16 // world, dtype=torch.float32).reshape(-1, 16) + 1000 * rank
    state = {
        "w": torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16),  # replicated: split between ranks
        "s": bcp.TensorShard(shard, (rows, 16), (rank * rows // world, 0)),
    }
    first = bcp.save(state, f"{root}/s0", incremental=True, piece_bytes=1024)
    state["w"][20:22] += 1  # one piece of w
    if rank == 1:
        shard[0] += 1  # one piece of rank 1's shard
    second = bcp.save(state, f"{root}/s1", base=f"{root}/s0", piece_bytes=1024)
    dist.barrier()
    assert first.bytes_written == rows * 16 * 4 * 2, first
    assert second.bytes_written == 2 * 1024, second
