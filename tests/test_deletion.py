"""bcp.delete and bcp.exists: bcp rm's rules as a library call (file, memory://, S3 on moto)."""

from __future__ import annotations

import os
import re
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends.memory import clear_memory_store
from conftest import new_bucket, store_uri

STATE = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}


def _bcp_key(key: str) -> bool:
    """The rule of docs/manager.md (`bcp rm`): manifest.json and everything under a gen-<hex>/
    directory (a user's gen-mine/ is not bcp's)."""
    head = key.split("/", 1)[0]
    return key == "manifest.json" or (re.fullmatch("gen-[0-9a-f]+", head) is not None and "/" in key)


def _empty_dirs(root: str) -> list[str]:
    return [d for d, subdirs, files in os.walk(root) if not subdirs and not files]


def test_delete_removes_the_checkpoint_and_exists_follows(uri):
    assert not bcp.exists(uri)
    bcp.save(STATE, uri)
    assert bcp.exists(uri)
    assert bcp.delete(uri) == []
    assert not bcp.exists(uri)
    assert list(backend_for(uri).list("")) == []
    if "://" not in uri:
        assert not os.path.exists(uri)  # no empty directory left, the checkpoint's own included


def test_delete_leaves_foreign_objects(uri):
    bcp.save(STATE, uri)
    backend = backend_for(uri)
    backend.write("notes.txt", b"mine")
    backend.write("logs/run1/events", b"also mine")
    left = bcp.delete(uri)
    assert left == ["logs/run1/events", "notes.txt"]
    assert sorted(backend.list("")) == left
    assert backend.read("notes.txt") == b"mine"
    if "://" not in uri:
        assert _empty_dirs(uri) == []


def test_delete_refuses_nothing_and_uncommitted(uri):
    with pytest.raises(bcp.CheckpointNotFoundError, match="nothing is there"):
        bcp.delete(uri)
    assert bcp.delete(uri, missing_ok=True) == []
    backend = backend_for(uri)
    backend.write("data.bin", b"x")
    with pytest.raises(bcp.IncompleteCheckpointError, match="not a committed bcp checkpoint"):
        bcp.delete(uri)
    assert list(backend.list("")) == ["data.bin"]  # a refusal deletes nothing
    assert not bcp.exists(uri)


def test_delete_uncommitted_removes_only_generations(uri):
    bcp.save(STATE, uri)
    backend = backend_for(uri)
    backend.delete("manifest.json")  # a save that never committed: generations, no manifest
    backend.write("keep.txt", b"k")
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.delete(uri)
    assert bcp.delete(uri, uncommitted=True) == ["keep.txt"]
    assert list(backend.list("")) == ["keep.txt"]


def test_delete_refuses_a_symbolic_link(tmp_path):
    real = tmp_path / "real"
    bcp.save(STATE, str(real))
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(bcp.CheckpointError, match="symbolic link"):
        bcp.delete(str(link))
    assert bcp.exists(str(real)) and bcp.exists(str(link))


def test_delete_refuses_a_file(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"a torch.save file")
    assert not bcp.exists(str(path))
    for missing_ok in (False, True):
        with pytest.raises(bcp.CheckpointError, match="is a file, not a bcp checkpoint"):
            bcp.delete(str(path), missing_ok=missing_ok)
    assert path.read_bytes() == b"a torch.save file"


def test_delete_on_s3(moto_server):
    uri = store_uri("moto", moto_server, new_bucket(moto_server), f"ckpt-{uuid.uuid4().hex[:8]}")
    bcp.save(STATE, uri)
    backend = backend_for(uri)
    backend.write("README", b"foreign")
    assert bcp.exists(uri)
    assert bcp.delete(uri) == ["README"]
    assert not bcp.exists(uri)
    assert list(backend.list("")) == ["README"]
    out = {"w": torch.zeros(3, 4), "step": 0}
    with pytest.raises(bcp.CheckpointError):
        bcp.load(out, uri)


_SEGMENT = st.sampled_from(["gen-", "gen-0a", "gen-x", "gen-mine", "manifest.json", "m", "data", "a.b", "gen"])
_KEY = st.lists(_SEGMENT, min_size=1, max_size=3).map("/".join)


@given(foreign=st.sets(_KEY, max_size=6), backend_kind=st.sampled_from(["file", "memory"]))
def test_delete_deletes_exactly_the_bcp_objects(tmp_path_factory, foreign, backend_kind):
    """Whatever else sits at the location, bcp.delete removes manifest.json and gen-*/ and
    nothing else, and leaves no empty directory behind."""
    if backend_kind == "file":
        uri = str(tmp_path_factory.mktemp("del") / "ckpt")
    else:
        store = f"d{uuid.uuid4().hex[:10]}"
        uri = f"memory://{store}/ckpt"
    try:
        bcp.save(STATE, uri)
        backend = backend_for(uri)
        present = set(backend.list(""))
        for key in sorted(foreign):
            if key in present or any(key.startswith(p + "/") or p.startswith(key + "/") for p in present):
                continue  # one path cannot be both a file and a directory
            backend.write(key, b"f")
            present.add(key)
        expected = sorted(k for k in present if not _bcp_key(k))
        assert bcp.delete(uri) == expected
        assert sorted(backend.list("")) == expected
        assert not bcp.exists(uri)
        if backend_kind == "file":
            if expected:
                assert _empty_dirs(uri) == []
            else:
                assert not os.path.exists(uri)
    finally:
        if backend_kind == "memory":
            clear_memory_store(store)
