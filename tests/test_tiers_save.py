"""The local tier's saving side (docs/tiers.md): placement, the local root, holding.json,
and whole jobs of simulated hosts (gloo processes with their own BCP_HOST_ID and
local directory; tests/tier_jobs.py) that save, replicate, drain, skip for room,
keep K local steps, and survive a rank killed mid-replication or mid-drain."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
import bcp.tiers.local_save
import tier_jobs
from bcp.metadata import Catalog, FileEntry, Manifest
from bcp.tiers import LocalTier
from bcp.tiers.holding import add_held, file_spans, held_files, read_holding, verify
from bcp.tiers.hosts import HostMap, replica_hosts, transfers
from bcp.tiers.local_retention import expired_steps
from bcp.tiers.paths import job_name, local_root, local_steps, step_dir
from bcp.tiers.room import host_rooms, own_record
from bcp.verify import verify_checkpoint
from helpers import assert_same

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


# -- placement (pure) -----------------------------------------------------------------------

domains_st = st.lists(st.one_of(st.none(), st.sampled_from("abc")), min_size=1, max_size=9)


@given(domains=domains_st, replicas=st.integers(0, 4), data=st.data())
def test_replicas_never_on_their_own_host_and_leave_the_domain_when_they_can(domains, replicas, data):
    host = data.draw(st.integers(0, len(domains) - 1))
    chosen = replica_hosts(domains, host, replicas)
    assert host not in chosen, "a share is never replicated to its own host"
    assert len(set(chosen)) == len(chosen) == min(replicas, len(domains) - 1)
    mine = domains[host]
    elsewhere = [h for h in range(len(domains)) if h != host and (mine is None or domains[h] != mine)]
    away = [h for h in chosen if h in elsewhere]
    # as many replicas outside the share's failure domain as there are hosts to hold them
    assert len(away) == min(replicas, len(elsewhere))
    if replicas and elsewhere:
        assert away, "a share and all its replicas in one domain although another domain exists"


@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), replicas=st.integers(0, 3))
def test_transfers_go_to_the_same_local_index_wrapping_and_never_stay_on_the_host(sizes, replicas):
    records = [(f"h{h}", None) for h, n in enumerate(sizes) for _ in range(n)]
    hosts = HostMap.from_records(records)
    plan = transfers(hosts, replicas)
    for t in plan:
        src_host, dst_host = hosts.host_of(t.src), hosts.host_of(t.dst)
        assert src_host != dst_host
        assert hosts.local_index(t.dst) == hosts.local_index(t.src) % len(hosts.ranks[dst_host])
    for rank in range(len(records)):
        assert sum(t.src == rank for t in plan) == min(replicas, len(sizes) - 1)


def test_host_map_orders_hosts_by_lowest_rank_and_indexes_ranks_within_them():
    hosts = HostMap.from_records([("b", None), ("a", "r1"), ("b", None), ("a", "r2")])
    assert hosts.hosts == ("b", "a") and hosts.ranks == ((0, 2), (1, 3))
    assert hosts.domains == (None, "r1"), "a host's domain is its first rank's"
    assert [hosts.local_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert [hosts.is_first(r) for r in range(4)] == [True, True, False, False]


# -- the local root ---------------------------------------------------------------------------


def test_job_name_is_a_safe_tail_and_a_hash_of_the_whole_uri(tmp_path):
    a, b = job_name("s3://bucket/runs/llama 7b?region=x"), job_name("s3://bucket/other/llama 7b")
    assert a.startswith("llama_7b-") and b.startswith("llama_7b-") and a != b
    assert job_name(str(tmp_path / "ck")) == job_name(f"{tmp_path}/ck/"[:-1])
    assert "/" not in job_name("gs://b/") and job_name("gs://b/").endswith(job_name("gs://b/")[-8:])
    mine = f"/dev/shm/bcp-{os.geteuid()}/{job_name('s3://bucket/runs/llama')}"  # each user's private directory
    assert local_root("/dev/shm", "s3://bucket/runs/llama") == mine


def test_a_local_root_inside_the_persistent_root_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must not nest"):
        bcp.CheckpointManager(tmp_path / "ck", tier=LocalTier(dir=tmp_path / "ck" / "shm"))


@pytest.mark.parametrize(
    "bad",
    [{"every": 0}, {"replicas": -1}, {"keep": 0}, {"persist_every": 0}, {"every": True}]
    + [{"keep_free": v} for v in (-0.1, 1, 1.5, True, "0.1")],
)
def test_local_tier_options_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LocalTier(**bad)


# -- holding.json --------------------------------------------------------------------------------


def test_holding_lists_files_added_concurrently_and_replaces_another_saves_list(tmp_path):
    d = str(tmp_path / "step")
    entries = [FileEntry(f"gen-x/data/rank{r:05d}-0.bin", r, r + 7) for r in range(16)]
    threads = [threading.Thread(target=add_held, args=(d, "x", [e])) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert held_files(d, "x") == {e.path: e for e in entries}, "a concurrent add was lost"
    assert held_files(d, "y") == {}, "a list of another save counts for nothing"
    add_held(d, "y", entries[:1])
    holding = read_holding(d)
    assert holding is not None and holding.save_id == "y" and held_files(d, "y") == {entries[0].path: entries[0]}
    assert [n for n in os.listdir(d) if "partial" in n] == []


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'["gen-x/data/rank00000-0.bin"]',  # a bare list of names
        b'{"save_id": "x", "files": {"gen-x/data/rank00000-0.bin": {"nbytes": 1, "crc32c": 2}}}',  # no format
        b'{"format": "bcp-holding", "save_id": "x", "files": ["gen-x/data/rank00000-0.bin"]}',
        b'{"format": "bcp-holding", "save_id": "x", "files": {"gen-x/data/rank00000-0.bin": {"nbytes": 1}}}',
        b'{"format": "bcp-holding", "save_id": "x", "files": {"a": {"nbytes": -1, "crc32c": 2}}}',
        b'{"format": "bcp-holding", "save_id": 7, "files": {}}',
    ],
)
def test_a_holding_not_written_by_add_held_holds_nothing_and_is_replaced(tmp_path, caplog, content):
    d = tmp_path / "step"
    d.mkdir()
    (d / "holding.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="bcp.tiers.holding"):
        assert read_holding(str(d)) is None and held_files(str(d), "x") == {}
    assert "holds nothing" in caplog.text
    entry = FileEntry("gen-x/data/rank00001-0.bin", 5, 6)
    add_held(str(d), "x", [entry])
    assert held_files(str(d), "x") == {entry.path: entry}, "the next add replaces it whole"


def test_a_holding_behind_a_link_holds_nothing(tmp_path):
    real, d = tmp_path / "real", tmp_path / "step"
    real.mkdir()
    d.mkdir()
    add_held(str(real), "x", [FileEntry("gen-x/data/rank00000-0.bin", 1, 2)])
    (d / "holding.json").symlink_to(real / "holding.json")
    assert read_holding(str(real)) is not None and read_holding(str(d)) is None


def _saved_files(uri: str) -> tuple[Manifest, dict[str, list[tuple[int, int]]]]:
    reader = bcp.open(uri)
    data = reader.backend.read(reader.manifest.catalog.path)
    catalog = Catalog.from_arrow(data, where="t", checksum_block_bytes=reader.manifest.checksum_block_bytes)
    return reader.manifest, file_spans(catalog)


def test_verify_recomputes_the_manifests_digest_and_catches_a_flipped_byte(tmp_path):
    uri = str(tmp_path / "ck")
    state = {"a": torch.arange(70000, dtype=torch.float32), "b": torch.ones(3), "tied": None}
    state["tied"] = state["a"]
    bcp.save(state, uri, checksum_block_bytes=4096)
    manifest, spans = _saved_files(uri)
    (entry,) = manifest.data_files
    path = os.path.join(uri, *entry.path.split("/"))
    assert verify(path, entry, spans, manifest.checksum_block_bytes) is None
    with open(path, "r+b") as f:
        f.seek(100000)
        byte = f.read(1)
        f.seek(100000)
        f.write(bytes([byte[0] ^ 1]))
    assert "digest" in verify(path, entry, spans, manifest.checksum_block_bytes)
    os.truncate(path, 1000)
    assert "bytes" in verify(path, entry, spans, manifest.checksum_block_bytes)


# -- one process: save, drain, retention ---------------------------------------------------------


def test_one_process_saves_locally_drains_every_m_and_keeps_k_local_steps(tmp_path, caplog):
    root, shm = tmp_path / "ck", tmp_path / "shm"
    manager = bcp.CheckpointManager(
        root, keep_last=5, tier=LocalTier(keep_free=0.0, dir=shm, every=2, persist_every=4, keep=2)
    )
    assert "each share gets 0 replica(s)" in caplog.text, "one host cannot hold a replica: said once"
    for step in range(1, 10):
        manager.save(step, tier_jobs.local_state(0, 1, step))
    manager.close()
    assert manager.steps() == [4, 8], "steps 4 and 8 drained; nothing else written to the root"
    local = local_root(shm, str(root))
    assert local_steps(local) == [6, 8], "local steps 2, 4, 6, 8 saved; the newest 2 kept"
    out = bcp.load(tier_jobs.template(), manager.uri(8))
    assert_same(out, tier_jobs.expected(8))
    with open(os.path.join(step_dir(local, 8), "manifest.json"), "rb") as f:
        assert f.read() == manager.backend.read("step_0000000008/manifest.json"), "the drain copies, byte for byte"


def test_a_local_step_whose_own_file_fails_its_check_leaves_the_older_steps(tmp_path, caplog, monkeypatch):
    """keep=1: step 2's own data file fails its check after the write (a bad disk; the
    step is then not held): step 1 is kept, with a WARNING, and a restart recovers it;
    it used to be deleted, leaving no local step to recover."""
    root, shm = tmp_path / "ck", tmp_path / "shm"
    tier = LocalTier(keep_free=0.0, dir=shm, every=1, persist_every=None, keep=1)
    manager = bcp.CheckpointManager(root, tier=tier, async_save=False)
    manager.save(1, tier_jobs.local_state(0, 1, 1))
    monkeypatch.setattr(bcp.tiers.local_save, "verify", lambda *args: "its digest is 0x0 (injected)")
    with caplog.at_level(logging.WARNING, logger="bcp"):
        manager.save(2, tier_jobs.local_state(0, 1, 2))
    monkeypatch.undo()
    manager.close()
    assert "older local steps kept" in caplog.text, caplog.text
    assert local_steps(local_root(shm, str(root))) == [1, 2]
    with bcp.CheckpointManager(root, tier=tier) as restarted:
        step, loaded = restarted.load_latest(tier_jobs.template())
    assert step == 1
    assert_same(loaded, tier_jobs.expected(1))


def test_room_keeps_the_margin_free_and_sums_the_ranks_of_a_host():
    hosts = HostMap.from_records([("a", None), ("a", None), ("b", None)])
    kept = 100  # LocalTier.keep_free of the file system, in bytes
    rooms = host_rooms(hosts, [(300, 700, kept), (300, 700, kept), (599, 700, kept)])
    assert [(r.host, r.need, r.enough) for r in rooms] == [("a", 600, True), ("b", 599, True)]
    rooms = host_rooms(hosts, [(301, 700, kept), (300, 700, kept), (601, 700, kept)])
    assert [r.enough for r in rooms] == [False, False], "600 + 100 of margin fit in 700; 601 + 100 do not"
    assert str(rooms[1]) == "host b: needs 0.0 MiB, 0.0 MiB free, keeping 0.0 MiB free (LocalTier.keep_free)"


@pytest.mark.parametrize(("keep_free", "kept"), [(0.10, 107374183), (0.0, 0), (0.5, 1 << 29)])
def test_each_rank_records_its_need_its_free_space_and_the_share_it_keeps_free(keep_free, kept):
    """own_record: need = own x (1 + replicas); kept = keep_free x the file system, rounded up."""
    assert own_record("/x", 1000, 2, keep_free, tier_jobs._FakeStatvfs(free=5 << 20, total=1 << 30)) == (
        3000,
        5 << 20,
        kept,
    )


def test_one_process_without_room_skips_the_local_save_and_saves_a_due_drain_to_the_root(tmp_path, caplog):
    root, shm = tmp_path / "ck", tmp_path / "shm"
    manager = bcp.CheckpointManager(root, tier=LocalTier(dir=shm, persist_every=2))  # keep_free: 10%
    manager._tier.statvfs = tier_jobs._FakeStatvfs(free=100 << 20, total=1 << 30)  # under the 10% margin
    manager.save(1, tier_jobs.local_state(0, 1, 1))
    manager.wait()
    assert "not enough room on 1 host(s)" in caplog.text and "this step is not saved locally" in caplog.text
    assert "keeping 102.4 MiB free (LocalTier.keep_free)" in caplog.text, "the message names the margin and its knob"
    assert manager.steps() == [] and local_steps(local_root(shm, str(root))) == []
    manager.save(2, tier_jobs.local_state(0, 1, 2))
    manager.close()
    assert manager.steps() == [2], "a drain was due: the step went to the root directly"
    assert_same(bcp.load(tier_jobs.template(), manager.uri(2)), tier_jobs.expected(2))
    manager._tier.statvfs = tier_jobs._FakeStatvfs(free=120 << 20, total=1 << 30)  # 10% of 1 GiB + the share
    manager.save(3, tier_jobs.local_state(0, 1, 3))
    manager.close()
    assert local_steps(local_root(shm, str(root))) == [3], "with room again, the local tier saves"


def test_a_smaller_keep_free_saves_locally_where_the_default_margin_would_not(tmp_path, caplog):
    """100 MiB free of 1 GiB: under the default 10%, but room enough when only 5% is kept free."""
    root, shm = tmp_path / "ck", tmp_path / "shm"
    manager = bcp.CheckpointManager(root, tier=LocalTier(dir=shm, persist_every=None, keep_free=0.05))
    manager._tier.statvfs = tier_jobs._FakeStatvfs(free=100 << 20, total=1 << 30)
    manager.save(1, tier_jobs.local_state(0, 1, 1))
    manager.close()
    assert "not enough room" not in caplog.text
    assert local_steps(local_root(shm, str(root))) == [1]


def test_retention_counts_only_steps_with_a_manifest_and_spares_pinned_ones(tmp_path):
    root = str(tmp_path)
    for s, committed in [(1, True), (2, False), (3, True), (4, True), (5, False), (6, True)]:
        os.makedirs(step_dir(root, s))
        if committed:
            open(os.path.join(step_dir(root, s), "manifest.json"), "w").close()
    assert expired_steps(root, 6, 2) == [1, 2, 3, 5]
    assert expired_steps(root, 6, 2, pinned={3}) == [1, 2, 5]
    assert expired_steps(root, 4, 2) == [1, 2], "steps newer than the one saved are not retention's"


# -- simulated hosts ---------------------------------------------------------------------------------


def _cfg(tmp_path, **kw) -> dict:
    return {"base": str(tmp_path / "hosts"), "root": str(tmp_path / "persist"), **kw}


def _host_root(cfg: dict, host: int) -> str:
    return local_root(os.path.join(cfg["base"], f"host{host}"), cfg["root"])


def _holding(cfg: dict, host: int, step: int) -> set[str]:
    holding = read_holding(step_dir(_host_root(cfg, host), step))
    return set(holding.files) if holding is not None else set()


def _check_every_listed_file(cfg: dict, hosts: int) -> int:
    """Every file any host lists is whole: its size and digest match the host's manifest. Returns how many."""
    checked = 0
    for h in range(hosts):
        for s in local_steps(_host_root(cfg, h)):
            d = step_dir(_host_root(cfg, h), s)
            if not os.path.exists(os.path.join(d, "manifest.json")):
                continue
            manifest, spans = _saved_files(d)
            entries = {e.path: e for e in manifest.data_files}
            holding = read_holding(d)
            assert holding is not None and holding.save_id == manifest.save_id
            for path, listed in holding.files.items():
                assert listed == entries[path], f"host {h} step {s} lists {path} with another size or digest"
                problem = verify(os.path.join(d, *path.split("/")), entries[path], spans, manifest.checksum_block_bytes)
                assert problem is None, f"host {h} step {s} lists {path}: {problem}"
                checked += 1
    return checked


