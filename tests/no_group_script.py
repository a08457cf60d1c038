"""A script that forgets ``torch.distributed.init_process_group``, run by
tests/test_launch_without_group.py under torchrun (2 processes): every collective
call of bcp is refused on every rank, and ``process_group=bcp.LOCAL`` still saves
and loads from one process alone.

Usage: python -m torch.distributed.run --nproc_per_node 2 no_group_script.py ROOT
Prints one JSON line per rank: call -> the error's type and message (or "ok").
"""

from __future__ import annotations

import json
import os
import sys

import torch

import bcp


def main() -> None:
    root = sys.argv[1]
    rank = os.environ["RANK"]
    state = {"w": torch.arange(16, dtype=torch.float32), "step": 3}
    calls = {
        "save": lambda: bcp.save(state, f"{root}/shared"),
        "async_save": lambda: bcp.async_save(state, f"{root}/shared").wait(),
        "load": lambda: bcp.load({"w": torch.zeros(16)}, f"{root}/shared"),
        "manager": lambda: bcp.CheckpointManager(f"{root}/managed"),
    }
    out: dict[str, object] = {"rank": rank}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            out[name] = [type(e).__name__, str(e)]
    alone = f"{root}/rank{rank}"
    bcp.save(state, alone, process_group=bcp.LOCAL)
    back = bcp.load({"w": torch.zeros(16), "step": 0}, alone, process_group=bcp.LOCAL)
    out["local"] = bool(torch.equal(back["w"], state["w"]) and back["step"] == 3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
