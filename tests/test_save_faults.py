"""Faults around the commit, concurrent housekeeping, links, leftovers and exit.

Each test reproduces one way a save used to lose or damage data (issue 14's list)
and checks the rule in docs/reliability.md that now prevents it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

import bcp
from bcp import commit, discovery, holds, retention
from bcp.backends import Backend, ObjectWriter, backend_for
from bcp.backends.file import PARTIAL_MARKER, FileBackend
from bcp.backends.memory import MemoryBackend
from bcp.backends.storage_errors import StorageError
from bcp.backends.wrappers import ForwardingBackend
from bcp.errors import CheckpointError, CommitUncertainError, IncompleteCheckpointError
from bcp.metadata.keys import MANIFEST_KEY, step_name
from bcp.metadata.manifest import reseal

from .helpers import assert_same


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def _template() -> dict:
    return {"w": torch.zeros(64, 8), "b": torch.zeros(8), "step": -1}


def _loads_as(uri, expected: dict) -> None:
    assert_same(bcp.load(_template(), uri), expected)


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _dirs, fs in os.walk(root) for f in fs)


# -- errors after the manifest has landed (item 2) ----------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_fsync_failing_after_the_manifest_landed_reports_committed(
    tmp_path, monkeypatch, caplog, overwrite
):
    uri = tmp_path / "ckpt"
    if overwrite:
        bcp.save(_state(1), uri)
    real = os.fsync
    before = (uri / MANIFEST_KEY).stat().st_ino if overwrite else None

    def failing_fsync(fd):
        # the directory fsync that follows the new manifest's link or rename
        manifest = uri / MANIFEST_KEY
        if manifest.exists() and manifest.stat().st_ino != before and os.readlink(f"/proc/self/fd/{fd}") == str(uri):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        info = bcp.save(_state(2), uri, overwrite=overwrite)
    assert info.tensors == 2
    assert any("committed" in r.getMessage() and "error afterwards" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    _loads_as(uri, _state(2))


def test_a_partial_file_that_cannot_be_removed_after_the_link_is_a_warning(tmp_path, monkeypatch, caplog):
    uri = tmp_path / "ckpt"
    real = os.unlink

    def failing_unlink(path, *a, **k):
        if f"{MANIFEST_KEY}{PARTIAL_MARKER}" in os.fspath(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        bcp.save(_state(3), uri)
    monkeypatch.undo()
    _loads_as(uri, _state(3))
    leftovers = [u.name for u in FileBackend(str(uri)).unfinished()]
    assert len(leftovers) == 1 and leftovers[0].startswith(MANIFEST_KEY)


class _LostAnswers(ForwardingBackend):
    """The manifest's write takes effect, then its answer is lost; with
    ``unreadable``, reading the manifest back fails too."""

    def __init__(self, inner: Backend, *, unreadable: bool) -> None:
        super().__init__(inner)
        self.unreadable = unreadable
        self.lost = False

    def write_if_absent(self, key: str, data) -> None:
        self.inner.write_if_absent(key, data)
        if key.endswith(MANIFEST_KEY):
            self.lost = True
            raise StorageError("connection reset", uri=self.uri, key=key, action="creating")

    def write(self, key: str, data) -> None:
        self.inner.write(key, data)
        if key.endswith(MANIFEST_KEY):
            self.lost = True
            raise StorageError("connection reset", uri=self.uri, key=key, action="writing")

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        if self.lost and self.unreadable and key.endswith(MANIFEST_KEY):
            raise StorageError("connection reset", uri=self.uri, key=key, action="reading")
        return self.inner.read_into(key, offset, buffer)

    def size(self, key: str) -> int:
        if self.lost and self.unreadable and key.endswith(MANIFEST_KEY):
            raise StorageError("connection reset", uri=self.uri, key=key, action="sizing")
        return self.inner.size(key)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_lost_answer_to_the_commit_is_checked_by_reading_the_manifest_back(overwrite):
    store = MemoryBackend(f"memory://lost-{uuid.uuid4().hex}", f"lost-{uuid.uuid4().hex}")
    if overwrite:
        bcp.save(_state(1), store)
    bcp.save(_state(2), _LostAnswers(store, unreadable=False), overwrite=overwrite)
    _loads_as(store, _state(2))
    assert len(commit.generations(store)) == 1  # the replaced generation went, the new one stayed


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_unknowable_commit_keeps_the_data_and_says_so(overwrite):
    store = MemoryBackend(f"memory://unknown-{uuid.uuid4().hex}", f"unknown-{uuid.uuid4().hex}")
    if overwrite:
        bcp.save(_state(1), store)
    with pytest.raises(CommitUncertainError, match="data was kept"):
        bcp.save(_state(2), _LostAnswers(store, unreadable=True), overwrite=overwrite)
    _loads_as(store, _state(2))  # the manifest did land: its data is all there


def test_a_manager_whose_commit_answer_was_lost_keeps_its_last_good_step(tmp_path, monkeypatch):
    root = tmp_path / "run"
    manager = bcp.CheckpointManager(root, keep_last=1, async_save=False)
    manager.save(1, _state(1))
    real = os.fsync

    def failing_fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target == str(root / step_name(2)) and os.path.exists(root / step_name(2) / MANIFEST_KEY):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    manager.save(2, _state(2))
    monkeypatch.undo()
    restarted = bcp.CheckpointManager(root, keep_last=1, async_save=False)
    step, state = restarted.load_latest(_template())
    assert step == 2
    assert_same(state, _state(2))


# -- gc and a second manager during a save (item 5) -----------------------------------------


class _HookBeforeCatalog(ForwardingBackend):
    """Runs ``hook`` once, when the save writes its catalog (its data files are written)."""

    def __init__(self, inner: Backend, hook) -> None:
        super().__init__(inner)
        self.hook = hook

    def write(self, key: str, data) -> None:
        if key.endswith("fragments.arrow") and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        self.inner.write(key, data)


def _save_step_through(root, step: int, state: dict, hook) -> None:
    backend = _HookBeforeCatalog(FileBackend(str(root / step_name(step))), hook)
    bcp.save(state, backend)


def test_gc_during_a_save_leaves_it_alone(tmp_path):
    root = tmp_path / "run"
    bcp.CheckpointManager(root, async_save=False).save(1, _state(1))
    plans = []

    def gc_now():
        backend = backend_for(str(root))
        plan = retention.plan_gc(backend, keep_last=1)
        plans.append(plan)
        retention.run_gc(backend, plan)

    _save_step_through(root, 2, _state(2), gc_now)
    assert plans[0].young == [2] and plans[0].incomplete == []
    _loads_as(root / step_name(2), _state(2))


def test_a_second_manager_starting_during_a_save_leaves_it_alone(tmp_path):
    root = tmp_path / "run"
    bcp.CheckpointManager(root, keep_last=1, async_save=False).save(1, _state(1))
    _save_step_through(root, 2, _state(2), lambda: bcp.CheckpointManager(root, keep_last=1))
    step, state = bcp.CheckpointManager(root, keep_last=1).load_latest(_template())
    assert step == 2
    assert_same(state, _state(2))


def test_a_save_whose_data_was_deleted_under_it_fails_and_commits_nothing(tmp_path):
    root = tmp_path / "run"
    manager = bcp.CheckpointManager(root, keep_last=1, async_save=False)
    manager.save(1, _state(1))

    def gc_without_grace():
        backend = backend_for(str(root))
        retention.run_gc(backend, retention.plan_gc(backend, keep_last=1, grace_seconds=0))

    with pytest.raises(IncompleteCheckpointError, match="deleted while it was writing"):
        _save_step_through(root, 2, _state(2), gc_without_grace)
    assert not (root / step_name(2) / MANIFEST_KEY).exists()
    step, state = bcp.CheckpointManager(root, keep_last=1).load_latest(_template())
    assert step == 1
    assert_same(state, _state(1))


def test_save_ids_carry_their_start_time():
    before = time.time()
    save_id = commit.new_save_id()
    started = commit.generation_started(f"gen-{save_id}")
    assert started is not None and before - 1 <= started <= time.time()
    assert commit.generation_started("gen-0123456789abcdef") is None  # an id from before
    assert commit.is_young(f"gen-{save_id}", 60) and not commit.is_young(f"gen-{save_id}", 0)
    assert not commit.is_young(f"gen-{commit.new_save_id(now=time.time() - 7200)}", 3600)


# -- links (items 6 and 7) ----------------------------------------------------------------------


def test_a_data_file_linked_outside_the_checkpoint_is_never_read(tmp_path):
    uri = tmp_path / "ckpt"
    bcp.save(_state(4), uri)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(64 * 8 * 4 + 64))
    (data_file,) = (uri / d / f for d, _dirs, fs in os.walk(uri) for f in fs if f.endswith(".bin"))
    data_file = data_file if data_file.is_absolute() else uri / data_file
    size = data_file.stat().st_size
    data_file.unlink()
    data_file.symlink_to(secret)
    for verify in (False, True):
        with pytest.raises((StorageError, CheckpointError)) as caught:
            bcp.load(_template(), uri, verify=verify)
        message = str(caught.value)
        assert "symbolic link" in message or "missing" in message
        assert str(secret.stat().st_size) not in message.replace(str(size), "")


def test_a_step_that_is_a_link_is_not_followed_by_gc_or_delete(tmp_path):
    root = tmp_path / "run"
    bcp.CheckpointManager(root, async_save=False).save(1, _state(1))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "gen-x" / "data").mkdir(parents=True)
    (elsewhere / "gen-x" / "data" / "precious.bin").write_bytes(b"keep me")
    (root / step_name(7)).symlink_to(elsewhere, target_is_directory=True)
    backend = backend_for(str(root))
    assert 7 not in discovery.scan(backend)  # never listed through the link
    retention.run_gc(backend, retention.plan_gc(backend, grace_seconds=0))
    with pytest.raises(StorageError, match="symbolic link"):
        retention.delete_step(backend, 7)
    with pytest.raises(StorageError, match="symbolic link"):
        backend.delete_prefix(f"{step_name(7)}/")
    assert (elsewhere / "gen-x" / "data" / "precious.bin").read_bytes() == b"keep me"


def test_a_link_inside_a_generation_is_removed_as_a_link(tmp_path):
    uri = tmp_path / "ckpt"
    bcp.save(_state(5), uri)
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    generation = next(p for p in uri.iterdir() if p.name.startswith("gen-"))
    (generation / "planted").symlink_to(outside)
    commit.delete_checkpoint(FileBackend(str(uri)))
    assert outside.read_text() == "mine"
    assert not uri.exists() or _files(uri) == []


# -- leftovers of killed saves (item 10) --------------------------------------------------------


def _killed_save(root, step: int, age_seconds: float) -> str:
    """A save into ``step`` killed mid-write: only a partial data file, with the given age."""
    backend = FileBackend(str(root))
    generation = f"gen-{commit.new_save_id(now=time.time() - age_seconds)}"
    writer: ObjectWriter = backend.open_writer(f"{step_name(step)}/{generation}/data/rank00000-0.bin", size=1 << 20)
    writer.write_at(0, b"x" * (1 << 20))
    (partial,) = [u.name for u in backend.unfinished(step_name(step))]
    past = time.time() - age_seconds
    os.utime(os.path.join(str(root), *partial.split("/")), (past, past))
    return partial  # never committed nor aborted: the process "died"


def test_partial_files_of_killed_saves_are_found_and_removed_once_old(tmp_path):
    root = tmp_path / "run"
    bcp.CheckpointManager(root, async_save=False).save(1, _state(1))
    _killed_save(root, 2, age_seconds=2 * commit.DEFAULT_GRACE_SECONDS)
    young = _killed_save(root, 3, age_seconds=10)
    # a killed manifest write beside a committed checkpoint
    stray = root / step_name(1) / f"{MANIFEST_KEY}{PARTIAL_MARKER}0123456789ab"
    stray.write_bytes(b"{")
    old = time.time() - 2 * commit.DEFAULT_GRACE_SECONDS
    os.utime(stray, (old, old))
    backend = backend_for(str(root))
    assert backend.list(step_name(2)) is not None and not list(backend.list(step_name(2)))  # listing hides it
    plan = retention.plan_gc(backend)
    assert plan.incomplete == [2] and plan.young == [3]
    assert plan.unfinished == [f"{step_name(1)}/{stray.name}"]
    retention.run_gc(backend, plan)
    assert [u.name for u in backend.unfinished()] == [young]
    assert not (root / step_name(2)).exists()
    _loads_as(root / step_name(1), _state(1))


# -- exit with a save in flight (item 11) ----------------------------------------------------------


_EXIT_SCRIPT = """
import sys, torch, bcp
state = {"w": torch.arange(3_000_000, dtype=torch.float32), "step": 9}
if sys.argv[2] == "async_save":
    bcp.async_save(state, sys.argv[1])