def _data_file(rank: int, manifest: Manifest) -> str:
    return f"{manifest.generation}/data/rank{rank:05d}-0.bin"


def test_two_hosts_of_two_ranks_hold_their_shares_and_replicas_and_drain_loadable_steps(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=2, steps=[1, 2, 3, 4], persist_every=2, load_back=True)
    assert tier_jobs.run(4, cfg) == [0, 0, 0, 0], "the job, and loading its drained steps at 4 ranks, failed"
    for h in range(2):
        assert local_steps(_host_root(cfg, h)) == [3, 4], f"host {h}: the newest 2 local steps are kept"
        for s in (3, 4):
            d = step_dir(_host_root(cfg, h), s)
            manifest = bcp.open(d).manifest
            assert manifest.world_size == 4
            assert _holding(cfg, h, s) == {_data_file(r, manifest) for r in range(4)}, (
                f"host {h} step {s}: its own share and the other host's, each listed"
            )
    assert _check_every_listed_file(cfg, 2) == 16
    persistent = bcp.CheckpointManager(cfg["root"])
    assert persistent.steps() == [2, 4], "steps 2 and 4 drained, nothing else; local retention deleted none"
    for s in (2, 4):
        out = bcp.load(tier_jobs.template(), persistent.uri(s))  # world size 1, saved at 4
        assert_same(out, tier_jobs.expected(s))
    with open(os.path.join(step_dir(_host_root(cfg, 1), 4), "manifest.json"), "rb") as f:
        assert f.read() == persistent.backend.read("step_0000000004/manifest.json")


