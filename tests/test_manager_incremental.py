"""CheckpointManager(incremental=True): each save refers to the newest committed step
for the pieces whose bytes did not change; retention keeps referenced bytes (retired)
and collects them once no kept step refers to them (docs/manager.md, "Incremental
checkpoints")."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import dist_jobs
from bcp.metadata.keys import step_name
from bcp.planning.cache import clear_plan_caches
from bcp.target import resolve_backend
from bcp.verify import verify_checkpoint
from conftest import new_bucket, store_uri
from helpers import flip_bit

FROZEN = (256, 256)  # float32: 256 KiB, never changes
SLOW = (64, 64)  # 16 KiB, changes at steps 0, 3, 6
ADAPTER = (16, 16)  # 1 KiB, changes every step


def state_at(step: int) -> dict:
    """The state as training holds it at ``step``: mostly frozen."""
    g = torch.Generator().manual_seed(0)
    return {
        "frozen": torch.randn(FROZEN, generator=g),
        "slow": torch.full(SLOW, float(step // 3 * 3)),
        "adapter": torch.full(ADAPTER, float(step)) + torch.arange(16.0),
        "step": step,
    }


def nbytes(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1] * 4


def own_data(root: str, step: int) -> list[str]:
    """The data files stored under the step's own directory (any generation)."""
    backend = resolve_backend(root)
    return [k for k in backend.list(f"{step_name(step)}/") if "/data/" in k]


def run_ten_saves(root: str, async_save: bool) -> None:
    written: list[int] = []
    saved = {}
    with bcp.CheckpointManager(
        root, keep_last=3, incremental=True, async_save=async_save, metrics=lambda r: written.append(r.bytes)
    ) as m:
        for step in range(10):
            state = state_at(step)
            saved[step] = copy.deepcopy(state)
            m.save(step, state)
            del state  # the manager took the values at the call
    assert m.steps() == [7, 8, 9]
    # bytes written: all of it once, then the adapter, and the slow tensor when it changed
    # (the first data file also holds alignment padding between tensors)
    full = nbytes(FROZEN) + nbytes(SLOW) + nbytes(ADAPTER)
    assert full <= written[0] < full + (16 << 10), written
    assert written[1:] == [nbytes(ADAPTER) + (nbytes(SLOW) if s % 3 == 0 else 0) for s in range(1, 10)]
    for step in m.steps():  # every kept step loads bit-exactly
        got = bcp.load(state_at(0), m.uri(step))
        for k in ("frozen", "slow", "adapter"):
            assert torch.equal(got[k], saved[step][k]), (step, k)
            assert got[k].numpy().tobytes() == saved[step][k].numpy().tobytes()
        assert got["step"] == step
        assert verify_checkpoint(m.uri(step))["ok"], step
    # step 0 holds the frozen bytes and step 6 the slow ones that 7, 8, 9 use: retired;
    # steps 1..5 held nothing a kept step uses: collected (3's slow bytes once 6 changed them)
    assert own_data(root, 0) and own_data(root, 6)
    for step in range(1, 6):
        assert own_data(root, step) == [], step


@pytest.mark.parametrize("async_save", [False, True])
def test_ten_saves_keep_last_three(uri_factory, async_save):
    run_ten_saves(uri_factory("run"), async_save)


def test_ten_saves_keep_last_three_on_s3(moto_server):
    run_ten_saves(store_uri("moto", moto_server, new_bucket(moto_server), "run"), async_save=True)


def test_off_by_default_writes_every_byte(uri_factory):
    root = uri_factory("run")
    m = bcp.CheckpointManager(root, async_save=False)
    infos = [m.save(step, state_at(step)) for step in range(2)]
    assert all(i.bytes_written >= nbytes(FROZEN) + nbytes(SLOW) + nbytes(ADAPTER) for i in infos)  # and padding
    assert all(f.checkpoint is None for f in bcp.open(m.uri(1)).manifest.data_files)


def test_the_first_save_records_digests_and_a_resave_of_a_step_takes_another_base(uri_factory):
    root = uri_factory("run")
    m = bcp.CheckpointManager(root, async_save=False, incremental=True)
    first = m.save(0, state_at(0))
    assert first.bytes_written >= nbytes(FROZEN) + nbytes(SLOW) + nbytes(ADAPTER)
    assert first.fragments == 3  # digests recorded: the next save reuses them
    assert m.save(1, state_at(1)).bytes_written == nbytes(ADAPTER)
    # step 1 again (a restart that saves it anew): its base is step 0, never itself
    again = m.save(1, state_at(1), overwrite=True)
    assert again.bytes_written == nbytes(ADAPTER)
    assert {f.checkpoint for f in bcp.open(m.uri(1)).manifest.data_files} == {None, step_name(0)}


