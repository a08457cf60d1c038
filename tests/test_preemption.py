"""Issue 40 (40a): ``CheckpointManager.step`` and preemption. A notice (a signal) that
reaches one rank, every rank at different steps, a rank inside a save, a load or a
collective, is honoured by every rank at the same step: that step is committed and the
newest, and the job stops cleanly (tests/preemption_jobs.py, 2-3 gloo ranks). A deadline
no tier can meet leaves the previous checkpoint the newest, with a WARNING."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
import uuid
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
import dist_jobs
import preemption_jobs
from bcp.backends import register_backend
from bcp.backends.memory import MemoryBackend
from bcp.metadata.keys import step_name
from bcp.schedule.preemption import Verdict, Watch, choose_tier


@pytest.mark.parametrize(
    ("scenario", "world", "expected"),
    [
        ("one", 3, 3),  # the last rank only, at step 3
        ("all", 3, 2),  # rank r at step 2 + r (rank 0 twice): the first one counts
        ("collective", 2, 3),  # inside a barrier, before step 3
        ("save", 2, 5),  # inside the save of step 4 (async, still in flight): honoured at step 5
    ],
)
def test_a_notice_is_honoured_by_every_rank_at_one_step(scenario, world, expected, tmp_path):
    dist_jobs.spawn(preemption_jobs.preempt_job, world, str(tmp_path / "ck"), scenario, expected)


def test_a_notice_inside_load_latest_is_honoured_at_the_first_step(tmp_path):
    root = str(tmp_path / "ck")
    dist_jobs.spawn(preemption_jobs.seed_job, 2, root, 5)  # steps 0, 2, 4
    dist_jobs.spawn(preemption_jobs.preempt_job, 2, root, "load", 5)  # resumed at 4, stops at 5


def test_a_deadline_no_tier_meets_keeps_the_previous_checkpoint_newest(tmp_path):
    dist_jobs.spawn(preemption_jobs.deadline_job, 2, str(tmp_path / "ck"))


def test_the_deadline_warning_names_the_deadline_and_the_expected_time(tmp_path, caplog):
    manager = bcp.CheckpointManager(tmp_path / "ck", preemption=bcp.Preemption(grace_seconds=5.0), async_save=False)
    state = {"w": torch.ones(4)}
    manager.save(0, state)
    manager.save_seconds["persistent"] = 60.0  # as if the root were slow
    manager.preemption.notify()
    with caplog.at_level(logging.WARNING, logger="bcp.manager"):
        assert manager.step(1, state)
    manager.close()
    assert manager.steps() == [0]
    text = caplog.text
    assert "step 1 is not saved" in text and "60.0 s" in text and "grace_seconds=5" in text, text


def test_without_a_notice_step_saves_every_interval_and_never_stops(tmp_path):
    with bcp.CheckpointManager(tmp_path / "ck", interval=3, preemption=bcp.Preemption()) as manager:
        assert not any(manager.step(s, {"w": torch.full((2,), float(s))}) for s in range(8))
    assert manager.steps() == [0, 3, 6]
    with bcp.CheckpointManager(tmp_path / "none") as manager:  # interval=None, no preemption: never saves
        assert not any(manager.step(s, {"w": torch.zeros(1)}) for s in range(4))
    assert manager.steps() == []


def test_the_handler_chains_to_the_previous_python_handler_and_is_put_back(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        manager = bcp.CheckpointManager(tmp_path / "ck", preemption=bcp.Preemption(signals=(signal.SIGUSR1,)))
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2  # chained, each time
        assert manager.preemption.notice.signum == signal.SIGUSR1 and manager.preemption.repeats == 1
        assert manager.step(7, {"w": torch.zeros(1)})
        manager.close()
        assert manager.steps() == [7]
        os.kill(os.getpid(), signal.SIGUSR1)  # ours is gone: only the previous handler runs
        assert seen == [signal.SIGUSR1] * 3
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_during_closes_final_commit_is_a_notice_and_the_handler_goes_back_after(tmp_path):
    """Failed before: close() put the previous handler back before waiting for the async
    save in flight, so a SIGTERM during that commit took the default action (the process
    died mid-commit; seen as ckpt-chaos "term" runs ending with rc -15)."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        manager = bcp.CheckpointManager(
            tmp_path / "ck", async_save=True, preemption=bcp.Preemption(signals=(signal.SIGUSR1,))
        )
        manager.save(0, {"w": torch.zeros(4)})
        real_wait = manager.wait

        def wait_after_a_signal():
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives while the commit is finished
            return real_wait()

        manager.wait = wait_after_a_signal  # type: ignore[method-assign]
        manager.close()
        assert manager.preemption.notice is not None and manager.preemption.notice.signum == signal.SIGUSR1
        assert seen == [signal.SIGUSR1] and manager.steps() == [0]
        os.kill(os.getpid(), signal.SIGUSR1)  # after close: only the previous handler
        assert seen == [signal.SIGUSR1] * 2 and manager.preemption.repeats == 0
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"interval": 0}, ValueError),
        ({"interval": True}, ValueError),
        ({"interval": 5, "tier": bcp.LocalTier(dir="x")}, ValueError),
        ({"preemption": "yes"}, TypeError),
    ],
)
def test_bad_step_settings_are_refused(kwargs, error, tmp_path):
    with pytest.raises(error):
        bcp.CheckpointManager(tmp_path / "ck", **kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"signals": (signal.SIGKILL,)}, {"signals": signal.SIGTERM}, {"grace_seconds": 0}, {"grace_seconds": -1}]
)
def test_bad_preemption_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="Preemption"):
        bcp.Preemption(**kwargs)


