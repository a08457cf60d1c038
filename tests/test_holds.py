"""Retention and deletion by reference (issue 39 item 3; FORMAT.md "Holds"): every path
that deletes checkpoint bytes keeps a generation a newer checkpoint reads (retired),
and collects it once its last hold is stale. Checkpoints are written by hand
(tests/holds_helpers.py) on the file and memory backends, and S3 on moto once."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for, join_uri
from bcp.backends.memory import clear_memory_store
from bcp.cli.main import main as cli_main
from bcp.commit import new_save_id
from bcp.discovery import list_checkpoints
from bcp.holds import HoldChecker, delete_checkpoint
from bcp.metadata.keys import step_name
from bcp.retention import plan_gc, run_gc
from conftest import new_bucket, store_uri
from holds_helpers import generations, make, own_files, readable

OLD = time.time() - 7200  # older than the grace period (1 h)


def _parent(uri_factory):
    uri = uri_factory("root")
    return uri, backend_for(uri)


def test_keep_last_deleting_a_referenced_step_keeps_its_bytes_then_collects_them(uri_factory):
    _root, b = _parent(uri_factory)
    s1, s2, s3, s4 = (step_name(i) for i in (1, 2, 3, 4))
    m1 = make(b, s1)
    make(b, s2, own_files(m1, s1))  # step 2 reads step 1's file
    make(b, s3)
    run_gc(b, plan_gc(b, keep_last=2))
    assert not b.exists(f"{s1}/manifest.json")  # step 1 is deleted as a checkpoint...
    assert generations(b, s1) == {m1.generation}  # ...its generation stays whole, retired
    assert readable(b, s2) and readable(b, s3)
    plan = plan_gc(b, keep_last=2)
    assert plan.incomplete == [] and f"{s1}/{m1.generation}/" in plan.retired  # never "an incomplete save"
    make(b, s4)
    run_gc(b, plan_gc(b, keep_last=2))  # step 2, the last referrer, goes: step 1's bytes with it
    assert not b.exists(f"{s2}/manifest.json")
    assert list(b.list(f"{s1}/")) == [] and list(b.list(f"{s2}/")) == []
    assert readable(b, s3) and readable(b, s4)


def test_a_manager_keeps_a_referenced_step_and_its_referrer_loads_its_own_state(tmp_path):
    root = str(tmp_path / "run")
    b = backend_for(root)
    with bcp.CheckpointManager(root, keep_last=2) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.wait()
        m1 = bcp.open(join_uri(root, step_name(1))).manifest
        make(b, step_name(2), own_files(m1, step_name(1)))
        mgr.save(3, {"w": torch.zeros(4)})  # retention after the commit: step 1 expires, held by step 2
    assert not b.exists(f"{step_name(1)}/manifest.json")
    assert readable(b, step_name(2))
    assert generations(b, step_name(1)) == {m1.generation}
    state = {"w": torch.empty(4)}
    bcp.load(state, join_uri(root, step_name(3)))
    assert torch.equal(state["w"], torch.zeros(4))


def test_a_stale_hold_keeps_nothing_and_a_young_uncommitted_one_does(uri_factory):
    _root, b = _parent(uri_factory)
    m1 = make(b, "a")
    m2 = make(b, "b")
    make(b, "x", own_files(m1, "a"), commit=False, save_id=new_save_id(OLD))  # killed long ago
    make(b, "y", own_files(m2, "b"), commit=False)  # a save in progress
    da = delete_checkpoint(b, "a", HoldChecker(b))
    db = delete_checkpoint(b, "b", HoldChecker(b))
    assert da.deleted == [m1.generation] and da.retired == {}
    assert list(b.list("a/")) == []
    assert db.deleted == [] and [k.referrer for k in db.retired[m2.generation]] == ["y"]
    assert generations(b, "b") == {m2.generation}


def test_a_hold_of_a_referrer_committed_without_the_reference_is_stale(uri_factory):
    _root, b = _parent(uri_factory)
    m1 = make(b, "a")
    m2 = make(b, "r")  # committed, lists no file of a
    b.write(f"a/{m1.generation}/holds/r.{m2.save_id}", b"")
    assert delete_checkpoint(b, "a").retired == {}
    assert list(b.list("a/")) == []


def test_gc_deletes_stale_holds_in_live_generations(uri_factory):
    _root, b = _parent(uri_factory)
    m1 = make(b, step_name(1))
    dead = f"{step_name(1)}/{m1.generation}/holds/{step_name(5)}.{new_save_id(OLD)}"
    b.write(dead, b"")
    young = f"{step_name(1)}/{m1.generation}/holds/{step_name(6)}.{new_save_id()}"
    b.write(young, b"")
    plan = plan_gc(b)
    assert plan.stale_holds == [dead]
    run_gc(b, plan)
    assert not b.exists(dead) and b.exists(young) and readable(b, step_name(1))


def test_deleting_the_referrer_collects_the_retired_generation_at_once(uri_factory):
    _root, b = _parent(uri_factory)
    m1 = make(b, "a")
    make(b, "b", own_files(m1, "a"))
    assert delete_checkpoint(b, "a").retired  # retired: b reads it
    done = delete_checkpoint(b, "b")
    assert done.collected == [f"a/{m1.generation}"]
    assert list(b.list("")) == []


def test_the_race_a_hold_written_after_the_first_listing_keeps_the_generation(uri_factory, monkeypatch):
    """A save that wrote its hold after the deleter listed holds (but before the
    deleter's second look) is in progress: the generation stays."""
    import bcp.holds as holds_mod

    _root, b = _parent(uri_factory)
    m1 = make(b, "a")
    real = holds_mod.list_holds
    calls = []

    def listing(backend, path, generation):
        calls.append(path)
        found = real(backend, path, generation)
        if len(calls) == 1:  # the save writes its hold right after the deleter's first listing
            backend.write(f"a/{m1.generation}/holds/late.{new_save_id()}", b"")
        return found

    monkeypatch.setattr(holds_mod, "list_holds", listing)
    b.write(f"a/{m1.generation}/holds/gone.{new_save_id(OLD)}", b"")  # one stale hold, so a second look is due
    done = delete_checkpoint(b, "a")
    assert generations(b, "a") == {m1.generation} and [k.referrer for k in done.retired[m1.generation]] == ["late"]


def test_bcp_rm_names_the_keepers_and_ls_shows_own_shared_and_retired(uri_factory, capsys):
    root, b = _parent(uri_factory)
    m1 = make(b, "a", nbytes=3000)
    make(b, "b", own_files(m1, "a"))
    assert cli_main(["ls", root, "--json"]) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["b"]["shared_bytes"] == 3000 and rows["a"]["shared_bytes"] == 0
    assert rows["a"]["held_by"] == [{"checkpoint": "b", "files": 1, "bytes": 3000, "committed": True}]
    assert rows["b"]["bytes"] < 3000 < rows["a"]["bytes"]
    assert cli_main(["rm", join_uri(root, "a")]) == 0
    out = capsys.readouterr().out
    assert f"kept {m1.generation} whole (retired)" in out and "b reads 1 file(s), 2.9 KiB" in out
    assert "deleted 1 object(s) of the checkpoint" in out and "(manifest.json; generation(s) -)" in out  # kept: not
    assert readable(b, "b")
    assert cli_main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert " own " in out.splitlines()[0] and " shared " in out.splitlines()[0]
    line_a = next(ln for ln in out.splitlines() if ln.rstrip().endswith("(held by b)"))
    assert "retired" in line_a
    assert [r.status for r in list_checkpoints(b).checkpoints] == ["retired", "committed"]
    assert cli_main(["rm", join_uri(root, "b")]) == 0
    assert f"collected a/{m1.generation}" in capsys.readouterr().out
    assert list(b.list("")) == []


def test_bcp_delete_keeps_referenced_bytes(uri_factory):
    root, b = _parent(uri_factory)
    m1 = make(b, "a")
    make(b, "b", own_files(m1, "a"))
    bcp.delete(join_uri(root, "a"))
    assert not bcp.exists(join_uri(root, "a")) and readable(b, "b")
    bcp.delete(join_uri(root, "b"))
    assert list(b.list("")) == []


def test_an_overwrites_replaced_generation_stays_when_held(tmp_path):
    uri = str(tmp_path / "a")
    bcp.save({"w": torch.ones(3)}, uri)
    b = backend_for(str(tmp_path))
    m1 = bcp.open(uri).manifest
    make(b, "b", own_files(m1, "a"))
    bcp.save({"w": torch.zeros(3)}, uri, overwrite=True)
    assert m1.generation in generations(b, "a") and readable(b, "b")


def test_s3_retention_keeps_referenced_bytes(moto_server):
    b = backend_for(store_uri("moto", moto_server, new_bucket(moto_server), "run"))
    m1 = make(b, step_name(1))
    make(b, step_name(2), own_files(m1, step_name(1)))
    make(b, step_name(3))
    run_gc(b, plan_gc(b, keep_last=2))
    assert generations(b, step_name(1)) == {m1.generation} and readable(b, step_name(2))


def test_local_tier_retention_keeps_a_held_step(tmp_path):
    from bcp.tiers.local_retention import apply_retention

    root = str(tmp_path)
    b = backend_for(root)
    m1 = make(b, step_name(1))
    make(b, step_name(2), own_files(m1, step_name(1)))
    make(b, step_name(3))
    assert apply_retention(root, 3, keep=2) == [1]
    assert generations(b, step_name(1)) == {m1.generation} and readable(b, step_name(2))
    make(b, step_name(4))
    apply_retention(root, 4, keep=2)  # step 2 and, with it, what only it held
    assert list(b.list(f"{step_name(1)}/")) == [] and readable(b, step_name(3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["save", "delete", "gc", "uncommitted"]), st.integers(0, 1 << 30)),
        min_size=1,
        max_size=14,
    )
)
def test_random_saves_deletes_and_gc_keep_what_is_read_and_collect_the_rest(ops):
    """Random (save referencing random earlier kept checkpoints, delete a random one,
    gc, a killed save's old holds): every committed checkpoint stays fully readable,
    and once all is settled no generation is left that nothing holds and no committed
    checkpoint owns."""
    store = "holdsprop"
    b = backend_for(f"memory://{store}")
    try:
        live: dict[str, object] = {}
        n = 0
        for op, pick in ops:
            if op in ("save", "uncommitted"):
                bases = sorted(live)
                chosen = [bases[i] for i in range(len(bases)) if (pick >> i) & 1]
                every = [r for name in chosen for r in own_files(live[name], name)]  # type: ignore[arg-type]
                refs = list({(o, f.path): (o, f) for o, f in every}.values())  # each file once
                name = step_name(n)
                n += 1
                if op == "save":
                    live[name] = make(b, name, refs)
                else:
                    make(b, name, refs, commit=False, save_id=new_save_id(OLD))
            elif op == "delete" and live:
                name = sorted(live)[pick % len(live)]
                del live[name]
                delete_checkpoint(b, name)
            elif op == "gc":
                run_gc(b, plan_gc(b))
            for name in live:
                assert readable(b, name), name
        run_gc(b, plan_gc(b))  # settle: killed saves' holds are stale, so their bytes go
        needed = {(name, g) for name, m in live.items() for g in [m.generation]}  # type: ignore[attr-defined]
        needed |= {
            (f.checkpoint, f.path.split("/", 1)[0])
            for m in live.values()
            for f in m.references  # type: ignore[attr-defined]
        }
        present = {(k.split("/")[0], k.split("/")[1]) for k in b.list("") if k.split("/")[1].startswith("gen-")}
        assert present == needed
        for name in live:
            assert readable(b, name)
    finally:
        clear_memory_store(store)


