"""A CheckpointManager training job for the crash tool ckpt-chaos (PyPI).

    python tests/chaos/manager_job.py OUT {sync|async} [STEPS]

Trains a small model for STEPS steps (deterministic: each step's batch is a function
of the step and rank), saving every step through a CheckpointManager under OUT/ckpt
(sync or async saves, no retention, so every committed step stays to be judged).
On start it resumes from the newest committed step and prints "resumed from step N"
("fresh start" when there is none); at the end it writes the final weights to OUT/final.pt,
which must equal an uninterrupted run's bytes for any crash point. Run on several
ranks by ckpt-chaos --ranks N (RANK, WORLD_SIZE, MASTER_* set, gloo, DDP).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import bcp


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    train(out, steps, lambda: bcp.CheckpointManager(os.path.join(out, "ckpt"), async_save=(mode == "async")))


def train(
    out: str,
    steps: int,
    make_manager: Callable[[], bcp.CheckpointManager],
    on_resume: Callable[[bcp.CheckpointManager], str] = lambda _manager: "",
    save_step: Callable[[bcp.CheckpointManager, int, dict], bool] | None = None,
) -> None:
    """Train ``steps`` steps on RANK of WORLD_SIZE, saving each through the manager
    ``make_manager`` builds once the process group is up; resume first, print the
    resumed step (and what ``on_resume`` says of the manager), write OUT/final.pt.
    ``save_step(manager, step, state)`` instead of ``manager.save``: True stops the job
    (printing "stopped at step N", no final.pt: the resume writes it)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = torch.zeros(1, dtype=torch.int64)  # steps taken: a lost or doubled step shows in the weights
    manager = make_manager()
    state = {"model": model, "optim": opt, "counter": counter}
    step, state = manager.load_latest(state)
    extra = on_resume(manager)
    print("fresh start" if step is None else f"resumed from step {step}{extra}", flush=True)
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
        if save_step is None:
            manager.save(s, state)
        elif save_step(manager, s, state):
            print(f"stopped at step {s}", flush=True)
            break
    else:
        s = steps
    manager.close()
    if rank == 0 and s == steps:
        final = {k: v.clone() for k, v in model.state_dict().items()} | {"counter": counter.clone()}
        torch.save(final, os.path.join(out, "final.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