maybe_seconds = st.none() | st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(local=maybe_seconds, persistent=maybe_seconds, remaining=maybe_seconds, has_local=st.booleans())
def test_the_chosen_tier_is_the_fastest_that_fits_the_deadline(local, persistent, remaining, has_local):
    verdict = Verdict(stop=True, remaining=remaining, estimates={"local": local, "persistent": persistent})
    tier, expected = choose_tier(verdict, has_local)
    options = {"local": local, "persistent": persistent} if has_local else {"persistent": persistent}
    fits = {t: e for t, e in options.items() if remaining is None or e is None or e <= remaining}
    if not fits:
        assert tier is None and expected == min(e for e in options.values() if e is not None)
        return
    assert tier in fits and expected == options[tier]
    measured = {t: e for t, e in fits.items() if e is not None}
    if has_local and local is None:
        assert tier == "local"  # not measured: memory counts as the fastest
    elif measured:  # a measured tier that fits beats a root not measured yet
        assert options[tier] == min(measured.values())
    else:
        assert tier == "persistent" and persistent is None


def test_the_agreement_without_a_group_is_this_ranks_own():
    from bcp.coordination.collectives import Coordinator
    from bcp.schedule.preemption import Agreement

    watch = Watch(bcp.Preemption(grace_seconds=30))
    agreement = Agreement(Coordinator())
    assert not agreement.exchange(watch, {"local": None, "persistent": 2.0}).stop
    watch.notify()
    verdict = agreement.exchange(watch, {"local": None, "persistent": 2.0})
    assert verdict.stop and 29 < verdict.remaining <= 30 and verdict.estimates == {"local": None, "persistent": 2.0}
    assert not math.isinf(verdict.remaining)


@pytest.mark.parametrize("async_save", [True, False])
def test_with_a_local_tier_the_notice_step_is_saved_locally_off_its_schedule(tmp_path, async_save):
    """Nothing measured yet: the local tier is the fastest; step 3 is not a multiple of
    ``every`` (5) yet is saved there, and a new manager recovers it. A synchronous
    manager used to take its local save, already waited for, as one no host had room
    for, and save step 3 to the root too (or warn that it was not saved)."""
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "local"), every=5, replicas=0, persist_every=None)
    state = {"w": torch.zeros(4)}
    preemption = bcp.Preemption()
    with bcp.CheckpointManager(tmp_path / "ck", tier=tier, preemption=preemption, async_save=async_save) as manager:
        for s in range(10):
            state["w"].fill_(float(s))
            if s == 3:
                manager.preemption.notify()
            if manager.step(s, state):
                break
    assert s == 3 and manager.steps() == []  # nothing in the root: the notice's save went to memory
    assert manager.save_seconds["local"] is not None  # measured for the next choice
    with bcp.CheckpointManager(tmp_path / "ck", tier=tier) as again:
        step, out = again.load_latest({"w": torch.zeros(4)})
    assert step == 3 and torch.equal(out["w"], torch.full((4,), 3.0))


