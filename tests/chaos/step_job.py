"""tests/chaos/manager_job.py's training, saved through ``CheckpointManager.step`` with
preemption on (every 2 steps, and at a notice): for ckpt-chaos's "term" mode, whose
SIGTERM arrives at one of the job's file events (inside a save) and is followed by a kill
after the grace period. The job saves the next step, prints "stopped at step N" and
exits 0; the resume must go on from there and end with the uninterrupted run's weights.

    python tests/chaos/step_job.py OUT {sync|async} [STEPS]
"""

from __future__ import annotations

import os
import sys

import bcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from manager_job import train  # the same training loop, saved by step()


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    train(
        out,
        steps,
        lambda: bcp.CheckpointManager(
            os.path.join(out, "ckpt"), async_save=(mode == "async"), interval=2, preemption=bcp.Preemption()
        ),
        save_step=lambda manager, step, state: manager.step(step, state),
    )


if __name__ == "__main__":
    main()
