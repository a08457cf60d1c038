"""What a caller hands CheckpointManager: a failed save leaves its step owed to a
preemption save, a diverging loss does not stop checkpointing, and a step that is not
an int is refused before anything is written."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

import bcp
from bcp.backends.file import FileBackend
from bcp.manager_inputs import checked_step, stored_metrics

STATE = {"w": torch.arange(64.0).reshape(8, 8)}


def _fail_next_commit(monkeypatch) -> None:
    """The next manifest write (a commit) fails once, as a dropped connection would."""
    real = FileBackend.write_if_absent

    def once(self, key, data):
        monkeypatch.setattr(FileBackend, "write_if_absent", real)
        raise OSError("connection reset (injected)")

    monkeypatch.setattr(FileBackend, "write_if_absent", once)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_preemption_after_a_failed_save_of_the_step_saves_it(tmp_path, monkeypatch, async_save):
    """save(5) fails (the caller goes on); a notice then arrives at step 5: step() saves
    step 5 and says stop, instead of taking the failed save for one already made."""
    m = bcp.CheckpointManager(tmp_path, interval=100, preemption=bcp.Preemption(), async_save=async_save)
    m.save(0, STATE)
    m.wait()
    _fail_next_commit(monkeypatch)
    with pytest.raises(Exception, match="injected"):
        m.save(5, STATE) if not async_save else (m.save(5, STATE), m.wait())  # an async one's failure: at wait()
    m.preemption.notify()
    assert m.step(5, STATE) is True
    m.close()
    assert m.steps() == [0, 5]
    assert torch.equal(bcp.open(m.uri(5)).read("w"), STATE["w"])


def test_a_preemption_after_a_failed_root_save_of_a_tiered_step_saves_it(tmp_path, monkeypatch):
    """With a local tier, a step due only for the persistent root (here 3: every=2,
    persist_every=3) whose save raised was taken for started before: the notice at step
    3 then stopped the job with nothing of step 3 saved anywhere. Now it is saved to the
    fastest tier (the local one: nothing measured) and a restart recovers it."""
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "shm"), every=2, replicas=0, persist_every=3)
    m = bcp.CheckpointManager(tmp_path / "ck", tier=tier, preemption=bcp.Preemption(), async_save=False)
    m.save(0, STATE)
    m.wait()
    _fail_next_commit(monkeypatch)
    with pytest.raises(Exception, match="injected"):
        m.save(3, STATE)
    m.preemption.notify()
    assert m.step(3, STATE) is True
    m.close()
    with bcp.CheckpointManager(tmp_path / "ck", tier=tier) as restarted:
        step, loaded = restarted.load_latest({"w": torch.zeros_like(STATE["w"])})
    assert step == 3 and torch.equal(loaded["w"], STATE["w"])


def test_a_step_that_was_saved_is_not_saved_again_on_a_notice(tmp_path):
    m = bcp.CheckpointManager(tmp_path, interval=100, preemption=bcp.Preemption(), async_save=False)
    m.save(5, STATE)
    created = bcp.open(m.uri(5)).manifest.save_id
    m.preemption.notify()
    assert m.step(5, STATE) is True
    m.close()
    assert bcp.open(m.uri(5)).manifest.save_id == created


def test_a_diverging_loss_is_stored_as_text_and_ignored_by_keep_best(tmp_path, caplog):
    """NaN and the infinities are no JSON numbers: stored as "nan"/"inf"/"-inf", the
    step saved, and keep_best ranks the steps with a finite loss (WARNING for the rest)."""
    m = bcp.CheckpointManager(tmp_path, keep_best=("loss", 1, "min"), keep_last=1, async_save=False)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        m.save(0, STATE, metrics={"loss": 0.5})
        m.save(1, STATE, metrics={"loss": float("nan"), "grad": float("-inf")})
        m.save(2, STATE, metrics={"loss": float("inf")})
        m.save(3, STATE, metrics={"loss": 2.0})
    assert m.steps() == [0, 3]  # step 0 the best finite loss, step 3 the newest
    stored = json.loads((tmp_path / "step_0000000003" / "manifest.json").read_bytes())
    assert stored["user_metadata"]["bcp_manager"]["metrics"] == {"loss": 2.0}
    text = caplog.text
    assert "metric 'loss' is nan; stored as text" in text and "metric 'grad' is -inf" in text


def test_stored_metrics_keep_numbers_and_name_what_is_not_one():
    assert stored_metrics({"a": 1, "b": np.float32(0.5), "c": torch.tensor(2.0)}, 3) == {"a": 1.0, "b": 0.5, "c": 2.0}
    assert stored_metrics({"x": float("nan")}, 3) == {"x": "nan"}
    for bad in ("0.5", True, None, [1.0], torch.ones(2)):
        with pytest.raises(TypeError, match=r"metric 'loss' of step 3 is .*, not a number"):
            stored_metrics({"loss": bad}, 3)


@pytest.mark.parametrize("step", [2.0, True, -1, "3", None, np.float64(4)])
def test_a_step_that_is_not_a_non_negative_int_is_refused_before_saving(tmp_path, step):
    m = bcp.CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(TypeError, match=r"a step is a non-negative int, not "):
        m.save(step, STATE)
    assert m.steps() == [] and not list(tmp_path.glob("step_*"))


def test_numpy_integer_steps_are_steps():
    assert checked_step(np.int64(7)) == 7 and type(checked_step(np.int32(0))) is int
