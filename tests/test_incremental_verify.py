"""A damaged block in bytes that incremental checkpoints share is reported for every
checkpoint that uses it: ``bcp verify`` of each names the file, its owner checkpoint and
the offset, and ``bcp verify ROOT`` (``verify.verify_root``) checks every committed
checkpoint under a root reading each shared byte once."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
import bcp.verify
from bcp.backends import backend_for, join_uri
from bcp.metadata.keys import split_parent
from bcp.verify import verify_checkpoint, verify_root
from cli_runner import cli

PIECE = 256  # bytes: rows of 16 float32 values are 64 bytes, so a piece is 4 rows
NAMES = ("s1", "s2", "s3")


def _chain(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """s1 (full, with digests), s2 over s1 (one row of 'b' changed), s3 over s2 (another
    row of 'b'): most pieces of s2 and s3 are s1's bytes."""
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(32, 16, generator=g), "b": torch.randn(32, 16, generator=g)}
    saved = {}
    base = None
    for i, name in enumerate(NAMES):
        if i:
            state["b"][8 * i] += 1.0
        uri = join_uri(root, name)
        bcp.save(state, uri, piece_bytes=PIECE, **({"base": base} if base else {"incremental": True}))
        saved[name] = {k: v.clone() for k, v in state.items()}
        base = uri
    return saved


def _users(root: str, names=NAMES, sizes: dict | None = None) -> dict[tuple[str, str, int], set[str]]:
    """Each stored fragment (owner, file, offset) and the checkpoints whose catalog names
    it, from the manifests and catalogs alone (its size into ``sizes``)."""
    users: dict[tuple[str, str, int], set[str]] = {}
    sizes = {} if sizes is None else sizes
    for name in names:
        reader = bcp.open(join_uri(root, name))
        owner = {f.path: f.checkpoint or name for f in reader.manifest.data_files}
        for frag in reader.catalog.fragments:
            if frag.nbytes:
                key = (owner[frag.file], frag.file, frag.byte_offset)
                users.setdefault(key, set()).add(name)
                sizes[key] = frag.nbytes
        reader.close()
    return users


def _flip(root: str, owner: str, file: str, at: int) -> None:
    backend = backend_for(join_uri(root, owner))
    data = bytearray(backend.read(file))
    data[at] ^= 0x10
    backend.write(file, bytes(data))


@pytest.fixture
def root(uri_factory) -> str:
    return split_parent(uri_factory("run/x"))[0]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10**6), inside=st.integers(0, PIECE - 1))
def test_a_flipped_shared_byte_is_reported_by_every_checkpoint_that_uses_it(uri_factory, pick, inside):
    root = split_parent(uri_factory(f"run-{uuid.uuid4().hex[:8]}/x"))[0]  # a fresh root per example
    _chain(root)
    users = _users(root)
    shared = sorted(k for k, names in users.items() if len(names) > 1)
    assert shared, "the chain shares no bytes"
    owner, file, offset = shared[pick % len(shared)]
    _flip(root, owner, file, offset + inside % 64)
    for name in NAMES:
        problems = verify_checkpoint(join_uri(root, name))["problems"]
        if name in users[(owner, file, offset)]:
            assert len(problems) == 1, (name, problems)
            assert f"file '{file}'" in problems[0] and f"bytes [{offset}, " in problems[0], problems
            if name != owner:
                assert f"of sibling checkpoint '{owner}'" in problems[0], problems
        else:
            assert problems == [], (name, problems)
    report = verify_root(root)
    assert not report["ok"] and len(report["damaged"]) == 1, report["damaged"]
    bad = report["damaged"][0]
    assert bad["file"].endswith(f"{owner}/{file}") and bad["offset"] == offset
    assert sorted(bad["checkpoints"]) == sorted(users[(owner, file, offset)])
    assert sorted(p.split(":")[0] for p in report["problems"]) == sorted(users[(owner, file, offset)])


