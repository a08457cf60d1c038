"""Multi-process jobs for tests/test_preemption.py (gloo on CPU, started from the fork
server by dist_jobs.spawn). A preemption notice (a real signal, sent with os.kill) reaches
some ranks at some moment of a training loop that calls ``CheckpointManager.step``; every
job asserts that step() returned True on every rank at the same step, that this step is
committed and the newest, and that it holds that step's state."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import bcp


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Tripwire:
    """A Stateful object that sends ``signum`` to this process when saved at step
    ``save_at`` or loaded with ``load=True``: a notice that arrives inside a save or a load."""

    def __init__(self, signum: int, save_at: int | None = None, load: bool = False) -> None:
        self.signum, self.save_at, self.load, self.step = signum, save_at, load, -1

    def state_dict(self) -> dict:
        if self.step == self.save_at:
            os.kill(os.getpid(), self.signum)
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        if self.load:
            os.kill(os.getpid(), self.signum)


def _state(rank: int, trip: Tripwire) -> dict:
    return {"w": torch.zeros(8), "trip": trip, "rank": bcp.PerRank(rank)}


def _train(rank: int, manager: bcp.CheckpointManager, state: dict, start: int, scenario: str) -> int | None:
    """Steps from ``start`` until step() says stop; the notices of ``scenario``. The step it stopped at."""
    world = dist.get_world_size()
    pids = gather(os.getpid())
    for s in range(start, start + 12):
        state["w"].fill_(float(s))
        state["trip"].step = s
        if scenario == "one" and rank == world - 1 and s == start + 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # the last rank only
        if scenario == "all" and s == start + 2 + rank:
            os.kill(os.getpid(), signal.SIGTERM)  # every rank, one step apart
            if rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # and a second signal: only recorded
        if scenario == "collective" and s == start + 3:
            # rank 0 signals the last rank while that one sits in a barrier waiting for rank 0
            if rank == 0:
                time.sleep(0.3)
                os.kill(pids[-1], signal.SIGUSR1)
            dist.barrier()
        if manager.step(s, state):
            return s
    return None


def preempt_job(rank: int, world: int, root: str, scenario: str, expected: int) -> None:
    """``scenario``: "one" (a signal to the last rank only), "all" (each rank its own
    step, rank 0 two signals), "collective" (a signal inside a barrier), "save" (inside
    the save of step ``expected - 1``: honoured at the next step), "load" (inside
    load_latest: honoured at the first step after it)."""
    trip = Tripwire(signal.SIGUSR1, save_at=expected - 1 if scenario == "save" and rank == 0 else None)
    trip.load = scenario == "load" and rank == world - 1
    manager = bcp.CheckpointManager(root, preemption=bcp.Preemption(), interval=2, async_save=True)
    start, state = manager.load_latest(_state(rank, trip))
    start = 0 if start is None else start + 1
    stopped = _train(rank, manager, state, start, scenario)
    assert manager.step(stopped + 1 if stopped is not None else 0, state), "step() must keep saying stop"
    manager.close()
    everyone = gather(stopped)
    assert everyone == [expected] * world, f"{scenario}: step() returned True at steps {everyone}, not {expected}"
    assert manager.latest() == expected, f"{scenario}: newest committed {manager.latest()} != {expected}"
    assert expected in manager.steps()
    loaded = bcp.load({"w": torch.zeros(8), "trip": {"step": torch.tensor(0)}}, manager.uri(expected), strict=False)
    assert torch.equal(loaded["w"], torch.full((8,), float(expected))) and int(loaded["trip"]["step"]) == expected


def seed_job(rank: int, world: int, root: str, steps: int) -> None:
    """A first run of ``steps`` steps without notices (interval 2): what the "load" scenario resumes."""
    manager = bcp.CheckpointManager(root, interval=2, async_save=False)
    state = _state(rank, Tripwire(signal.SIGUSR1))
    for s in range(steps):
        state["w"].fill_(float(s))
        state["trip"].step = s
        assert not manager.step(s, state)
    manager.close()


def deadline_job(rank: int, world: int, root: str) -> None:
    """A deadline no tier can meet (grace_seconds shorter than the measured save): step()
    still says stop on every rank, nothing is saved, the previous checkpoint stays the newest."""
    manager = bcp.CheckpointManager(root, preemption=bcp.Preemption(grace_seconds=1e-6), interval=2, async_save=False)
    state = _state(rank, Tripwire(signal.SIGUSR1))
    assert not manager.step(0, state)  # saved and measured
    assert manager.save_seconds["persistent"] is not None
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the deadline passes
    assert manager.step(1, state)
    manager.close()
    assert manager.steps() == [0] and manager.latest() == 0
