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

import bcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from manager_job import train  # the same training loop, with the local tier


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    rank = int(os.environ.get("RANK", 0))
    os.environ["BCP_HOST_ID"] = f"host{rank}"

    def make_manager() -> bcp.CheckpointManager:
        tier = bcp.LocalTier(
            dir=os.path.join(out, f"host{rank}"), every=1, replicas=1, persist_every=2, chunk_bytes=4096, keep_free=0.0
        )
        return bcp.CheckpointManager(os.path.join(out, "ckpt"), tier=tier)

    train(out, steps, make_manager, on_resume=lambda m: f" (newest drained step {m.latest()})")


if __name__ == "__main__":
    main()
