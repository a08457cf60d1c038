"""What the conformance suite tells a backend author: a ``list`` that does not recurse
is named as the cause of the checkpoint-level failures (not another process); long
reasons are cut at a word boundary; the killed-save child runs the installed bcp
whatever the current directory holds, and its hints point the right way."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends import registry
from bcp.conformance.checkpoint_contract import CheckpointContractTests, listing_problem
from bcp.conformance.pytest_plugin import _failure_line
from bcp.conformance.report import WHY_LIMIT, shorten
from broken_backends import FlatListBackend
from side_by_side import SideBySide
from test_cli_plugins import FILE_PLUGIN, write_plugin
from test_conformance_suite import cli_argv, cli_env

# -- the module's own child processes, started side by side ---------------------------------------
#
# `bcp conformance` on a broken backend and a killed-save child given another bcp each import
# torch in a child of their own: both start when the first test that starts children here
# does (the killed-save checks below), and run beside it; each test checks its child's result
# as it did when it ran the child itself (tests/side_by_side.py).


class Children(NamedTuple):
    runs: SideBySide
    cause_dir: Path
    other_bcp: Path


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> Iterator[Children]:
    cause_dir = tmp_path_factory.mktemp("cause")
    other = tmp_path_factory.mktemp("other")
    runs = SideBySide(workers=2)
    runs.submit(
        "cause",
        cli_argv(
            *(f"broken-flatlist://l{uuid.uuid4().hex[:6]}/root", "--quick", "--import", "broken_backends"),
            *("-k", "list_is_recursive or round_trip or sub_uri", "--json", str(cause_dir / "r.json")),
        ),
        cwd=cause_dir,
        env=cli_env(),
        timeout=600,
    )
    options = json.dumps({"bcp": str(other / "elsewhere" / "bcp")})
    runs.submit(
        "other-bcp",
        [sys.executable, "-P", "-m", "bcp.conformance.killed_save", f"{other}/ck", options],
        cwd=os.getcwd(),  # the test's, as before: not what a later test monkeypatches
        env=dict(os.environ),
        timeout=120,
    )
    yield Children(runs, cause_dir, other)
    runs.close()


# -- a list() that does not recurse -------------------------------------------------------------


def test_the_checkpoint_checks_name_a_list_that_does_not_recurse():
    problem = listing_problem(f"broken-flatlist://l{uuid.uuid4().hex[:6]}/root")
    assert problem is not None and problem.startswith("list() did not return nested keys: see test_list_is_recursive")
    assert "another process" not in problem
    assert listing_problem(f"memory://l{uuid.uuid4().hex[:6]}/root") is None


def test_a_save_through_a_list_that_does_not_recurse_blames_list_not_another_process():
    backend = FlatListBackend.from_uri(f"broken-flatlist://l{uuid.uuid4().hex[:6]}/ck")
    with pytest.raises(bcp.IncompleteCheckpointError) as caught:
        bcp.save({"w": torch.ones(4)}, backend)
    message = str(caught.value)
    assert "list(" in message and "test_list_is_recursive" in message and "nested keys" in message, message
    assert "another process" not in message


def test_objects_deleted_by_another_process_are_still_reported_as_such():
    """The list() diagnosis applies only when the missing objects exist."""
    from bcp.backends.memory import MemoryBackend
    from bcp.commit import check_generation_intact

    backend = MemoryBackend.from_uri(f"memory://l{uuid.uuid4().hex[:6]}/ck")
    backend.write("gen-1/data/a.bin", b"x")
    with pytest.raises(bcp.IncompleteCheckpointError, match="another process"):
        check_generation_intact(backend, "gen-1", ["gen-1/data/a.bin", "gen-1/data/b.bin"])


# -- long reasons -------------------------------------------------------------------------------


@given(st.text(alphabet=st.sampled_from("ab cd,;é\t"), max_size=3 * WHY_LIMIT), st.integers(20, 2 * WHY_LIMIT))
def test_shorten_cuts_only_at_a_word_boundary(text: str, limit: int):
    got = shorten(text, limit)
    assert len(got) <= limit
    if len(text) <= limit:
        assert got == text
        return
    assert got.endswith(" ...")
    head = got.removesuffix(" ...")
    assert text.startswith(head)
    if text.rfind(" ", 1, limit - len(" ...") + 1) > 0:  # a word boundary fits: the cut is at one
        assert text[len(head)] in " ,;:", f"cut inside a word: {head[-10:]!r}|{text[len(head) : len(head) + 10]!r}"


def test_a_long_failure_message_is_cut_at_a_word_boundary_with_an_ellipsis():
    words = " ".join(f"word{i:04d}" for i in range(400))  # about 3600 characters
    report = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message=f"AssertionError: {words}")))
    why = _failure_line(report)
    assert why.endswith(" ...") and len(why) <= WHY_LIMIT
    last = why.removesuffix(" ...").rsplit(" ", 1)[-1]
    assert len(last) == len("word0000") and last.startswith("word"), f"cut mid-word: {last!r}"
    short = "x " * 200  # 400 characters: what the old 300-character cut broke
    report.longrepr.reprcrash.message = short
    assert _failure_line(report) == short.strip()


# -- the killed-save child and the current directory ----------------------------------------------


def _fake_bcp(directory: Path) -> None:
    """A ``bcp/`` folder that is not bcp (a clone, an old copy): importing it fails loudly."""
    (directory / "bcp").mkdir()
    (directory / "bcp" / "__init__.py").write_text("raise ImportError('the fake bcp/ folder was imported')\n")


@pytest.mark.subprocess  # _kill_midway starts the child, out of sight of tests/conftest.py
def test_the_child_imports_the_installed_bcp_beside_a_bcp_folder(tmp_path, monkeypatch, children):
    """A plugin next to a ``bcp/`` folder, run from that directory: the child must
    still import the installed bcp (not the folder), and the plugin."""
    module, scheme = write_plugin(tmp_path, FILE_PLUGIN)
    _fake_bcp(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "_imported_plugins", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    registry.import_plugins([module])  # as `bcp conformance --import MODULE` does: cwd is searched
    # The plugin's directory (the cwd, with bcp/ in it) is what the child must search for it.
    CheckpointContractTests()._kill_midway(f"{scheme}://{tmp_path}/ck", overwrite=False)


@pytest.mark.subprocess  # _kill_midway starts the child, out of sight of tests/conftest.py
def test_a_bcp_shadowing_the_installed_one_on_pythonpath_is_named_in_the_hint(tmp_path, monkeypatch, children):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "bcp").mkdir()
    (shadow / "bcp" / "__init__.py").write_text("")  # a folder with no conformance inside
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    monkeypatch.setattr(registry, "_imported_plugins", [])
    with pytest.raises(AssertionError) as caught:
        CheckpointContractTests()._kill_midway(f"{tmp_path}/ck", overwrite=False)
    first = str(caught.value).splitlines()[0]
    # Where the shadow lacks the suite, the child cannot start it (No module named
    # 'bcp.conformance'); where an import hook still finds it, the child sees its bcp is
    # not the parent's. Either way the first line says PYTHONPATH, and the shadow.
    assert "PYTHONPATH" in first and ("No module named 'bcp" in first or str(shadow) in first), first
    assert "--import" not in first, f"the hint points at --import for a shadowed bcp: {first}"


def test_the_child_refuses_a_bcp_other_than_the_parents(children: Children):
    """If another bcp with the same modules were imported, the child says so and stops."""
    proc = children.runs.result("other-bcp")
    assert proc.returncode != 0 and "WRITING" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert "this child imported bcp from" in last and str(children.other_bcp / "elsewhere") in last, last


@pytest.mark.slow
def test_bcp_conformance_reports_the_cause_on_every_checkpoint_check(children: Children):
    proc = children.runs.result("cause")
    report = children.cause_dir / "r.json"
    assert proc.returncode == 1
    checks = {c["name"]: c for cs in json.loads(report.read_text())["groups"].values() for c in cs}
    assert checks["test_list_is_recursive"]["outcome"] == "failed"
    for name in ("test_save_load_round_trip", "test_sub_uri_sees_the_roots_objects_under_sub"):
        why = checks[name]["why"]
        assert why.startswith("list() did not return nested keys: see test_list_is_recursive"), why
        assert why.endswith("until list() recurses"), f"the reason was cut: {why}"
    assert "FAIL test_save_load_round_trip: list() did not return nested keys" in proc.stdout


def test_every_test_here_that_starts_the_killed_save_child_is_marked_subprocess():
    """tests/conftest.py sees ``subprocess`` only in a test's own code: a child started
    by the library (``_kill_midway``) needs the marker by hand, or it runs (2 s each)
    in the fast tier."""
    starting = [
        fn for name, fn in globals().items() if name.startswith("test_") and "_kill_midway" in fn.__code__.co_names
    ]
    assert len(starting) == 2, [f.__name__ for f in starting]
    for fn in starting:
        assert "subprocess" in {m.name for m in getattr(fn, "pytestmark", [])}, fn.__name__