def test_two_gloo_ranks_then_load_at_one_and_three_ranks(tmp_path):
    import manager_incremental_jobs as jobs

    root = str(tmp_path / "run")
    dist_jobs.spawn(jobs.manager_job, 2, root)
    # step 3 at world size 1: the whole tensors, assembled from both ranks' shards
    whole = jobs.sharded_state(0, 1, 3)
    template = {"frozen": torch.zeros(64, 16), "adapter": torch.zeros(64, 4), "table": torch.zeros(8, 8), "step": 0}
    got = bcp.load(template, f"{root}/{step_name(3)}")
    assert torch.equal(got["frozen"], whole["frozen"].local)
    assert torch.equal(got["adapter"], whole["adapter"].local)
    assert torch.equal(got["table"], torch.ones(8, 8)) and got["step"] == 3
    dist_jobs.spawn(jobs.load_three_job, 3, root)


# -- the base's catalog, read while the coordinator holds the base ---------------------------


def test_a_base_read_early_is_used_only_if_it_is_the_base_held(uri_factory, monkeypatch):
    """The base is overwritten after the early read and before its holds: the save
    refers to the new base's bytes, never to the replaced generation's."""
    import bcp.incremental
    import bcp.saver

    parent = uri_factory("run")
    base, uri = f"{parent}/s0", f"{parent}/s1"
    old = {"a": torch.zeros(64, 16), "b": torch.ones(64, 16)}
    new = {"a": torch.full((64, 16), 2.0), "b": torch.ones(64, 16)}
    bcp.save(old, base, incremental=True)
    reads = []
    real = bcp.incremental.prefetch_base

    def then_overwrite(*args):
        future = real(*args)
        reads.append(future.result().manifest.save_id)
        bcp.save(new, base, incremental=True, overwrite=True)
        return future

    monkeypatch.setattr(bcp.saver, "prefetch_base", then_overwrite)
    state = {"a": torch.full((64, 16), 2.0), "b": torch.full((64, 16), 3.0)}
    info = bcp.save(state, uri, base=base)
    assert reads and reads[0] != bcp.open(base).manifest.save_id  # the early read was of the replaced base
    assert info.bytes_written == 64 * 16 * 4  # "a" refers to the new base's bytes, "b" is written
    got = bcp.load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, uri)
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
    assert verify_checkpoint(uri)["ok"]


def test_a_save_with_a_base_reads_the_base_metadata_once(uri_factory, monkeypatch):
    import bcp.incremental

    parent = uri_factory("run")
    bcp.save({"a": torch.zeros(8, 8)}, f"{parent}/s0", incremental=True)
    calls = []
    real = bcp.incremental.fetch_metadata
    monkeypatch.setattr(bcp.incremental, "fetch_metadata", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert bcp.save({"a": torch.zeros(8, 8)}, f"{parent}/s1", base=f"{parent}/s0").bytes_written == 0
    # at most once: none when this process kept the rows of the commit it made last with
    # this structure (tests/test_incremental_kept.py), which depends on the saves before
    assert len(calls) <= 1


def holds_under(parent: str) -> list[str]:
    return [k for k in resolve_backend(parent).list("") if "/holds/" in k]


def test_one_rank_holds_its_base_only_when_it_reuses_a_piece_of_it(uri_factory):
    """Every piece changed (dense training): nothing of the base is reused, so nothing
    is held (no durable write) and nothing is referred to; a reused piece holds it."""
    parent = uri_factory("run")
    state = {"a": torch.zeros(64, 16), "b": torch.ones(64, 16)}
    bcp.save(state, f"{parent}/s0", incremental=True)
    state["a"] += 1
    state["b"] += 1
    info = bcp.save(state, f"{parent}/s1", base=f"{parent}/s0")
    assert info.bytes_written == 2 * 64 * 16 * 4
    assert holds_under(parent) == []
    assert all(f.checkpoint is None for f in bcp.open(f"{parent}/s1").manifest.data_files)
    state["a"] += 1  # "b" is as in s1
    assert bcp.save(state, f"{parent}/s2", base=f"{parent}/s1").bytes_written == 64 * 16 * 4
    held = bcp.open(f"{parent}/s1").manifest.generation
    assert [k.split("/holds/")[0] for k in holds_under(parent)] == [f"s1/{held}"]
    got = bcp.load({"a": torch.zeros(64, 16), "b": torch.zeros(64, 16)}, f"{parent}/s2")
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])


