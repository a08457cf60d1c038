"""The fsyncs of a sync save to a new file root (issue 37): the directories the save
creates are made durable off the calling thread, while the data is written, yet
before anything is committed; the data file is fsynced before its rename, every
directory after the entries it must keep, and the manifest is linked last."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import bcp
from bcp.backends import file as file_backend
from bcp.backends import file_writes


def _name(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """(what, path, thread) for every fsync, rename and link of the save."""
    seen: list[tuple[str, str, int]] = []
    fsync, rename, link = os.fsync, os.rename, os.link

    def on_fsync(fd: int) -> None:
        seen.append(("fsync", _name(fd), threading.get_ident()))
        fsync(fd)

    def on_rename(a: str, b: str) -> None:
        rename(a, b)
        seen.append(("rename", b, threading.get_ident()))

    def on_link(a: str, b: str) -> None:
        link(a, b)
        seen.append(("link", b, threading.get_ident()))

    monkeypatch.setattr(os, "fsync", on_fsync)
    monkeypatch.setattr(os, "rename", on_rename)
    monkeypatch.setattr(os, "link", on_link)
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")
def test_new_directories_synced_off_the_calling_thread_before_the_commit(tmp_path, events) -> None:
    root = tmp_path / "new" / "ckpt"
    bcp.save({"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3)}, str(root))
    me = threading.get_ident()
    fsyncs = [p for what, p, _t in events if what == "fsync"]
    at = {(what, p): i for i, (what, p, _t) in enumerate(events)}
    (manifest,) = [i for i, (what, p, _t) in enumerate(events) if what == "link" and p.endswith("manifest.json")]
    (gen,) = [p for p in os.listdir(root) if p.startswith("gen-")]
    created = [str(tmp_path), str(tmp_path / "new"), str(root), str(root / gen)]  # parents of new directories
    for d in created:  # synced on another thread, before the commit
        assert any(p == d and t != me and i < manifest for i, (what, p, t) in enumerate(events) if what == "fsync")
    data = root / gen / "data"
    (data_file,) = [p for what, p, _t in events if what == "rename" and p.startswith(str(data) + "/")]
    partial = [i for i, (what, p, _t) in enumerate(events) if what == "fsync" and p.startswith(data_file + ".bcp")]
    assert partial and partial[-1] < at[("rename", data_file)]  # the file is durable before its name
    assert at[("rename", data_file)] < at[("fsync", str(data))] < manifest  # its name is durable before the commit
    catalog = str(root / gen / "fragments.arrow")
    assert at[("rename", catalog)] < at[("fsync", str(root / gen))] < manifest
    assert at[("fsync", str(root))] > manifest  # the manifest's entry, made durable
    # before the data file's name is durable, the calling thread syncs nothing but the file
    renamed = at[("rename", data_file)]
    assert {p for i, (what, p, t) in enumerate(events) if what == "fsync" and t == me and i < renamed} == {
        events[partial[-1]][1]
    }
    assert len(fsyncs) == 10  # 3 files; 4 directories created, then the data's, the catalog's, the manifest's


def test_a_failed_directory_sync_commits_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The background sync's error is the save's: raised before the data file's rename."""
    root = tmp_path / "ckpt"

    def failing(path: str) -> None:
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(file_writes, "fsync_dir", failing)
    with pytest.raises(Exception, match="Input/output error"):
        bcp.save({"a": torch.ones(100)}, str(root))
    assert not (root / "manifest.json").exists()
    assert not any(p.name.endswith(".bin") for p in root.rglob("*"))  # no data file was renamed into place
    assert file_backend.PARTIAL_MARKER  # the module the sync belongs to


def _held_dir_syncs(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> threading.Event:
    """Hold every directory fsync made on a DirSync thread until the event is set
    (then fail it, with ``fail``); the commit's own directory fsyncs go through."""
    release = threading.Event()
    real = file_writes.fsync_dir

    def held(path: str) -> None:
        if threading.current_thread().name == "bcp-dirsync":
            release.wait(10)
            if fail:
                raise OSError(5, "Input/output error", path)
        real(path)

    monkeypatch.setattr(file_writes, "fsync_dir", held)
    return release


def test_a_writer_in_a_directory_another_writer_made_waits_for_that_sync(tmp_path, monkeypatch) -> None:
    """Writer a makes directory new/ (its entry synced on a thread, still running);
    writer b, opened next, finds new/ there: b's commit must not return before new/'s
    entry is durable, or b's file, committed, is gone after a crash. Before the sync
    moved to a thread, a's open made it durable before b could look."""
    release = _held_dir_syncs(monkeypatch)
    fb = file_backend.FileBackend(str(tmp_path))
    a = fb.open_writer("new/a", size=3)
    b = fb.open_writer("new/b", size=3)
    b.write_at(0, b"abc")
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.commit(), done.set()))
    t.start()
    try:
        assert not done.wait(0.5)  # held: new/ is not yet durable in its parent
    finally:
        release.set()
        t.join(10)
    assert done.is_set() and (tmp_path / "new" / "b").read_bytes() == b"abc"
    a.abort()


def test_a_failed_sync_of_a_directory_fails_every_writer_in_it_that_was_waiting(tmp_path, monkeypatch) -> None:
    """The same, the sync failing: b's commit raises it too, and b's file is not committed."""
    release = _held_dir_syncs(monkeypatch, fail=True)
    fb = file_backend.FileBackend(str(tmp_path))
    a = fb.open_writer("new/a", size=3)
    b = fb.open_writer("new/b", size=3)
    b.write_at(0, b"abc")
    release.set()
    with pytest.raises(Exception, match="Input/output error"):
        b.commit()
    assert not (tmp_path / "new" / "b").exists()
    with pytest.raises(Exception, match="Input/output error"):
        a.commit()
