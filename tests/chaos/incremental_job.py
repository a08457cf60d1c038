"""An incremental checkpointing job for the crash tool ckpt-chaos (PyPI).

    python tests/chaos/incremental_job.py OUT [STEPS]

Trains a small model with a frozen layer, a table of which one row changes per step and
a trained head (AdamW) for STEPS steps, saving every step under OUT/ckpt as an
incremental checkpoint whose base is the newest committed step (``bcp.save(...,
base=)``, small pieces so most of each save refers to older steps' bytes), and keeping
the newest step only (``bcp.delete`` of the older one right after each save: the bytes
newer steps read stay, retired, by their holds; collected once no step reads them).
Each save records an XXH3-128 digest of the state it saved in its metadata.

On start it collects what deletions left (``bcp gc``'s plan and run), checks every
committed step with ``bcp.verify.verify_root`` (each fully readable: no reference to
bytes that are gone), loads the newest committed step, checks the loaded state against
the digest that step recorded, and prints "resumed from step N" ("fresh start" when
there is none); any failure raises. At the end it writes the final weights to
OUT/final.pt, which must equal an uninterrupted run's bytes for any crash point.
"""

from __future__ import annotations

import os
import sys

import torch
from incremental_manager_job import state_hash, train_step

import bcp
from bcp.backends import backend_for, join_uri
from bcp.discovery import committed_steps
from bcp.metadata.keys import step_name
from bcp.retention import plan_gc, run_gc
from bcp.verify import verify_root

KEEP = 1
PIECE_BYTES = 512


def digest(state: dict) -> str:
    """XXH3-128 of every tensor of the state, in a fixed order."""
    return state_hash(state).hexdigest()


def resume(root: str, state: dict) -> int | None:
    """Collect, verify every committed step, load the newest: its step (None: none)."""
    if not os.path.isdir(root):
        return None
    backend = backend_for(root)
    failures = run_gc(backend, plan_gc(backend, grace_seconds=0))
    if failures:
        raise RuntimeError(f"gc failed: {failures}")
    steps = committed_steps(backend)
    if not steps:
        return None
    report = verify_root(root)
    if not report["ok"]:
        raise RuntimeError(f"a committed step is damaged: {report['problems']}")
    uri = join_uri(root, step_name(steps[-1]))
    bcp.load(state, uri)
    want = bcp.open(uri).manifest.user_metadata["digest"]
    if digest(state) != want:
        raise RuntimeError(f"step {steps[-1]} loaded other bytes than it saved ({digest(state)} != {want})")
    return steps[-1]


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    root = os.path.join(out, "ckpt")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    frozen = torch.nn.Linear(16, 64).requires_grad_(False)
    head = torch.nn.Linear(64, 4)
    table = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(head.parameters(), lr=0.01)
    counter = torch.zeros(1, dtype=torch.int64)
    state = {"frozen": frozen, "head": head, "optim": opt, "table": table, "counter": counter}
    step = resume(root, state)
    print("fresh start" if step is None else f"resumed from step {step}", flush=True)
    for s in range(0 if step is None else step + 1, steps):
        train_step(state, s)
        state.pop("check")  # the manager job's own digest: this job records its own in the metadata
        backend = backend_for(root)
        kept = committed_steps(backend) if os.path.isdir(root) else []
        base = {"base": join_uri(root, step_name(kept[-1]))} if kept else {"incremental": True}
        uri = join_uri(root, step_name(s))
        bcp.save(state, uri, piece_bytes=PIECE_BYTES, metadata={"digest": digest(state)}, **base)
        for old in [*kept, s][:-KEEP]:
            bcp.delete(join_uri(root, step_name(old)))
    final = {f"head.{k}": v.clone() for k, v in head.state_dict().items()}
    torch.save(final | {"table": table.clone(), "counter": counter.clone()}, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main()