def test_a_corrupted_replica_is_never_listed(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1, 2], persist_every=2, faults={"1": "corrupt-replica"})
    assert tier_jobs.run(2, cfg) == [0, 0], "a bad replica is a warning, not a failure"
    for s in (1, 2):
        manifest = bcp.open(step_dir(_host_root(cfg, 0), s)).manifest
        assert _holding(cfg, 0, s) == {_data_file(0, manifest), _data_file(1, manifest)}
        assert _holding(cfg, 1, s) == {_data_file(1, manifest)}, "host 1 received rank 0's file corrupted"
        assert not os.path.exists(os.path.join(step_dir(_host_root(cfg, 1), s), _data_file(0, manifest)))
    assert _check_every_listed_file(cfg, 2) == 6
    out = bcp.load(tier_jobs.template(), bcp.CheckpointManager(cfg["root"]).uri(2))
    assert_same(out, tier_jobs.expected(2))


def test_no_room_on_one_host_skips_the_local_save_everywhere_and_falls_back_when_a_drain_is_due(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1, 2, 3], persist_every=2, no_room={"1": 0}, wait_each=True)
    assert tier_jobs.run(2, cfg) == [0, 0], "training goes on"
    for h in range(2):
        assert local_steps(_host_root(cfg, h)) == [], f"host {h}: nothing saved locally (host 1 lacked room)"
    with open(os.path.join(cfg["base"], "persisted_after.json")) as f:
        after = json.load(f)
    assert after == {"1": [], "2": [2], "3": [2]}, "step 1 left the root untouched; step 2 saved to it directly"
    out = bcp.load(tier_jobs.template(), bcp.CheckpointManager(cfg["root"]).uri(2))
    assert_same(out, tier_jobs.expected(2))


