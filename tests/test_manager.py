"""CheckpointManager: retention, latest, garbage collection, async commits, restarts,
multi-process agreement; retention under hypothesis-generated histories."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import bcp
import dist_jobs
from bcp.backends import backend_for
from bcp.backends.memory import clear_memory_store
from bcp.commit import unused_generations
from bcp.discovery import scan
from bcp.metadata import MANIFEST_KEY
from bcp.metadata.keys import data_file_key, generation_name, step_name
from bcp.retention import plan_gc, select_kept
from helpers import examples


def state_for(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step)), "b": torch.arange(step % 7 + 1)}, "step": step}


def template() -> dict:
    return {"model": {"w": torch.zeros(4, 4)}, "step": 0}


def assert_loads(root: str, step: int) -> None:
    reader = bcp.open(f"{root}/{step_name(step)}")
    assert torch.equal(reader.read("model.w"), torch.full((4, 4), float(step))), f"step {step} holds wrong values"
    assert reader.read_object("step") == step


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "run")


def test_keep_last_keeps_the_newest(root):
    m = bcp.CheckpointManager(root, keep_last=2, async_save=False)
    for step in (100, 200, 300, 400):
        m.save(step, state_for(step))
    assert m.steps() == [300, 400] and m.latest() == 400
    assert_loads(root, 300)


def test_keep_every_and_keep_best_combine(root):
    m = bcp.CheckpointManager(root, keep_last=1, keep_every=30, keep_best=("loss", 2, "min"), async_save=False)
    losses = {10: 5.0, 20: 1.0, 30: 4.0, 40: 0.5, 50: 3.0, 60: 9.0, 70: 8.0}
    for step, loss in losses.items():
        m.save(step, state_for(step), metrics={"loss": loss})
    assert m.steps() == [20, 30, 40, 60, 70], "kept: best two (20, 40), multiples of 30, the newest"


def test_no_policy_keeps_everything(root):
    m = bcp.CheckpointManager(root, async_save=False)
    for step in range(1, 6):
        m.save(step, state_for(step))
    assert m.steps() == [1, 2, 3, 4, 5]


def test_async_saves_commit_in_order_and_load_latest(root):
    with bcp.CheckpointManager(root, keep_last=2) as m:
        for step in (1, 2, 3):
            m.save(step, state_for(step))
    m2 = bcp.CheckpointManager(root, keep_last=2)
    step, out = m2.load_latest(template(), strict=False)
    assert step == 3 and torch.equal(out["model"]["w"], torch.full((4, 4), 3.0)) and out["step"] == 3
    assert m2.steps() == [2, 3]
    assert backend_for(root).read("latest.json").startswith(b'{"step": 3')


def test_load_latest_without_checkpoints(root):
    step, out = bcp.CheckpointManager(root).load_latest(template())
    assert step is None and out["step"] == 0


def test_incomplete_steps_are_never_latest_and_are_collected(root):
    m = bcp.CheckpointManager(root, async_save=False)
    m.save(5, state_for(5))
    backend = backend_for(root)
    backend.write(f"{step_name(9)}/{data_file_key(generation_name('dead'), 0)}", b"partial")  # a save killed at step 9
    assert m.latest() == 5, "an incomplete step was reported as latest"
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.open(f"{root}/{step_name(9)}")
    bcp.CheckpointManager(root)  # a restart collects it
    assert 9 not in scan(backend), "the incomplete step survived a restart"
    assert_loads(root, 5)


def test_retention_deletes_manifest_first(root):
    """A deletion that stops halfway leaves an incomplete step, never a committed one with holes."""
    m = bcp.CheckpointManager(root, async_save=False)
    m.save(1, state_for(1))
    backend = backend_for(root)
    calls = []
    real_delete = type(backend).delete

    class Stop(Exception):
        pass

    def delete(self, key):
        calls.append(key)
        real_delete(self, key)
        raise Stop

    from bcp.retention import delete_step

    type(backend).delete = delete
    try:
        with pytest.raises(Stop):
            delete_step(backend, 1)
    finally:
        type(backend).delete = real_delete
    assert calls == [f"{step_name(1)}/{MANIFEST_KEY}"]
    assert m.steps() == [] and scan(backend)[1].committed is False


def test_overwrite_leftover_generations_are_collected(root):
    m = bcp.CheckpointManager(root, async_save=False)
    m.save(1, state_for(1))
    backend_for(root).write(f"{step_name(1)}/{data_file_key(generation_name('0bad'), 0)}", b"x")
    plan = plan_gc(backend_for(root))
    assert plan.orphan_generations == [f"{step_name(1)}/{generation_name('0bad')}/"]
    listed = unused_generations(backend_for(root), f"{step_name(1)}/")  # its own listing, as the CLI's
    assert listed == plan.orphan_generations, "gc and the commit protocol name the same unused generations"
    bcp.CheckpointManager(root)
    assert not any(generation_name("0bad") in k for k in backend_for(root).list(""))
    assert_loads(root, 1)


@pytest.mark.parametrize("bad", [{"keep_last": 0}, {"keep_every": 0}, {"keep_best": ("loss", 1, "median")}])
def test_bad_policies_are_refused(root, bad):
    with pytest.raises(ValueError, match=r"keep_(last|every|best) must be"):
        bcp.CheckpointManager(root, **bad)


def test_manager_on_an_object_store(moto_server):
    from conftest import new_bucket, store_uri

    uri = store_uri("moto", moto_server, new_bucket(moto_server), "run")
    m = bcp.CheckpointManager(uri, keep_last=1)
    for step in (1, 2):
        m.save(step, state_for(step))
    m.wait()
    assert m.steps() == [2]
    step, out = m.load_latest(template(), strict=False)
    assert step == 2 and out["step"] == 2


def test_two_ranks_agree_and_only_the_coordinator_deletes(tmp_path):
    dist_jobs.spawn(dist_jobs.manager_job, 2, str(tmp_path / "run"))


# -- retention under generated histories --------------------------------------------------------


class RetentionMachine(RuleBasedStateMachine):
    """Saves (sync and async), crashes mid-save, restarts. Invariants: the newest
    committed step and every step the policy keeps are loadable; latest() is never
    an uncommitted step; exactly the kept steps remain."""

    @initialize(
        keep_last=st.sampled_from([None, 1, 2, 3]),
        keep_every=st.sampled_from([None, 2, 5]),
        keep_best=st.sampled_from([None, ("loss", 1, "min"), ("loss", 2, "max")]),
        async_save=st.booleans(),
    )
    def start(self, keep_last, keep_every, keep_best, async_save):
        self.store = f"ret{uuid.uuid4().hex[:10]}"
        self.root = f"memory://{self.store}/run"
        self.policy = {"keep_last": keep_last, "keep_every": keep_every, "keep_best": keep_best}
        self.async_save = async_save
        self.manager = bcp.CheckpointManager(self.root, async_save=async_save, **self.policy)
        self.next_step = 1
        self.alive: dict[int, float] = {}  # committed steps the model expects -> loss
        self.crashed: int | None = None

    def teardown(self):
        clear_memory_store(self.store)

    @rule(gap=st.integers(1, 3), loss=st.integers(0, 20))
    def save(self, gap, loss):
        step = self.next_step
        self.next_step += gap
        self.manager.save(step, state_for(step), metrics={"loss": loss})
        self.manager.wait()
        self.alive[step] = float(loss)
        kept = select_kept(self.alive, metrics={s: {"loss": v} for s, v in self.alive.items()}, **self.policy)
        self.alive = {s: v for s, v in self.alive.items() if s in kept}

    @rule()
    def crash_mid_save(self):
        """What a killed save leaves: data objects and no manifest."""
        step = self.next_step
        backend_for(self.root).write(
            f"{step_name(step)}/{data_file_key(generation_name(uuid.uuid4().hex[:8]), 0)}", b"junk"
        )
        self.crashed = step

    @rule()
    def restart(self):
        self.manager = bcp.CheckpointManager(self.root, async_save=self.async_save, **self.policy)
        self.crashed = None
        found = scan(backend_for(self.root))
        assert all(info.committed for info in found.values()), "a restart left an incomplete step behind"

    @invariant()
    def latest_is_the_newest_committed_step(self):
        want = max(self.alive) if self.alive else None
        assert self.manager.latest() == want, f"latest() is {self.manager.latest()}, expected {want}"

    @invariant()
    def exactly_the_kept_steps_remain_and_load(self):
        assert self.manager.steps() == sorted(self.alive), (
            f"steps {self.manager.steps()} but the policy keeps {sorted(self.alive)}"
        )
        for step in self.alive:
            assert_loads(self.root, step)


RetentionMachine.TestCase.settings = settings(max_examples=examples(25), stateful_step_count=12, deadline=None)
test_retention_under_generated_histories = RetentionMachine.TestCase
