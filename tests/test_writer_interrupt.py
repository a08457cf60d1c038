"""Ctrl-C at any moment of a save ends it: the writers a save starts end however many
started, so finish() never waits on one left without an end mark (`bcp bench`
interrupted by a real SIGINT hung in the full suite: its writer's start() was cut short)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import bcp


def _save_in_thread(state: dict, uri: str) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            bcp.save(state, uri)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


@pytest.fixture
def cut(monkeypatch) -> list[threading.Thread]:
    """The first writer thread whose start() a KeyboardInterrupt cuts short (it runs)."""
    real_start = threading.Thread.start
    cut: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        real_start(self)
        if self.name == "bcp-writer" and not cut:
            cut.append(self)
            raise KeyboardInterrupt  # as a SIGINT during start()'s wait for the new thread

    monkeypatch.setattr(threading.Thread, "start", start)
    return cut


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "bcp-writer"]


@pytest.mark.parametrize("kind", ["file", "memory", "fsspec"])
def test_a_writer_start_cut_short_by_ctrl_c_ends_the_save(cut, tmp_path, kind):
    """Failed before (hung in finish's join): a KeyboardInterrupt while a writer thread
    starts (it runs, but is not listed) is parked like any staging error; the writers are
    started again, every one of them ends on the one end mark, the save raises the
    KeyboardInterrupt, commits nothing, and no writer is left behind."""
    before = set(_writers())
    # a file root writes in batches with one writer; the others with one writer per stream (4)
    uri = {
        "file": str(tmp_path / "ck"),
        "memory": f"memory://cut-{tmp_path.name}/ck",
        "fsspec": f"fsspec+file://{tmp_path}/ck",
    }[kind]
    thread, raised = _save_in_thread({f"t{i}": torch.randn(4096) for i in range(16)}, uri)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the save hung after its writer's start was interrupted"
    assert cut and len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt), raised
    assert not bcp.exists(uri)
    deadline = time.monotonic() + 10
    while set(_writers()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(_writers()) - before, "a writer thread was left running"


def test_saves_after_an_interrupted_one_write_every_byte(cut, tmp_path):
    """The next saves in the same process start clean (each pipeline its own end mark)."""
    state = {f"t{i}": torch.randn(4096) for i in range(16)}
    thread, raised = _save_in_thread(state, str(tmp_path / "a"))
    thread.join(timeout=60)
    assert cut and raised and isinstance(raised[0], KeyboardInterrupt)
    assert not bcp.exists(str(tmp_path / "a"))
    for name in ("b", "c"):
        bcp.save(state, str(tmp_path / name))
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        bcp.load(loaded, str(tmp_path / name))
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_ctrl_c_after_the_manifest_landed_keeps_the_data_it_names(tmp_path, monkeypatch, overwrite):
    """A KeyboardInterrupt (or a SIGTERM handler's sys.exit) while the manifest's directory
    is fsynced: the manifest is in place, the save had not marked itself committed, and the
    partial-save cleanup deleted the generation under it (a step that looked committed
    and could never load; with an overwrite, the last good checkpoint lost)."""
    from bcp.backends import file_writes

    uri = str(tmp_path / "ck")
    bcp.save({"w": torch.zeros(1000)}, uri)
    old = (tmp_path / "ck" / "manifest.json").read_bytes()
    real = file_writes.fsync_dir

    def interrupted(path: str) -> None:  # once the new manifest is in place
        real(path)
        manifest = Path(path) / "manifest.json"
        if manifest.exists() and manifest.read_bytes() != old:
            raise KeyboardInterrupt

    target = uri if overwrite else str(tmp_path / "next")
    monkeypatch.setattr(file_writes, "fsync_dir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bcp.save({"w": torch.ones(1000)}, target, overwrite=overwrite)
    monkeypatch.setattr(file_writes, "fsync_dir", real)
    assert torch.equal(bcp.load({"w": torch.zeros(1000)}, target)["w"], torch.ones(1000))
    from bcp.verify import verify_checkpoint

    assert verify_checkpoint(target)["ok"]
