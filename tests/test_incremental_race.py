"""Issue 39, retention by reference "safe under concurrent saves and two managers on one
root": two processes each run ``CheckpointManager(root, incremental=True, keep_last=2)``
on one root (one saves the even steps, the other the odd ones, each taking the newest
committed step of either as its base and each applying retention to both's steps), a
third runs ``bcp gc``'s plan and run, and a fourth loads every committed step over and
over, all with random pauses. During the race no committed step may fail to load or
load other values than saved (a load that fails because its step was deleted meanwhile
is not a failure); afterwards every committed step verifies (nothing it reads is gone)
and loads exactly. Jobs: tests/incremental_race_jobs.py."""

from __future__ import annotations

import pathlib

import pytest

import dist_jobs
import incremental_race_jobs as jobs
from bcp.backends import backend_for
from bcp.discovery import committed_steps
from bcp.verify import verify_root

SECONDS = 3.0  # each process's race; about 8 s a test on 2 loaded cores


def _race(tmp_path: pathlib.Path, seed: int, async_save: tuple[bool, bool]) -> tuple[list[int], int, list[str]]:
    root = str(tmp_path / "ckpt")
    ctx = dist_jobs.fork_context()
    settings = dist_jobs.parent_settings()
    outs = {name: str(tmp_path / f"{name}.out") for name in ("even", "odd", "gc", "check")}
    procs = [
        ctx.Process(target=jobs.run, args=("writer", (root, 0, SECONDS, seed, async_save[0], outs["even"]), settings)),
        ctx.Process(
            target=jobs.run, args=("writer", (root, 1, SECONDS, seed + 1, async_save[1], outs["odd"]), settings)
        ),
        ctx.Process(target=jobs.run, args=("collector", (root, SECONDS, seed + 2, outs["gc"]), settings)),
        ctx.Process(target=jobs.run, args=("checker", (root, SECONDS + 1, outs["check"]), settings)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0, 0, 0], f"a racing process failed (writer even, writer odd, gc, checker): {codes}"
    saved = [int(pathlib.Path(outs[k]).read_text()) for k in ("even", "odd")]
    checked, *problems = pathlib.Path(outs["check"]).read_text().split("\n")
    return saved, int(checked), problems


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "async_save"), [(1, (False, True)), (2, (True, True))])
def test_two_incremental_managers_gc_and_a_reader_on_one_root(tmp_path, seed, async_save):
    saved, checked, problems = _race(tmp_path, seed, async_save)
    assert min(saved) >= 2 and checked > 0, (saved, checked)  # both raced, and loads were checked during it
    assert problems == [], problems
    root = str(tmp_path / "ckpt")
    steps = committed_steps(backend_for(root))
    assert steps and len(steps) <= jobs.KEEP_LAST + 1, steps  # each manager's retention ran
    report = verify_root(root)
    assert report["ok"] and report["fragments"] > 0, report["problems"]
    for step in steps:
        assert jobs.check_step(root, step) is None


def _manager_with_step_0(tmp_path, async_save: bool):
    import bcp

    m = bcp.CheckpointManager(str(tmp_path / "ckpt"), incremental=True, async_save=async_save)
    m.save(0, jobs.state_of(0), piece_bytes=jobs.PIECE_BYTES)
    m.wait()
    return m


@pytest.mark.parametrize("async_save", [False, True])
def test_a_base_deleted_by_another_manager_before_it_is_held_is_chosen_again(tmp_path, monkeypatch, async_save):
    """Found by the race above: the manager chose its base (the newest committed step),
    another manager's retention deleted it before the save held it, and the save failed
    with CheckpointNotFoundError. It now chooses again (here: nothing left, every byte)."""
    import bcp
    import bcp.manager

    m = _manager_with_step_0(tmp_path, async_save)
    real = bcp.manager.base_step

    def vanishing(backend, step):
        base = real(backend, step)
        if base is not None:
            bcp.delete(m.uri(base))  # the other manager's retention, between the choice and the hold
        return base

    monkeypatch.setattr(bcp.manager, "base_step", vanishing)
    m.save(1, jobs.state_of(1), piece_bytes=jobs.PIECE_BYTES)
    m.close()
    assert m.steps() == [1]
    assert jobs.check_step(m.root_uri, 1) is None and verify_root(m.root_uri)["ok"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_base_deleted_after_it_is_held_still_serves_the_save(tmp_path, monkeypatch, async_save):
    """The base deleted (its manifest gone, its generation retired by this save's hold)
    after the save held it and before the save read its catalog (the early read lost):
    the save refers to the held bytes or writes every byte; either way it commits and
    loads exactly, and nothing it reads is gone."""
    import concurrent.futures

    import bcp
    import bcp.save_phases
    import bcp.saver

    m = _manager_with_step_0(tmp_path, async_save)
    real = bcp.save_phases.hold_base

    def held_then_deleted(uri, base, *args, **kwargs):
        got = real(uri, base, *args, **kwargs)
        bcp.delete(base)  # another manager's retention, right after this save held the base
        return got

    def lost(*_args, **_kwargs):
        f = concurrent.futures.Future()
        f.set_exception(OSError("the early read lost the race"))
        return f

    monkeypatch.setattr(bcp.save_phases, "hold_base", held_then_deleted)
    monkeypatch.setattr(bcp.saver, "prefetch_base", lost)
    m.save(1, jobs.state_of(1), piece_bytes=jobs.PIECE_BYTES)
    m.close()
    assert m.steps() == [1]
    assert jobs.check_step(m.root_uri, 1) is None and verify_root(m.root_uri)["ok"]
