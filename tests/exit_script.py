"""A training script's last lines, run as a real process per rank by
tests/test_exit_and_subset.py: an async save, then the end of the script (or a
``dist.destroy_process_group()``) without ``wait()``.

Usage: RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python exit_script.py URI MODE
MODE: ``end`` (the script just ends), ``manager`` (CheckpointManager.save, then the
end), ``destroy`` (destroy_process_group, then the end), ``destroy_wait``
(destroy_process_group, then wait()).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import bcp
import bcp.save_phases

ROWS = 1 << 18  # 1 MiB of float32 per row of 4


def state(rank: int, world: int) -> dict:
    local = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + rank * ROWS * 4
    return {"w": bcp.TensorShard(local, (ROWS * world, 4), (ROWS * rank, 0)), "step": 7}


def main() -> None:
    uri, mode = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    real_commit = bcp.save_phases.SaveJob.commit_checkpoint

    entered = os.path.join(os.path.dirname(uri), f"commit-entered-{os.path.basename(uri)}")

    def slow_commit(self, reports):
        open(entered, "w").close()  # every rank's writes are done: "destroy_late" destroys now
        time.sleep(1.0)  # the save is surely still in flight when the script ends
        return real_commit(self, reports)

    bcp.save_phases.SaveJob.commit_checkpoint = slow_commit  # type: ignore[method-assign]
    if mode == "manager":
        bcp.CheckpointManager(uri).save(7, state(rank, world))
        print(f"rank {rank}: script done", flush=True)
        return
    if mode.endswith("_nostore"):  # as after init_method="tcp://...": bcp cannot build a group of its own
        del os.environ["MASTER_ADDR"]
        mode = mode.removesuffix("_nostore")
    handle = bcp.async_save(state(rank, world), uri)
    if mode.startswith("destroy"):
        if mode == "destroy_late":  # once the coordinator is in the commit (not after a fixed time: under load the
            deadline = time.monotonic() + 30  # writes were not done and the save was, rightly, not committed)
            while not os.path.exists(entered) and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.destroy_process_group()
        print(f"rank {rank}: destroyed, save done={handle.done()}", flush=True)
    if mode in ("destroy_wait", "destroy_late"):
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - the test reads what was printed
            print(f"rank {rank}: wait raised {type(e).__name__}: {e} {getattr(e, '__notes__', [])}", flush=True)
        else:
            print(f"rank {rank}: wait returned", flush=True)
    print(f"rank {rank}: script done, save done={handle.done()}", flush=True)


if __name__ == "__main__":
    main()
