"""The manager's metrics records (bcp.metrics) where they come from the local tier
(saves to it and recoveries from it, one process and simulated hosts of gloo ranks)
and where storage requests were really retried (a real S3 server behind
tests/netproxy.py). The records of plain persistent saves and loads, and the
adapters, are tested in tests/test_trace.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import types

import pytest
import torch

import bcp
import tier_jobs
from bcp import LocalTier
from bcp.backends import backend_for
from bcp.benchmark import storage_speed
from bcp.cli import main as cli_main
from bcp.metadata.keys import data_file_key
from bcp.tiers.paths import local_root, step_dir
from conftest import new_bucket, store_uri
from helpers import assert_same
from netproxy import proxied, read_stats


def tensor_bytes(state: dict) -> int:
    """The tensor bytes of a state (TensorShard: its local part), what a load of it reads."""
    total = 0
    for value in state.values():
        local = value.local if isinstance(value, bcp.TensorShard) else value
        if isinstance(local, torch.Tensor):
            total += local.numel() * local.element_size()
    return total


def written_by(directory: str, rank: int) -> int:
    """The size of ``rank``'s data file in the checkpoint at ``directory`` (its manifest's entry)."""
    manifest = bcp.open(directory).manifest
    (entry,) = [f for f in manifest.data_files if f.path == data_file_key(manifest.generation, rank)]
    return entry.nbytes


def check_plausible(record: bcp.MetricsRecord) -> None:
    assert 0 < record.blocking_seconds <= record.total_seconds < 60, record
    assert record.bytes > 0 and record.retries == 0, record
    assert all(gbps > 0 for gbps in record.gbps.values()), record


# -- the local tier, one process ---------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_local_tier_saves_and_each_load_give_one_record(tmp_path, capsys, async_save):
    root, shm = str(tmp_path / "ck"), tmp_path / "shm"
    tier = LocalTier(keep_free=0.0, dir=shm, every=1, persist_every=2, keep=3)
    records: list[bcp.MetricsRecord] = []
    infos = []
    with bcp.CheckpointManager(root, tier=tier, async_save=async_save, metrics=records.append) as manager:
        for step in (1, 2, 3):
            infos.append(manager.save(step, tier_jobs.local_state(0, 1, step)))
            # a synchronous save's record comes with it; an async one's when it completes: at the next save
            assert [r.step for r in records] == list(range(1, step + (not async_save)))
    assert manager.steps() == [2], "step 2 drained to the root; the others stayed local"
    assert [(r.kind, r.step, r.tier) for r in records] == [("save", s, "local") for s in (1, 2, 3)]
    local = local_root(shm, root)
    for record in records:
        check_plausible(record)
        assert record.bytes == written_by(step_dir(local, record.step), 0), "the bytes of the local data file"
        assert {"checksum", "write"} <= set(record.gbps)
        if not async_save:  # the call waited for the local save and its replication
            info = infos[record.step - 1]
            assert record.blocking_seconds == record.total_seconds >= info.seconds
            assert record.bytes == info.rank_bytes_written

    # a restart: step 3 is newer locally than the root's 2; recovered from the local tier, traced on request
    records.clear()
    template = tier_jobs.template()
    manager = bcp.CheckpointManager(root, tier=tier, metrics=records.append)
    step, loaded = manager.load_latest(template, trace=tmp_path / "trace")
    assert step == 3
    assert_same(loaded, tier_jobs.expected(3))
    (record,) = records
    assert (record.kind, record.step, record.tier) == ("load", 3, "local")
    check_plausible(record)
    assert record.blocking_seconds == record.total_seconds
    assert record.bytes == tensor_bytes(template) == bcp.load_with_info(template, step_dir(local, 3)).bytes_read
    assert {"recover", "load", "fetch", "verify"} <= set(record.gbps)
    assert "exchange" not in record.gbps, "one host holds everything: nothing came from a peer"

    # the recovery is an operation of its own in the trace directory, with the load's stages in it
    assert cli_main(["trace", str(tmp_path / "trace"), "--json", "--op", "recover-"]) == 0
    (op,) = json.loads(capsys.readouterr().out)["operations"]
    assert op["kind"] == "recover" and op["ranks"] == [0]
    stages = {s["stage"] for s in op["stages"]}
    assert {"recover", "inventory", "metadata", "load", "fetch"} <= stages
    # the host holds every file: a plain load from the local step, from the metadata the
    # recovery read (no exchange, no recovery directory, no second catalog read)
    assert not stages & {"exchange", "prepare", "match", "catalog"}, stages

    # the local tier lost: the root's step 2, one record, tier persistent
    records.clear()
    shutil.rmtree(local)
    step, loaded = bcp.CheckpointManager(root, tier=tier, metrics=records.append).load_latest(template)
    assert step == 2
    assert_same(loaded, tier_jobs.expected(2))
    (record,) = records
    assert (record.kind, record.step, record.tier) == ("load", 2, "persistent")
    check_plausible(record)
    assert record.bytes == tensor_bytes(template)

    # nothing anywhere: no load, no record
    records.clear()
    shutil.rmtree(root)
    assert bcp.CheckpointManager(root, tier=tier, metrics=records.append).load_latest(template)[0] is None
    assert records == []


# -- the local tier, simulated hosts ------------------------------------------------------------


def _records(cfg: dict, rank: int) -> list[dict]:
    with open(os.path.join(cfg["base"], f"metrics-rank{rank}.json")) as f:
        return json.load(f)


@pytest.mark.slow  # about 3-6 s on 2 cores: out of the fast tier
def test_simulated_hosts_record_local_saves_and_a_recovery_through_peers(tmp_path):
    """Two hosts of one rank, no replicas: each rank's local save record counts its own
    data file; restarted with the hosts swapped, each rank's shard is on the other host,
    and its recovery record shows the bytes that came from the peer."""
    cfg = {
        "base": str(tmp_path / "hosts"),
        "root": str(tmp_path / "persist"),
        "host_of_rank": ["host0", "host1"],
        "replicas": 0,
        "steps": [1, 2, 3],
        "persist_every": 2,
        "keep": 3,
        "metrics": True,
    }
    assert tier_jobs.run(2, cfg) == [0, 0]
    for rank in range(2):
        records = _records(cfg, rank)
        assert [(r["kind"], r["step"], r["tier"]) for r in records] == [("save", s, "local") for s in (1, 2, 3)]
        host_root = local_root(os.path.join(cfg["base"], f"host{rank}"), cfg["root"])
        for r in records:
            check_plausible(bcp.MetricsRecord(**r))
            assert r["bytes"] == written_by(step_dir(host_root, r["step"]), rank), f"rank {rank} step {r['step']}"

    swapped = {**cfg, "host_of_rank": ["host1", "host0"], "recover": True, "steps": []}
    assert tier_jobs.run(2, swapped) == [0, 0]
    for rank in range(2):
        with open(os.path.join(cfg["base"], f"recovered-rank{rank}.json")) as f:
            assert json.load(f) == {"step": 3, "run": 0}, "the local step 3, bit for bit"
        (record,) = _records(cfg, rank)
        assert (record["kind"], record["step"], record["tier"]) == ("load", 3, "local")
        check_plausible(bcp.MetricsRecord(**record))
        assert record["bytes"] == tensor_bytes(tier_jobs.local_state(rank, 2, 3))
        assert record["gbps"]["exchange"] > 0, "the rank's shard came from the other host"


# -- retries: a real S3 server answering 503 SlowDown through the fault proxy ---------------------


def _via(endpoint: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(endpoint=endpoint)


def _retried(caplog: pytest.LogCaptureFixture) -> int:
    """The retries the backends' retry loop logged (one INFO line before each new attempt)."""
    return sum(1 for r in caplog.records if r.name == "bcp.backends.retry" and "; attempt " in r.getMessage())