def _fast(cfg: dict) -> dict[str, bool]:
    with open(os.path.join(cfg["base"], "fast.json")) as f:
        return json.load(f)


def _partial_files(cfg: dict, hosts: int) -> list[str]:
    return [
        os.path.join(d, name)
        for h in range(hosts)
        for d, _dirs, names in os.walk(_host_root(cfg, h))
        for name in names
        if "partial" in name
    ]


def test_a_fast_local_save_refused_for_room_writes_nothing_and_training_goes_on(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1, 2, 3, 4], persist_every=None, no_room={"1": 0}, no_room_from=3)
    assert tier_jobs.run(2, cfg) == [0, 0], "training goes on"
    assert _fast(cfg) == {"1": False, "2": True, "3": True, "4": True}, "from the second local save on: fast"
    for h in range(2):
        assert local_steps(_host_root(cfg, h)) == [1, 2], f"host {h}: steps 3 and 4 refused before any byte"
    assert _partial_files(cfg, 2) == [], "a refused save leaves no partial file"
    assert _check_every_listed_file(cfg, 2) == 8, "steps 1 and 2: both shares held whole on both hosts"
    for s in (1, 2):
        out = bcp.load(tier_jobs.template(), step_dir(_host_root(cfg, 0), s))
        assert_same(out, tier_jobs.expected(s))


