"""A training job with the local tier, for the crash tool ckpt-chaos (PyPI).

    ckpt-chaos run --ranks 2 --crash-rank R ... -- python tests/chaos/tier_job.py OUT [STEPS]

Each rank is one simulated host (docs/tiers.md): ``BCP_HOST_ID=host<RANK>`` and its
own local-tier directory ``OUT/host<RANK>``, so ckpt-chaos's ``--ranks 2`` (one
process per rank, RANK / WORLD_SIZE / MASTER_* set) runs 2 hosts, and its crash kills
one host's process (its local directory stays, as host memory outlives a process).
A small DDP model (gloo) trains STEPS steps, deterministic (each step's batch is a
function of the step and rank); every step is saved to the local tier through a
``CheckpointManager(tier=bcp.LocalTier(every=1, replicas=1, persist_every=2))``,
replicated to the other host, and every second step drained to the persistent root
``OUT/ckpt`` (no retention there, so every drained step stays to be judged). On
start it resumes with ``load_latest`` (the local tier, or the persistent one when it
is newer) and prints "resumed from step N" ("fresh start" when there is none); at
the end rank 0 writes the final weights to OUT/final.pt, which must equal an
uninterrupted run's bytes for any crash point.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import bcp


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ["BCP_HOST_ID"] = f"host{rank}"
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = torch.zeros(1, dtype=torch.int64)  # steps taken: a lost or doubled step shows in the weights
    tier = bcp.LocalTier(dir=os.path.join(out, f"host{rank}"), every=1, replicas=1, persist_every=2, chunk_bytes=4096)
    manager = bcp.CheckpointManager(os.path.join(out, "ckpt"), tier=tier)
    state = {"model": model, "optim": opt, "counter": counter}
    step, state = manager.load_latest(state)
    drained = manager.latest()
    print("fresh start" if step is None else f"resumed from step {step} (newest drained step {drained})", flush=True)
    start = 0 if step is None else step + 1
    for s in range(start, steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * s + rank))
        loss = wrapped(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        counter += 1
        with torch.no_grad():
            model[0].bias += counter.item()  # a step applied twice or lost moves this by 1.0
        manager.save(s, state)
    manager.close()
    if rank == 0:
        final = {k: v.clone() for k, v in model.state_dict().items()} | {"counter": counter.clone()}
        torch.save(final, os.path.join(out, "final.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