class _Flaky(MemoryBackend):
    """Memory storage where each data file of a step named in ``FAILING`` fails once, or
    takes ``DELAY`` seconds to write."""

    scheme = "flakymem"
    FAILING: ClassVar[set[int]] = set()
    DELAY = 0.0

    def open_writer(self, key, *, size=None):
        if "/data/" in key:
            time.sleep(self.DELAY)
            failing = [s for s in self.FAILING if step_name(s) in f"{self.uri}/{key}"]
            if failing:
                self.FAILING.discard(failing[0])
                raise PermissionError(f"injected: cannot write {key}")
        return super().open_writer(key, size=size)

    @classmethod
    def from_uri(cls, uri, **options):
        return super().from_uri(uri.replace("flakymem://", "memory://", 1), **options)


@pytest.fixture
def flaky():
    register_backend("flakymem", _Flaky, clobber=True)
    yield _Flaky
    _Flaky.FAILING.clear()
    _Flaky.DELAY = 0.0


@pytest.mark.parametrize("same_step", [True, False])
def test_a_failed_save_in_flight_leaves_the_notices_save_owed(flaky, same_step):
    """An async save in flight fails when the notice's step waits for it: step() raises
    that error, and the next call saves the step (it used to return True with nothing
    saved, at every call after)."""
    manager = bcp.CheckpointManager(f"flakymem://r{uuid.uuid4().hex[:8]}", interval=2, preemption=bcp.Preemption())
    state = {"w": torch.zeros(4)}
    assert not any(manager.step(s, state) for s in range(4))
    manager.wait()
    flaky.FAILING.add(4)
    if same_step:
        manager.save(4, state)  # in flight, fails
        at = 4
    else:
        assert not manager.step(4, state)  # the regular save of step 4, in flight, fails
        at = 5
    manager.preemption.notify()
    with pytest.raises(PermissionError, match="injected"):
        manager.step(at, state)
    assert manager.step(at, state) and manager.step(at + 1, state)
    manager.close()
    assert manager.steps() == [0, 2, at]


def test_the_deadline_counts_the_save_in_flight_first(flaky, caplog):
    """Saves take about 0.6 s, the grace 1 s, and step 2's async save is in flight at the
    notice: once it has committed (0.6 s) too little is left for step 3's, which is not
    saved (WARNING); it used to start it anyway, committing after the deadline."""
    flaky.DELAY = 0.6
    manager = bcp.CheckpointManager(
        f"flakymem://r{uuid.uuid4().hex[:8]}", interval=2, preemption=bcp.Preemption(grace_seconds=1.0)
    )
    state = {"w": torch.zeros(4)}
    assert not manager.step(0, state)
    manager.wait()  # measured: a save takes about 0.6 s
    assert not manager.step(1, state) and not manager.step(2, state)  # step 2 in flight
    manager.preemption.notify()
    with caplog.at_level(logging.WARNING, logger="bcp.manager"):
        assert manager.step(3, state)
    manager.close()
    assert manager.steps() == [0, 2]
    assert "step 3 is not saved" in caplog.text, caplog.text


def test_managers_closed_in_any_order_put_back_the_handler_found_before_the_first(tmp_path):
    """Two managers catching SIGUSR1, closed first to last: the handler before both is
    back, and the closed first one records nothing (it used to stay installed through
    the second, swallowing the signal for good)."""
    seen = []
    original = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        before = signal.getsignal(signal.SIGUSR1)
        config = bcp.Preemption(signals=(signal.SIGUSR1,))
        first = bcp.CheckpointManager(tmp_path / "a", preemption=config)
        second = bcp.CheckpointManager(tmp_path / "b", preemption=config)
        first.close()
        os.kill(os.getpid(), signal.SIGUSR1)  # the second is still installed: it records, the first passes it on
        assert second.preemption.notice is not None and first.preemption.notice is None and seen == [signal.SIGUSR1]
        second.close()
        assert signal.getsignal(signal.SIGUSR1) is before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2 and second.preemption.repeats == 0
    finally:
        signal.signal(signal.SIGUSR1, original)