else:
    bcp.CheckpointManager(sys.argv[1]).save(9, state)
print("script done")
"""


@pytest.mark.parametrize("how", ["async_save", "manager"])
def test_an_async_save_in_flight_at_exit_is_finished(tmp_path, how):
    uri = tmp_path / "exit"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXIT_SCRIPT), str(uri), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    target = uri if how == "async_save" else uri / step_name(9)
    loaded = bcp.load({"w": torch.zeros(3_000_000), "step": 0}, target)
    assert loaded["step"] == 9 and torch.equal(loaded["w"], torch.arange(3_000_000, dtype=torch.float32))
    assert not list(FileBackend(str(uri)).unfinished())


# -- errors opening a data file (item 12) ---------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EIO])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_error_opening_a_data_file_is_reported_as_itself(tmp_path, monkeypatch, code, mode):
    real = os.open

    def failing_open(path, flags, *a, **k):
        if PARTIAL_MARKER in os.fspath(path) and ".bin" in os.fspath(path):
            raise OSError(code, os.strerror(code), path)
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", failing_open)

    def save() -> None:
        if mode == "sync":
            bcp.save(_state(6), tmp_path / "ckpt")
        else:
            bcp.async_save(_state(6), tmp_path / "ckpt").wait()

    with pytest.raises(StorageError) as caught:
        save()
    assert os.strerror(code) in str(caught.value) and "rank00000" in str(caught.value)


# -- housekeeping that cannot delete (item 14) and bad manifests (item 16) -----------------------


def test_an_old_step_that_cannot_be_deleted_never_fails_a_save(tmp_path, monkeypatch, caplog):
    root = tmp_path / "run"
    real = holds.delete_checkpoint

    def refuse_step_1(backend, name, *args, **kwargs):
        if name == step_name(1):
            raise StorageError("Permission denied", uri=backend.uri, key=name, action="deleting")
        return real(backend, name, *args, **kwargs)

    monkeypatch.setattr(holds, "delete_checkpoint", refuse_step_1)
    for sync in (True, False):
        manager = bcp.CheckpointManager(root, keep_last=1, async_save=not sync)
        with caplog.at_level(logging.WARNING, logger="bcp"):
            for step in range(1 + 4 * (not sync), 5 + 4 * (not sync)):
                manager.save(step, _state(step))
            manager.wait()
    assert manager.steps() == [1, 8]
    assert any("could not delete step 1" in r.getMessage() for r in caplog.records)


def _edit_manifest(path, edit) -> None:
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_bytes(reseal(doc))


def test_retention_survives_bad_metrics_and_unreadable_manifests(tmp_path, caplog):
    root = tmp_path / "run"
    manager = bcp.CheckpointManager(root, keep_best=("loss", 4, "min"), async_save=False)
    for step, loss in ((1, 0.5), (2, 0.2), (3, 0.9), (4, 0.7)):
        manager.save(step, _state(step), metrics={"loss": loss})

    def bad_metric(doc):
        doc["user_metadata"]["bcp_manager"]["metrics"]["loss"] = "not a number"

    _edit_manifest(root / step_name(3) / MANIFEST_KEY, bad_metric)
    (root / step_name(1) / MANIFEST_KEY).write_bytes(b"\x00garbage")
    with caplog.at_level(logging.WARNING, logger="bcp"):
        restarted = bcp.CheckpointManager(root, keep_best=("loss", 1, "min"), async_save=False)
        restarted.save(5, _state(5), metrics={"loss": 0.8})
    kept = restarted.steps()
    assert 2 in kept and 5 in kept  # the best and the newest
    assert any("not a finite number" in r.getMessage() for r in caplog.records)
    assert any("unreadable" in r.getMessage() for r in caplog.records)
