"""An incremental CheckpointManager job for the crash tool ckpt-chaos (PyPI).

    python tests/chaos/incremental_manager_job.py OUT {sync|async} [STEPS]

Trains a small model (a frozen layer, a table of which one row changes per step, a
trained head under AdamW) for STEPS steps, saving every step through
``CheckpointManager(OUT/ckpt, incremental=True, keep_last=2)`` (sync or async saves,
512-byte pieces so each save refers to older steps' bytes for the frozen layer and the
unchanged rows of the table and writes the rest; retention deletes all but the newest
two steps, whose readers keep the older bytes they share alive). ``gc_grace_seconds=0``:
one process owns the root, so a crashed save's leftovers and holds are collected by the
resume's manager at once, which is the most that retention may delete.

Each save's state holds ``check``, the XXH3-128 of the rest of the state. On start the
manager resumes from the newest committed step; the job then checks every committed step
with ``bcp.verify.verify_root`` (each fully readable: nothing a kept step reads is gone),
loads every committed step and checks it against its ``check`` (the job raises
otherwise), and prints "resumed from step N" ("fresh start" when there is none). At the
end it writes the final weights to OUT/final.pt, which must equal an uninterrupted run's
bytes for any crash point.
"""

from __future__ import annotations

import os
import sys

import torch
import xxhash

import bcp
from bcp.verify import verify_root

PIECE_BYTES = 512


def state_hash(state: dict, skip: tuple[str, ...] = ()) -> xxhash.xxh3_128:
    """XXH3-128 over every tensor of the state (top-level keys in ``skip`` left out), in a
    fixed order (tests/chaos/incremental_job.py uses it too)."""
    h = xxhash.xxh3_128()

    def add(value: object) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                add(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    add({k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items() if k not in skip})
    return h


def digest(state: dict) -> torch.Tensor:
    """XXH3-128 of every tensor of the state but ``check``, as 16 bytes."""
    return torch.frombuffer(bytearray(state_hash(state, skip=("check",)).digest()), dtype=torch.uint8).clone()


def check_root(manager: bcp.CheckpointManager, template: dict) -> None:
    """Every committed step verifies and loads the state it saved (its ``check``)."""
    if not manager.steps():
        return  # nothing committed yet (verify_root refuses a root without a checkpoint)
    report = verify_root(manager.root_uri)
    if not report["ok"]:
        raise RuntimeError(f"a committed step is damaged: {report['problems']}")
    for step in manager.steps():
        got = bcp.load(template, manager.uri(step), process_group=bcp.LOCAL)
        if not torch.equal(digest(got), got["check"]):
            raise RuntimeError(f"step {step} loaded other bytes than it saved")


def model(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    frozen = torch.nn.Linear(16, 64).requires_grad_(False)
    head = torch.nn.Linear(64, 4)
    table = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(head.parameters(), lr=0.01)
    counter = torch.zeros(1, dtype=torch.int64)
    return {"frozen": frozen, "head": head, "optim": opt, "table": table, "counter": counter}


def train_step(state: dict, s: int) -> None:
    frozen, head, opt, table, counter = (state[k] for k in ("frozen", "head", "optim", "table", "counter"))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * s))
    loss = head(torch.tanh(frozen(x))).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    counter += 1
    table[(7 * s) % table.shape[0]] += counter.item()  # one row changes: one piece rewritten
    state["check"] = digest(state)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    torch.set_num_threads(1)
    state = model()
    state["check"] = digest(state)
    manager = bcp.CheckpointManager(
        os.path.join(out, "ckpt"), incremental=True, keep_last=2, async_save=(mode == "async"), gc_grace_seconds=0
    )
    step, state = manager.load_latest(state)
    if step is not None:
        check_root(manager, model(1) | {"check": torch.zeros(16, dtype=torch.uint8)})
        if not torch.equal(digest(state), state["check"]):
            raise RuntimeError(f"the resumed state of step {step} is not the one saved")
    print("fresh start" if step is None else f"resumed from step {step}", flush=True)
    for s in range(0 if step is None else step + 1, steps):
        train_step(state, s)
        manager.save(s, state, piece_bytes=PIECE_BYTES)
    manager.close()
    check_root(manager, model(1) | {"check": torch.zeros(16, dtype=torch.uint8)})
    head, table, counter = state["head"], state["table"], state["counter"]
    final = {f"head.{k}": v.clone() for k, v in head.state_dict().items()}
    torch.save(final | {"table": table.clone(), "counter": counter.clone()}, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main()