def test_a_fast_local_save_whose_layout_changed_is_skipped_and_the_next_one_plans_again(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1, 2, 3, 4, 5], persist_every=None, grow_at=3, keep=3)
    assert tier_jobs.run(2, cfg) == [0, 0]
    assert _fast(cfg) == {"1": False, "2": True, "3": True, "4": False, "5": True}, "step 3 skipped: 4 plans anew"
    for h in range(2):
        assert local_steps(_host_root(cfg, h)) == [2, 4, 5], f"host {h}: step 3 not saved, nothing half-written"
    assert _partial_files(cfg, 2) == []
    assert _check_every_listed_file(cfg, 2) == 12
    template = {**tier_jobs.template(), "extra": torch.zeros(3)}
    for s in (4, 5):
        out = bcp.load(template, step_dir(_host_root(cfg, 1), s))
        assert_same({k: v for k, v in out.items() if k != "extra"}, tier_jobs.expected(s))
        assert torch.equal(out["extra"], torch.full((3,), float(s))), f"step {s}: the new tensor"


def test_a_host_killed_mid_replication_leaves_the_step_without_that_replica(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1], persist_every=None, faults={"1": "kill-replication"}, timeout=20)
    codes = tier_jobs.run(2, cfg)
    assert codes[1] == tier_jobs.KILLED and codes[0] == tier_jobs.SURVIVED, (
        f"rank 0 must fail with an error, not hang: {codes}"
    )
    manifest = bcp.open(step_dir(_host_root(cfg, 0), 1)).manifest
    assert _data_file(0, manifest) not in _holding(cfg, 1, 1), "host 1 died receiving rank 0's file"
    assert _data_file(1, manifest) not in _holding(cfg, 0, 1), "rank 1's file never arrived whole"
    assert _data_file(0, manifest) in _holding(cfg, 0, 1)
    assert _check_every_listed_file(cfg, 2) >= 1