def test_verify_root_reads_each_shared_byte_once(root, monkeypatch):
    _chain(root)
    sizes: dict = {}
    users = _users(root, sizes=sizes)
    read: list[int] = []
    real = bcp.verify.execute_reads

    def spy(backend, plans, views, **kwargs):
        read.append(sum(len(v) for v in views))
        return real(backend, plans, views, **kwargs)

    monkeypatch.setattr(bcp.verify, "execute_reads", spy)
    report = verify_root(root)
    assert report["ok"] and [r["path"] for r in report["checkpoints"]] == list(NAMES), report
    distinct = sum(sizes.values())
    assert sum(read) == report["bytes_read"] == distinct
    each = sum(verify_checkpoint(join_uri(root, n))["bytes_read"] for n in NAMES)
    assert each > distinct, "the checkpoints share nothing: the test proves nothing"
    assert report["fragments_ok"] == report["fragments"] == sum(len(u) for u in users.values())


def test_a_retired_generation_is_checked_through_the_checkpoints_that_keep_it(root):
    _chain(root)
    users = _users(root)
    bcp.delete(join_uri(root, "s1"))  # s2 and s3 read its bytes: retired, not deleted
    held = sorted(k for k in users if k[0] == "s1" and users[k] >= {"s2", "s3"})
    owner, file, offset = held[0]
    _flip(root, owner, file, offset + 1)
    report = verify_root(root)
    assert [r["path"] for r in report["checkpoints"]] == ["s2", "s3"]
    assert [(d["offset"], d["checkpoints"]) for d in report["damaged"]] == [(offset, ["s2", "s3"])]
    assert all("of sibling checkpoint 's1'" in p for p in report["problems"]), report["problems"]


def test_cli_verify_of_a_root_prints_a_line_per_problem_and_per_damaged_block(root):
    _chain(root)
    ok = cli("verify", root)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("OK: 3 committed checkpoint(s), 0 with problems"), ok.stdout
    users = _users(root)
    owner, file, offset = next(k for k, names in sorted(users.items()) if len(names) == 3)
    _flip(root, owner, file, offset)
    bad = cli("verify", root)
    lines = bad.stdout.splitlines()
    assert bad.returncode == 1 and lines[-1].startswith("FAILED: 3 committed checkpoint(s), 3 with problems"), lines
    assert sorted(line.split(":")[0] for line in lines if line.startswith("PROBLEM")) == [f"PROBLEM {n}" for n in NAMES]
    damaged = [line for line in lines if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and damaged[0].endswith(f"{file} at byte {offset}: used by s1, s2, s3"), damaged
    as_json = cli("verify", root, "--json")
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and report["damaged"][0]["checkpoints"] == list(NAMES)
    # --all on a checkpoint that is itself a root of none: the same as a plain verify of it
    single = cli("verify", join_uri(root, "s2"), "--all")
    assert single.returncode == 1 and "1 committed checkpoint(s), 1 with problems" in single.stdout


def test_verify_root_with_no_committed_checkpoint_is_not_found(root):
    backend_for(root).write("notes.txt", b"x")
    with pytest.raises(bcp.CheckpointNotFoundError, match="holds no committed checkpoint at or below it"):
        verify_root(root)


def test_verify_root_on_s3_names_every_checkpoint_a_bad_block_affects(moto_server):
    """On S3 (moto): the root's URI carries the endpoint in its query; each checkpoint's
    and each reference's location must still be one string per stored file."""
    from conftest import new_bucket, store_uri

    root = store_uri("moto", moto_server, new_bucket(moto_server), "run")
    _chain(root)
    users = _users(root)
    owner, file, offset = next(k for k, names in sorted(users.items()) if len(names) == 3)
    assert verify_root(root)["ok"]
    _flip(root, owner, file, offset + 2)
    report = verify_root(root)
    assert [(d["offset"], d["checkpoints"]) for d in report["damaged"]] == [(offset, list(NAMES))], report["damaged"]
    assert "?" not in report["damaged"][0]["file"] and report["fragments_known"] > 0
