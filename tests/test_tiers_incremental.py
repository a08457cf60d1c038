"""Incremental local steps and drains (``LocalTier(incremental=True)``; docs/tiers.md,
"Incremental local steps"): 4 gloo ranks on 2 simulated hosts save steps 0-5 of a
state whose ``frozen`` tensor never changes and whose ``slow`` one changes at step 1
only; then recoveries at the same and another world size, with a host lost, and from
the persistent root alone."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import tier_jobs
from bcp.metadata import FileEntry, Manifest
from bcp.metadata.keys import MANIFEST_KEY, step_name
from bcp.tiers.incremental_local import held_size
from bcp.tiers.paths import local_root

FROZEN_BYTES = tier_jobs.FROZEN_SHAPE[0] * tier_jobs.FROZEN_SHAPE[1] * 4


def _cfg(base: str) -> dict:
    return {
        "base": base,
        "root": os.path.join(base, "root"),
        "ranks_per_host": 2,
        "replicas": 1,
        "persist_every": 2,
        "keep": 2,
        "incremental": True,
        "frozen": True,
        "count_uploads": True,
        "chunk_bytes": 1 << 16,
        "steps": list(range(6)),
        "load_back": True,  # every drained step loads exactly from the persistent root (asserted in the job)
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = str(tmp_path_factory.mktemp("incremental-tier"))
    cfg = _cfg(base)
    codes = tier_jobs.run(4, cfg, timeout=120)
    assert codes == [0] * 4, f"the incremental tier job failed: {codes}"
    shutil.copytree(base, base + "-saved", symlinks=True)
    return cfg


def _copy(saved: dict, _tmp_path) -> dict:
    """The saved job's tree as it was (local roots are named after the root's path: restored in place)."""
    shutil.rmtree(saved["base"])
    shutil.copytree(saved["base"] + "-saved", saved["base"], symlinks=True)
    return {**saved, "count_uploads": False}


def _manifest(path: str) -> Manifest:
    with open(os.path.join(path, MANIFEST_KEY), "rb") as f:
        return Manifest.from_json(f.read(), where=path)


def _data_bytes(directory: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(directory):
        if os.path.basename(dirpath) == "data":
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def _recover(cfg: dict, hosts: list[str]) -> list[dict]:
    job = {**cfg, "host_of_rank": hosts, "recover": True, "runs": [0], "steps": [], "load_back": False}
    codes = tier_jobs.run(len(hosts), job, timeout=120)
    assert codes == [0] * len(hosts), f"the recovering job on {hosts} failed: {codes}"
    out = []
    for r in range(len(hosts)):
        with open(os.path.join(cfg["base"], f"recovered-rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def test_local_steps_refer_to_older_ones_and_retention_keeps_what_they_read(saved):
    for host in ("host0", "host1"):
        root = local_root(os.path.join(saved["base"], host), saved["root"])
        committed = [s for s in range(6) if os.path.isfile(os.path.join(root, step_name(s), MANIFEST_KEY))]
        assert committed == [4, 5], f"{host}: local steps {committed}"
        newest = _manifest(os.path.join(root, step_name(5)))
        owners = {f.checkpoint for f in newest.references}
        assert newest.version == 3 and step_name(0) in owners, f"{host}: step 5 refers to {owners}"
        for ref in newest.references:  # each referenced file lies beside it, in a retired generation, held
            assert held_size(os.path.join(root, step_name(5)), ref) == ref.nbytes, f"{host}: {ref.path} is gone"
            owner = os.path.join(root, ref.checkpoint, ref.path.split("/")[0])
            assert os.listdir(os.path.join(owner, "holds")), f"{host}: no hold on {owner}"
        with open(os.path.join(root, step_name(5), "holding.json")) as f:
            listed = json.load(f)["files"]
        assert {r.path for r in newest.references} & set(listed), f"{host}: no referenced file is listed as held"


def test_a_drain_uploads_only_the_bytes_the_persistent_root_lacks(saved):
    root = saved["root"]
    assert sorted(d for d in os.listdir(root) if d.startswith("step_")) == [step_name(s) for s in (0, 1, 2, 4)]
    assert not os.path.exists(os.path.join(root, step_name(1), MANIFEST_KEY))  # step 1: only what step 2 reads
    full = _data_bytes(os.path.join(root, step_name(0)))
    assert full > FROZEN_BYTES
    for step in (2, 4):
        m = _manifest(os.path.join(root, step_name(step)))
        assert m.references, f"drained step {step} refers to nothing"
        own = _data_bytes(os.path.join(root, step_name(step)))
        assert own < full - FROZEN_BYTES + 4096, f"drained step {step} wrote {own} bytes of {full}"
    # step 1's data files (the ``slow`` tensor's owner) crossed once, for step 2; step 4 reads them too
    assert {f.checkpoint for f in _manifest(os.path.join(root, step_name(4))).references} >= {step_name(1)}
    uploaded = 0
    for r in range(4):
        with open(os.path.join(saved["base"], f"uploads-rank{r}")) as f:
            uploaded += sum(int(line) for line in f)
    assert uploaded == _data_bytes(root), "the drains uploaded bytes the persistent root does not keep"


def test_recovery_loads_the_newest_incremental_step_exactly_at_the_same_world_size(saved, tmp_path):
    cfg = _copy(saved, tmp_path)
    got = _recover(cfg, ["host0", "host0", "host1", "host1"])
    assert got == [{"step": 5, "run": 0}] * 4


def test_recovery_with_a_host_lost_at_another_world_size_loads_exactly(saved, tmp_path):
    cfg = _copy(saved, tmp_path)
    shutil.rmtree(os.path.join(cfg["base"], "host1"))
    got = _recover(cfg, ["host0", "host2"])
    assert got == [{"step": 5, "run": 0}] * 2


def test_recovery_falls_back_to_the_incremental_steps_of_the_persistent_root(saved, tmp_path):
    cfg = _copy(saved, tmp_path)
    for host in ("host0", "host1"):
        shutil.rmtree(os.path.join(cfg["base"], host))
    got = _recover(cfg, ["host0", "host1"])
    assert got == [{"step": 4, "run": 0}] * 2


# -- one process: a reference inside the local root is checked as the step's own files ------------


def _planted(tmp_path, how: str) -> tuple[str, FileEntry]:
    root = tmp_path / "root"
    gen = "gen-0123456789abcdef01234567"
    real = root / ("elsewhere" if how == "link" else step_name(0)) / gen / "data"
    real.mkdir(parents=True)
    (root / step_name(1)).mkdir()
    if how == "fifo":
        os.mkfifo(real / "rank00000-0.bin")
    else:
        (real / "rank00000-0.bin").write_bytes(b"x" * 10)
    if how == "link":
        os.symlink(root / "elsewhere", root / step_name(0))
    owner = "recover-x" if how == "owner" else step_name(0)
    return str(root / step_name(1)), FileEntry(f"{gen}/data/rank00000-0.bin", 10, 0, owner)


@pytest.mark.parametrize("how", ["link", "fifo", "owner"])
def test_a_referenced_file_behind_a_link_or_not_regular_or_outside_the_steps_is_not_held(tmp_path, how):
    step_dir, entry = _planted(tmp_path, how)
    assert held_size(step_dir, entry) is None


def test_a_referenced_file_in_a_sibling_step_is_held(tmp_path):
    step_dir, entry = _planted(tmp_path, "plain")
    assert held_size(step_dir, entry) == 10