def test_a_rank_killed_mid_drain_leaves_no_committed_persistent_step(tmp_path):
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1], persist_every=1, faults={"1": "kill-drain"}, timeout=20)
    codes = tier_jobs.run(2, cfg)
    assert codes[1] == tier_jobs.KILLED and codes[0] == tier_jobs.SURVIVED, (
        f"rank 0 must fail with an error, not hang: {codes}"
    )
    persistent = bcp.CheckpointManager(cfg["root"], gc_grace_seconds=3600)
    assert persistent.steps() == [], "no drained step is committed"
    assert not os.path.exists(os.path.join(cfg["root"], "step_0000000001", "manifest.json"))
    manifest = bcp.open(step_dir(_host_root(cfg, 0), 1)).manifest
    assert _holding(cfg, 0, 1) == {_data_file(0, manifest), _data_file(1, manifest)}, "the local step is whole"


def test_a_rank_killed_while_the_drain_commits_leaves_the_committed_step_whole(tmp_path):
    """Found by tests/test_tiers_kill.py: the coordinator committed the drained step,
    then could not tell the killed rank, and removed the generation its manifest names."""
    cfg = _cfg(tmp_path, ranks_per_host=1, steps=[1], persist_every=1, faults={"1": "kill-drain-commit"}, timeout=20)
    codes = tier_jobs.run(2, cfg)
    assert codes[1] == tier_jobs.KILLED and codes[0] == tier_jobs.SURVIVED, f"rank 0 must fail, not hang: {codes}"
    persistent = bcp.CheckpointManager(cfg["root"], gc_grace_seconds=3600)
    assert persistent.steps() == [1], "the coordinator committed the drained step"
    report = verify_checkpoint(persistent.uri(1))
    assert report["ok"], f"a committed step lost its data: {report['problems']}"
    assert_same(bcp.load(tier_jobs.template(), persistent.uri(1)), tier_jobs.expected(1))