@pytest.mark.parametrize("fail_at", range(1, 12))
def test_a_deletion_cut_at_any_file_event_leaves_every_committed_checkpoint_whole(fail_at, uri_factory):
    """Crash at the Nth delete (and then gc to settle): never a committed checkpoint
    with missing bytes."""
    from bcp.backends.wrappers import ForwardingBackend

    _root, b = _parent(uri_factory)
    m1 = make(b, "a")
    m2 = make(b, "b", own_files(m1, "a"))
    make(b, "c", own_files(m2, "b"))

    class Crash(Exception):
        pass

    class Cut(ForwardingBackend):
        count = 0

        def delete(self, key: str) -> None:
            Cut.count += 1
            if Cut.count >= fail_at:
                raise Crash(key)
            super().delete(key)

    cut = Cut(b)
    for name in ("b", "a"):
        try:
            delete_checkpoint(cut, name)
        except Crash:
            break
    for name in ("c",):
        assert readable(b, name)
    for name in ("a", "b"):
        if b.exists(f"{name}/manifest.json"):
            assert readable(b, name)


def test_a_save_keeps_holds_only_on_the_generations_it_reads(tmp_path, capsys):
    """s2's base s1 refers to s0 for ``frozen``; s2 changes ``x`` again and reads s0's
    bytes only. Its save held both generations while it decided; after its commit only
    s0's hold is left, so deleting s2 then s1 deletes s1 at once (a hold left on s1 kept
    it retired, "held by" a deleted checkpoint, for the grace period of an hour)."""
    root = tmp_path / "root"
    frozen = torch.randn(64, 64)
    opts = {"piece_bytes": 4096}
    bcp.save({"frozen": frozen, "x": torch.zeros(64, 64)}, str(root / "s0"), incremental=True, **opts)
    bcp.save({"frozen": frozen, "x": torch.ones(64, 64)}, str(root / "s1"), base=str(root / "s0"), **opts)
    bcp.save({"frozen": frozen, "x": torch.full((64, 64), 2.0)}, str(root / "s2"), base=str(root / "s1"), **opts)
    holds = sorted(p.relative_to(root).parts[0] for p in root.glob("*/gen-*/holds/s2.*"))
    assert holds == ["s0"], holds
    assert cli_main(["rm", str(root / "s2")]) == 0
    assert cli_main(["rm", str(root / "s1")]) == 0
    out = capsys.readouterr().out
    assert "retired" not in out and not (root / "s1").exists()
    state = bcp.load({"frozen": torch.zeros(64, 64), "x": torch.zeros(64, 64)}, str(root / "s0"))
    assert torch.equal(state["frozen"], frozen)


