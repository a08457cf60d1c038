"""Overwrites killed with SIGKILL (issue 36): a Lightning ``last.ckpt`` replaced with
``overwrite=True`` and killed left ``gen-*/`` directories and ``*.bcp-partial-*``
files that no later overwrite removed and ``bcp gc`` did not see. Now ``bcp gc``
finds and removes them, a later overwrite removes them too, both only once they are
older than the grace period (younger ones may be a concurrent save's), and the
committed checkpoint loads exactly throughout. A directory holding only a killed
save's partial file is an IncompleteCheckpointError, as the README says."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import bcp
from bcp.backends import backend_for
from bcp.cli import main as cli_main
from bcp.commit import new_save_id
from bcp.metadata.keys import GENERATION_PREFIX, MANIFEST_KEY

SCRIPT = pathlib.Path(__file__).with_name("killed_overwrite_script.py")
HOURS_AGO = 2 * 3600.0  # older than the grace period (one hour)


def first() -> dict:
    return {"w": torch.full((4096,), 1.0), "step": 1}


def assert_loads_first(uri: pathlib.Path) -> None:
    back = bcp.load({"w": torch.zeros(4096), "step": 0}, uri)
    assert torch.equal(back["w"], first()["w"]) and back["step"] == 1


def partial_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if ".bcp-partial-" in p.name)


def generations(ck: pathlib.Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith(GENERATION_PREFIX))


def kill_an_overwrite(uri: pathlib.Path, ago: float) -> None:
    """Run tests/killed_overwrite_script.py and SIGKILL it in the middle of its write."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(uri), str(ago)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", line + proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> pathlib.Path:
    """A root holding ``last.ckpt``, committed, and one overwrite of it killed two
    hours ago (its save id and its partial file's time say so)."""
    root = tmp_path_factory.mktemp("killed")
    bcp.save(first(), root / "last.ckpt")
    kill_an_overwrite(root / "last.ckpt", HOURS_AGO)
    then = time.time() - HOURS_AGO
    for p in partial_files(root):
        os.utime(p, (then, then))
    return root


@pytest.fixture
def root(killed, tmp_path) -> pathlib.Path:
    copy = tmp_path / "root"
    shutil.copytree(killed, copy)
    return copy


def test_the_kill_leaves_a_generation_with_a_partial_file(root):
    ck = root / "last.ckpt"
    assert len(generations(ck)) == 2 and len(partial_files(root)) >= 1
    assert_loads_first(ck)


@pytest.mark.parametrize("where", ["root", "checkpoint"])
def test_gc_finds_and_removes_what_a_killed_overwrite_left(root, capsys, where):
    ck = root / "last.ckpt"
    live = bcp.open(ck).manifest.generation
    target = root if where == "root" else ck
    assert cli_main(["gc", str(target), "--dry-run"]) == 0
    report = capsys.readouterr().out
    assert "1 unused generation(s)" in report and f"{len(partial_files(root))} partial write(s)" in report, report
    assert " 0 partial write(s)" not in report
    assert cli_main(["gc", str(target)]) == 0
    assert partial_files(root) == [] and generations(ck) == [live]
    assert sorted(p.name for p in ck.iterdir()) == sorted([MANIFEST_KEY, live])
    assert_loads_first(ck)
    assert cli_main(["gc", str(target)]) == 0
    assert "0 unused generation(s), 0 partial write(s)" in capsys.readouterr().out


def test_a_later_overwrite_removes_what_a_killed_one_left(root):
    ck = root / "last.ckpt"
    assert_loads_first(ck)
    info = bcp.save({"w": torch.full((4096,), 3.0), "step": 3}, ck, overwrite=True)
    assert partial_files(root) == []
    assert generations(ck) == [f"{GENERATION_PREFIX}{info.save_id}"]
    back = bcp.load({"w": torch.zeros(4096), "step": 0}, ck)
    assert torch.equal(back["w"], torch.full((4096,), 3.0)) and back["step"] == 3


def make_young(ck: pathlib.Path) -> str:
    """The killed generation renamed to a save id started now: what a save of the
    same location still running looks like (its partial file touched now too)."""
    live = bcp.open(ck).manifest.generation
    (killed,) = [g for g in generations(ck) if g != live]
    young = f"{GENERATION_PREFIX}{new_save_id()}"
    (ck / killed).rename(ck / young)
    for p in partial_files(ck):
        os.utime(p)
    return young


def test_a_save_in_progress_is_left_alone_by_gc_and_by_an_overwrite(root, capsys):
    ck = root / "last.ckpt"
    young = make_young(ck)
    partials = partial_files(root)
    assert cli_main(["gc", str(root)]) == 0
    report = capsys.readouterr().out
    assert "0 unused generation(s), 0 partial write(s)" in report
    assert "left alone: 1 unused generation(s)" in report and "younger than 3600 s" in report, report
    info = bcp.save({"w": torch.full((4096,), 3.0), "step": 3}, ck, overwrite=True)
    assert generations(ck) == sorted([young, f"{GENERATION_PREFIX}{info.save_id}"])
    assert partial_files(root) == partials  # untouched: it may still be written
    assert cli_main(["gc", str(root), "--min-age", "0"]) == 0  # once it is known dead
    assert generations(ck) == [f"{GENERATION_PREFIX}{info.save_id}"] and partial_files(root) == []


def test_a_user_file_beside_the_checkpoint_is_never_removed(root):
    ck = root / "last.ckpt"
    (ck / "notes.txt").write_text("mine")
    (root / "gen-notes").mkdir()
    (root / "gen-notes" / "x.txt").write_text("mine too")
    assert cli_main(["gc", str(root), "--min-age", "0"]) == 0
    bcp.save({"w": torch.full((4096,), 3.0), "step": 3}, ck, overwrite=True)
    assert (ck / "notes.txt").read_text() == "mine" and (root / "gen-notes" / "x.txt").read_text() == "mine too"


def test_a_directory_holding_only_a_killed_saves_partial_file_is_incomplete(root):
    """The README: a location without a manifest is IncompleteCheckpointError when
    something is there; before, a partial file alone (hidden from listings) made it
    CheckpointNotFoundError."""
    ck = root / "last.ckpt"
    live = bcp.open(ck).manifest.generation
    (ck / MANIFEST_KEY).unlink()
    shutil.rmtree(ck / live)
    assert list(backend_for(str(ck)).list("")) == [] and partial_files(ck)
    with pytest.raises(bcp.IncompleteCheckpointError, match="never committed"):
        bcp.open(ck)
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.load(first(), ck)


def test_empty_directories_are_still_not_found(tmp_path):
    (tmp_path / "ck" / "sub").mkdir(parents=True)
    with pytest.raises(bcp.CheckpointNotFoundError):
        bcp.open(tmp_path / "ck")