def test_one_process_fast_local_saves_with_overlap_hold_the_values_at_the_call(tmp_path):
    root, shm = tmp_path / "ck", tmp_path / "shm"
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    manager = bcp.CheckpointManager(root, tier=LocalTier(keep_free=0.0, dir=shm, persist_every=None, keep=3))
    manager.overlap = opt
    expected = {}
    for step in (1, 2, 3):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()["state"]}
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(step, state)
        assert manager._tier.last_fast == (step > 1), f"step {step}: the fast path from the second local save on"
        model(torch.randn(8, 64)).sum().backward()
        opt.step()  # changes the parameters right after the call: waits for their copy
    manager.close()
    local = local_root(shm, str(root))
    assert local_steps(local) == [1, 2, 3]
    for step in (1, 2, 3):
        template = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        out = bcp.load(template, step_dir(local, step), strict=False)
        assert_same(out["model"], expected[step])


def test_a_fast_local_save_never_enters_the_persistent_saver(tmp_path):
    """The local tier's fast save composes the save's phases (``bcp.save_phases``):
    from the caller's copy to the commit, on every thread, no function of
    ``bcp/saver.py`` runs (before, it re-entered six of the saver's internals)."""
    import sys

    import bcp.saver

    saver_file = bcp.saver.__file__
    manager = bcp.CheckpointManager(
        tmp_path / "ck", tier=LocalTier(keep_free=0.0, dir=tmp_path / "shm", persist_every=None, keep=3)
    )
    state = {"w": torch.arange(64.0), "step": 1}
    manager.save(1, state)  # the first local save plans as bcp.async_save does
    manager.wait()
    entered: list[str] = []

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == saver_file:
            entered.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        for step in (2, 3):
            manager.save(step, {**state, "step": step})
            assert manager._tier.last_fast, f"step {step}: the fast path"
        manager.wait()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)
    manager.close()
    assert entered == []
    local = local_root(tmp_path / "shm", str(tmp_path / "ck"))
    assert local_steps(local) == [1, 2, 3]
    assert bcp.load({"w": torch.zeros(64), "step": 0}, step_dir(local, 3))["step"] == 3