def test_gc_without_grace_deletes_a_replaced_referrers_hold_on_a_plain_checkpoint(uri_factory):
    """A hold on a checkpoint outside any manager step whose referrer is committed with
    another save (a replaced referrer's, left by an older bcp or a killed overwrite):
    young, kept by gc (a save in progress, maybe); ``--min-age 0``: deleted."""
    root, b = _parent(uri_factory)
    m1 = make(b, "a")
    make(b, "b")
    stale = f"a/{m1.generation}/holds/b.{new_save_id()}"
    b.write(stale, b"")
    assert cli_main(["gc", root]) == 0 and b.exists(stale)
    assert cli_main(["gc", root, "--min-age", "0"]) == 0 and not b.exists(stale)
    assert readable(b, "a") and readable(b, "b")


def test_an_overwrite_releases_the_holds_of_the_checkpoint_it_replaced(tmp_path, capsys):
    root = tmp_path / "root"
    frozen = torch.randn(64, 64)
    bcp.save({"f": frozen, "x": torch.zeros(64, 64)}, str(root / "s0"), incremental=True, piece_bytes=4096)
    bcp.save({"f": frozen, "x": torch.ones(64, 64)}, str(root / "s1"), base=str(root / "s0"), piece_bytes=4096)
    assert list(root.glob("s0/gen-*/holds/s1.*"))
    bcp.save({"f": frozen, "x": torch.ones(64, 64)}, str(root / "s1"), overwrite=True)  # every byte its own
    assert not list(root.glob("s0/gen-*/holds/*"))
    assert cli_main(["ls", str(root)]) == 0 and "held by" not in capsys.readouterr().out