def test_retries_count_the_requests_the_store_throttled(moto_server, tmp_path, caplog):
    """The proxy answers the first N requests for data files 503 SlowDown; the backend
    retries each; the save's and the load's records count exactly those retries."""
    bucket = new_bucket(moto_server)
    state = {"w": torch.randn(1000, 64, generator=torch.Generator().manual_seed(3)), "step": 7}
    fast = {"retry_base_delay": "0.01", "retry_max_delay": "0.05"}
    records: list[bcp.MetricsRecord] = []
    caplog.set_level(logging.INFO, logger="bcp.backends.retry")
    save_stats, load_stats = tmp_path / "save.json", tmp_path / "load.json"
    with proxied(moto_server.endpoint, stats=save_stats, slowdown_first=2, path="/data/rank") as endpoint:
        uri = store_uri("moto", _via(endpoint), bucket, "run", **fast)
        with bcp.CheckpointManager(uri, async_save=True, metrics=records.append) as manager:
            manager.save(1, state)
    saved_retries = _retried(caplog)
    caplog.clear()
    with proxied(moto_server.endpoint, stats=load_stats, slowdown_first=3, path="/data/rank") as endpoint:
        uri = store_uri("moto", _via(endpoint), bucket, "run", **fast)
        manager = bcp.CheckpointManager(uri, metrics=records.append)
        step, loaded = manager.load_latest({"w": torch.zeros(1000, 64), "step": 0})
    assert step == 1 and torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    assert [(r.kind, r.step, r.tier) for r in records] == [("save", 1, "persistent"), ("load", 1, "persistent")]
    save, load = records
    assert read_stats(save_stats).slowdown == saved_retries == save.retries == 2
    assert read_stats(load_stats).slowdown == _retried(caplog) == load.retries == 3
    assert save.bytes > 0 and load.bytes == 1000 * 64 * 4


def test_storage_speed_of_an_object_store_is_the_networks(moto_server):
    """``bcp trace --measure s3://...``: a real multipart upload and ranged reads, then nothing left behind."""
    bucket = new_bucket(moto_server)
    uri = store_uri("moto", moto_server, bucket, "speed")
    speed = storage_speed(uri, nbytes=6 << 20)
    assert speed.kind == "network" and speed.nbytes == 10 << 20, "whole 5 MiB parts"
    assert speed.write_gbps > 0 and speed.read_gbps > 0
    backend = backend_for(uri)
    assert list(backend.list()) == [] and backend.unwrap().pending_uploads() == []


def test_storage_speed_on_a_new_local_directory_leaves_the_disk_as_it_was(tmp_path):
    """``bcp trace --measure /new/dir``: the directories the measurement had to make go again."""
    target = tmp_path / "new" / "dir"
    speed = storage_speed(str(target), nbytes=1 << 20)
    assert speed.kind == "disk" and speed.nbytes >= 1 << 20
    assert list(tmp_path.iterdir()) == []
