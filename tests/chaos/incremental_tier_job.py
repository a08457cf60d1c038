"""An incremental local-tier job for the crash tool ckpt-chaos (PyPI): the drains of
incremental local steps, killed at their file events.

    ckpt-chaos run --ranks 2 --crash-rank R ... -- python tests/chaos/incremental_tier_job.py OUT [STEPS]

Each rank is one simulated host (``BCP_HOST_ID=host<RANK>``, local directory
``OUT/host<RANK>``; tests/chaos/tier_job.py has the set-up). Both train the state of
tests/chaos/incremental_manager_job.py (a frozen layer, a table of which one row
changes per step, a head under AdamW: the same values on both ranks, saved once), every
step saved to ``LocalTier(incremental=True, every=1, replicas=1, persist_every=2,
keep=2)`` through ``CheckpointManager(OUT/ckpt, incremental=True, keep_last=2)``, so
every second step is drained to OUT/ckpt as an incremental step: it refers to the
bytes of older local steps, which the drain holds in the persistent root and uploads
there under those steps' names when the root lacks them (the odd steps are never
drained themselves). On start the job resumes with ``load_latest`` (the local tier or
the root); it then checks that every committed step of the root verifies
(``verify_root``: no step refers to bytes that are gone) and loads each against its
digest (the job raises otherwise), and prints "resumed from step N". At the end rank 0
writes the final weights to OUT/final.pt, which must equal an uninterrupted run's
bytes for any crash point.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import bcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from incremental_manager_job import PIECE_BYTES, check_root, digest, model, train_step


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ["BCP_HOST_ID"] = f"host{rank}"
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    tier = bcp.LocalTier(
        dir=os.path.join(out, f"host{rank}"),
        every=1,
        replicas=1,
        persist_every=2,
        keep=2,
        incremental=True,
        keep_free=0.0,
    )
    manager = bcp.CheckpointManager(os.path.join(out, "ckpt"), tier=tier, incremental=True, keep_last=2)
    state = model()
    state["check"] = digest(state)
    step, state = manager.load_latest(state)
    blank = model(1) | {"check": torch.zeros(16, dtype=torch.uint8)}
    if step is not None:
        if not torch.equal(digest(state), state["check"]):
            raise RuntimeError(f"the resumed state of step {step} is not the one saved")
        if rank == 0 and os.path.isdir(manager.root_uri):
            check_root(manager, blank)
    print("fresh start" if step is None else f"resumed from step {step}", flush=True)
    for s in range(0 if step is None else step + 1, steps):
        train_step(state, s)
        manager.save(s, state, piece_bytes=PIECE_BYTES)
    manager.close()
    if rank == 0:
        check_root(manager, blank)
        head, table, counter = state["head"], state["table"], state["counter"]
        final = {f"head.{k}": v.clone() for k, v in head.state_dict().items()}
        torch.save(final | {"table": table.clone(), "counter": counter.clone()}, os.path.join(out, "final.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