def test_a_base_that_cannot_be_held_is_saved_in_full_and_leaves_no_hold(tmp_path, monkeypatch, caplog):
    """A base this job may read but not write (another user's, a read-only directory):
    the hold on its second generation fails, so the save writes every byte, refers to
    nothing, and deletes the hold it had already put on the first; it loads exactly."""
    import errno

    from bcp.backends.file import FileBackend

    root = tmp_path / "root"
    frozen, x = torch.randn(64, 64), torch.full((64, 64), 2.0)
    opts = {"piece_bytes": 4096}
    bcp.save({"frozen": frozen, "x": torch.zeros(64, 64)}, str(root / "s0"), incremental=True, **opts)
    bcp.save({"frozen": frozen, "x": torch.ones(64, 64)}, str(root / "s1"), base=str(root / "s0"), **opts)
    real_write = FileBackend.write

    def read_only_s0(self, key, data):
        if key.startswith("s0/") and "/holds/" in key:
            raise PermissionError(errno.EACCES, "Permission denied", key)
        return real_write(self, key, data)

    monkeypatch.setattr(FileBackend, "write", read_only_s0)
    with caplog.at_level("WARNING", logger="bcp.incremental"):
        bcp.save({"frozen": frozen, "x": x}, str(root / "s2"), base=str(root / "s1"), **opts)
    assert "cannot hold it" in caplog.text and "PermissionError" in caplog.text, caplog.text
    assert not list(root.glob("*/gen-*/holds/s2.*")), "the hold put before the failure is deleted"
    assert not bcp.open(str(root / "s2")).manifest.references, "a base not held is not referred to"
    state = bcp.load({"frozen": torch.zeros(64, 64), "x": torch.zeros(64, 64)}, str(root / "s2"))
    assert torch.equal(state["frozen"], frozen) and torch.equal(state["x"], x)
