"""``bcp ls`` finds checkpoints however they are laid out under a root: the root
itself, a manager's steps, plain and nested subdirectories; bounded in depth and in
the objects it lists."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.discovery import FIND_MAX_DEPTH, checkpoint_prefix_of, find_checkpoints
from bcp.metadata.keys import data_file_key, generation_name, step_name
from helpers import examples


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


def save_incomplete(uri: str) -> None:
    """What a killed save leaves: a generation's data, no manifest."""
    backend_for(uri).write(data_file_key(generation_name("0dead"), 0), b"partial")


def test_readme_layout_of_plain_saves_is_listed(tmp_path):
    root = tmp_path / "ckpt"
    for step in (100, 200):
        bcp.save({"w": torch.full((4,), float(step))}, str(root / f"step{step}"))
    save_incomplete(str(root / "step300"))
    proc = cli("ls", str(root))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[-1]: line.split() for line in proc.stdout.splitlines()[1:]}
    assert set(rows) == {"step100", "step200", "step300"}, proc.stdout
    assert rows["step100"][1] == "committed" and "directory" in rows["step100"]
    assert rows["step300"][1] == "incomplete"
    data = json.loads(cli("ls", str(root), "--json").stdout)
    assert [(r["path"], r["kind"], r["status"]) for r in data] == [
        ("step100", "directory", "committed"),
        ("step200", "directory", "committed"),
        ("step300", "directory", "incomplete"),
    ]


def test_root_that_is_a_checkpoint_is_listed_as_root(tmp_path):
    bcp.save({"w": torch.ones(3)}, str(tmp_path / "ck"))
    data = json.loads(cli("ls", str(tmp_path / "ck"), "--json").stdout)
    assert [(r["path"], r["kind"], r["status"]) for r in data] == [("", "root", "committed")]
    assert "  root  " in cli("ls", str(tmp_path / "ck")).stdout


def test_manager_steps_nested_below_the_root_each_have_their_latest(tmp_path):
    for run, steps in (("runA", (1, 2)), ("runB", (7,))):
        manager = bcp.CheckpointManager(str(tmp_path / run), async_save=False)
        for step in steps:
            manager.save(step, {"w": torch.ones(2) * step})
    data = json.loads(cli("ls", str(tmp_path), "--json").stdout)
    assert [(r["path"], r["kind"], r["step"], r["latest"]) for r in data] == [
        (f"runA/{step_name(1)}", "step", 1, False),
        (f"runA/{step_name(2)}", "step", 2, True),
        (f"runB/{step_name(7)}", "step", 7, True),
    ]


# -- find_checkpoints on any layout (memory:// keeps it fast) ------------------------------------

NAMES = st.sampled_from(["a", "b", "run", "step_0000000003", "step_0000000012", "x.y"])
LOCATIONS = st.lists(NAMES, min_size=0, max_size=FIND_MAX_DEPTH + 1).map("/".join)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.dictionaries(LOCATIONS, st.booleans(), max_size=6), stray=st.lists(LOCATIONS, max_size=3))
def test_every_checkpoint_within_the_depth_is_found_and_nothing_else(layout, stray):
    """``layout``: location -> committed. ``stray``: objects that are not bcp's."""
    root = f"memory://ls-{uuid.uuid4().hex[:10]}/root"
    backend = backend_for(root)
    for location, committed in layout.items():
        uri = f"{root}/{location}" if location else root
        if committed:
            bcp.save({"w": torch.ones(2)}, uri)
        else:
            save_incomplete(uri)
    for location in stray:
        backend.write(f"{location}/notes.txt" if location else "notes.txt", b"not a checkpoint")
    found = find_checkpoints(backend, sizes=True)
    want = {loc: c for loc, c in layout.items() if (loc.count("/") + 1 if loc else 0) <= FIND_MAX_DEPTH}
    assert {c.path: c.committed for c in found.checkpoints} == want
    assert not found.truncated
    for c in found.checkpoints:
        name = c.path.rsplit("/", 1)[-1]
        expected_kind = "root" if not c.path else "step" if name.startswith("step_") else "directory"
        assert c.kind == expected_kind, c
        assert (c.step is not None) == (c.kind == "step")
        assert c.objects > 0 and c.bytes > 0
    backend.delete_prefix("")


def test_checkpoints_deeper_than_the_limit_are_not_reported(tmp_path):
    deep = "/".join(["d"] * (FIND_MAX_DEPTH + 1))
    bcp.save({"w": torch.ones(2)}, f"{tmp_path}/{deep}")
    bcp.save({"w": torch.ones(2)}, f"{tmp_path}/d")
    assert [c.path for c in find_checkpoints(backend_for(str(tmp_path))).checkpoints] == ["d"]
    assert [r["path"] for r in json.loads(cli("ls", str(tmp_path), "--json").stdout)] == ["d"]
    assert [r["path"] for r in json.loads(cli("ls", f"{tmp_path}/d", "--json").stdout)] == ["", deep[2:]]


def test_empty_root_says_how_deep_it_looked(tmp_path):
    proc = cli("ls", str(tmp_path))
    assert proc.stdout.strip() == f"no checkpoints under {tmp_path} (looked {FIND_MAX_DEPTH} levels deep)"


def test_listing_stops_at_the_object_limit_and_says_so():
    backend = backend_for(f"memory://ls-{uuid.uuid4().hex[:10]}/root")
    for i in range(5):
        bcp.save({"w": torch.ones(2)}, backend_for(f"{backend.uri}/c{i}"))
    result = find_checkpoints(backend, max_objects=4)
    assert result.truncated and sum(c.objects for c in result.checkpoints) == 4
    assert not find_checkpoints(backend).truncated
    backend.delete_prefix("")


@given(st.lists(NAMES, max_size=5), st.sampled_from(["manifest.json", "gen-1/data/r.bin", "notes.txt"]))
def test_prefix_of_a_key(parts, tail):
    location = "/".join(parts)
    key = f"{location}/{tail}" if location else tail
    got = checkpoint_prefix_of(key)
    if tail == "notes.txt" or len(parts) > FIND_MAX_DEPTH:
        assert got is None
    else:
        assert got == location


def test_a_save_that_left_only_a_partial_file_is_incomplete(tmp_path):
    """A save killed in its first write leaves no listed object, only a partial file."""
    backend = backend_for(str(tmp_path))
    writer = backend.open_writer(f"run/ck/{data_file_key(generation_name('0dead'), 0)}", size=4)
    writer.write_at(0, b"part")
    try:
        assert list(backend.list("")) == [], "the partial file is listed"
        found = find_checkpoints(backend)
        assert [(c.path, c.kind, c.committed) for c in found.checkpoints] == [("run/ck", "directory", False)]
        assert find_checkpoints(backend, max_objects=0).truncated, "the walk of partial files is not bounded"
    finally:
        writer.abort()