def test_with_a_local_tier_the_steps_saved_to_the_root_are_incremental(tmp_path):
    """every=2, persist_every=3: steps 3 and 9 are due at the root and not saved locally,
    so the manager saves them to the root itself; 9 takes 3 as its base."""
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "shm"), every=2, replicas=0, persist_every=3)
    with bcp.CheckpointManager(tmp_path / "run", tier=tier, incremental=True, async_save=False) as m:
        first = m.save(3, state_at(3))
        second = m.save(9, state_at(9))
    assert first is not None and second is not None
    assert second.bytes_written == nbytes(ADAPTER) + nbytes(SLOW)  # 9 // 3 * 3 != 3: the slow tensor changed
    assert {f.checkpoint for f in bcp.open(m.uri(9)).manifest.data_files} == {None, step_name(3)}
    got = bcp.load(state_at(0), m.uri(9))
    assert all(torch.equal(got[k], state_at(9)[k]) for k in ("frozen", "slow", "adapter"))


@settings(max_examples=15, deadline=None)
@given(
    changes=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=6),
    keep=st.integers(1, 3),
)
def test_any_history_of_changes_writes_what_changed_and_keeps_every_kept_step_exact(changes, keep):
    """Random tensors changing at random steps: each save writes exactly the changed
    tensors' bytes; every kept step loads as saved; nothing a kept step reads is gone."""
    from bcp.backends.memory import clear_memory_store

    store = f"h{uuid.uuid4().hex[:10]}"
    root = f"memory://{store}/run"
    state = {f"t{i}": torch.full((8, 8), float(i)) for i in range(3)}
    saved, written = {}, []
    try:
        m = bcp.CheckpointManager(root, keep_last=keep, incremental=True, async_save=False)
        m.save(0, state)
        saved[0] = copy.deepcopy(state)
        for step, changed in enumerate(changes, start=1):
            for i, c in enumerate(changed):
                if c:
                    state[f"t{i}"] += 1.0
            written.append(m.save(step, state).bytes_written)
            saved[step] = copy.deepcopy(state)
        assert written == [sum(changed) * 8 * 8 * 4 for changed in changes]
        assert m.steps() == list(range(len(changes) + 1))[-keep:]
        for step in m.steps():
            got = bcp.load({k: torch.zeros(8, 8) for k in state}, m.uri(step))
            assert all(torch.equal(got[k], saved[step][k]) for k in state), step
    finally:
        clear_memory_store(store)


@pytest.mark.parametrize("damaged", ["manifest", "catalog"])
def test_a_damaged_newest_step_costs_the_next_save_its_bytes_not_the_save(tmp_path, caplog, damaged):
    """One flipped byte in the newest step's manifest (this manager) or catalog (a new
    manager: a restarted job, no rows kept): the next saves write every byte with a
    WARNING naming the base, and load exactly; they used to fail, every one."""
    root = str(tmp_path / "root")
    bcp.CheckpointManager(root, keep_last=3, incremental=True, async_save=False).save(1, state_at(1))
    manager = bcp.CheckpointManager(root, keep_last=3, incremental=True, async_save=False)
    newest = tmp_path / "root" / step_name(1)
    if damaged == "manifest":
        flip_bit(str(newest / "manifest.json"), (newest / "manifest.json").read_bytes().index(b'"save_id"') + 14, 0x01)
    else:
        (catalog,) = newest.glob("gen-*/fragments.arrow")
        flip_bit(str(catalog), catalog.stat().st_size // 2)
        clear_plan_caches()  # a restarted job: the rows of step 1 kept by the process that saved it are gone
    total = nbytes(FROZEN) + nbytes(SLOW) + nbytes(ADAPTER)
    with caplog.at_level("WARNING", logger="bcp"):
        info = manager.save(2, state_at(2))
    assert info.bytes_written >= total and info.tensor_bytes == total
    assert f"base {newest}" in caplog.text and "saving every byte" in caplog.text
    loaded = bcp.load(copy.deepcopy(state_at(0)), str(tmp_path / "root" / step_name(2)))
    assert all(torch.equal(loaded[k], v) for k, v in state_at(2).items() if isinstance(v, torch.Tensor))
    manager.save(3, state_at(3))  # step 2 is a good base: referred to again
    assert manager.steps() == [1, 2, 3]
