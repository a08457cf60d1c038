"""Processes for tests/test_incremental_race.py: two incremental CheckpointManagers on
one root, a garbage collector and a checker, racing (started from the fork server of
tests/dist_jobs.py; no process group: each is a job of its own).

The state saved as step ``s`` is a function of ``s`` alone (:func:`state_of`), so any
process can tell whether a step loads what was saved: a frozen tensor (every piece
reused), a table of which one row differs per step (most pieces reused), a head that
changes every step (rewritten), and the step itself.
"""

from __future__ import annotations

import os
import random
import time

import torch

import bcp
from bcp.backends import backend_for
from bcp.commit import read_manifest
from bcp.discovery import committed_steps
from bcp.metadata.keys import step_name

PIECE_BYTES = 256  # 4 rows of the table
KEEP_LAST = 2


def state_of(step: int) -> dict:
    table = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    table[(7 * step) % 64] += step + 1
    return {
        "frozen": torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16),
        "table": table,
        "head": torch.randn(4, 64, generator=torch.Generator().manual_seed(100 + step)),
        "step": step,
    }


def template() -> dict:
    return {"frozen": torch.zeros(64, 16), "table": torch.zeros(64, 16), "head": torch.zeros(4, 64), "step": -1}


def same(got: dict, step: int) -> bool:
    want = state_of(step)
    return got["step"] == step and all(torch.equal(got[k], want[k]) for k in ("frozen", "table", "head"))


def _save_id(root: str, step: int) -> str | None:
    m = read_manifest(backend_for(root), f"{step_name(step)}/")
    return None if m is None else m.save_id


def check_step(root: str, step: int) -> str | None:
    """Load ``step``: None when it loads exactly, or was deleted meanwhile (its manifest
    gone or replaced); else what went wrong, in one line."""
    try:
        before = _save_id(root, step)
    except Exception:  # noqa: BLE001 - deleted while being read
        return None
    if before is None:
        return None
    try:
        got = bcp.load(template(), f"{root}/{step_name(step)}")
        if same(got, step):
            return None
        problem = f"step {step} loaded other values than saved"
    except Exception as e:  # noqa: BLE001 - judged below: a load fails only when the step went
        problem = f"step {step} failed to load: {type(e).__name__}: {e}"
    try:
        after = _save_id(root, step)
    except Exception:  # noqa: BLE001
        return None
    return problem if after == before else None


def writer(root: str, first: int, seconds: float, seed: int, async_save: bool, out: str) -> None:
    """Save steps first, first+2, ... through an incremental manager (keep_last=2) for
    ``seconds``, random pauses between saves; write how many it saved to ``out``."""
    rng = random.Random(seed)
    torch.set_num_threads(1)
    manager = bcp.CheckpointManager(root, incremental=True, keep_last=KEEP_LAST, async_save=async_save)
    deadline = time.monotonic() + seconds
    step, saved = first, 0
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0, 0.05))
        manager.save(step, state_of(step), piece_bytes=PIECE_BYTES)
        step, saved = step + 2, saved + 1
    manager.close()
    with open(out, "w") as f:
        f.write(str(saved))


def collector(root: str, seconds: float, seed: int, out: str) -> None:
    """``bcp gc``'s plan and run (default grace period), at random moments, for ``seconds``."""
    from bcp.retention import plan_gc, run_gc

    rng = random.Random(seed)
    backend = backend_for(root)
    deadline = time.monotonic() + seconds
    runs = 0
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0, 0.05))
        failures = run_gc(backend, plan_gc(backend))
        if failures:
            raise AssertionError(f"gc failed: {failures}")
        runs += 1
    with open(out, "w") as f:
        f.write(str(runs))


def checker(root: str, seconds: float, out: str) -> None:
    """Load every committed step over and over for ``seconds``; write the problems (one a
    line) and how many loads were checked to ``out``."""
    torch.set_num_threads(1)
    deadline = time.monotonic() + seconds
    problems: list[str] = []
    checked = 0
    while time.monotonic() < deadline:
        try:
            steps = committed_steps(backend_for(root)) if os.path.isdir(root) else []
        except Exception:  # noqa: BLE001 - a listing racing a deletion: list again
            continue
        for step in reversed(steps):
            if (problem := check_step(root, step)) is not None:
                problems.append(problem)
            checked += 1
        if not steps:
            time.sleep(0.01)
    with open(out, "w") as f:
        f.write("\n".join([str(checked), *problems]))


def run(job_name: str, args: tuple, settings: tuple[dict[str, str], int]) -> None:
    """A process's entry: the test's environment, then the job (a failure exits non-zero, traceback on stderr)."""
    import dist_jobs

    dist_jobs.adopt(settings)
    globals()[job_name](*args)
