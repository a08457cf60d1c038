"""Recovering from the local tier (docs/tiers.md, "Recovering"): the inventory of a
host, the choice of step, the exchange plan, and whole recoveries on simulated hosts
(gloo processes with their own BCP_HOST_ID and local roots)."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import stat
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
import dist_jobs
import tier_recover_jobs as jobs
from bcp.backends import backend_for
from bcp.coordination.collectives import Coordinator
from bcp.metadata import Manifest
from bcp.metadata.keys import MANIFEST_KEY, step_name
from bcp.tiers.exchange import Exchange
from bcp.tiers.holding import add_held
from bcp.tiers.hosts import HostMap
from bcp.tiers.inventory import StepCopy, choose_local, list_local, local_wins
from bcp.tiers.job import JOB_NAME, job_identity, read_job
from bcp.tiers.paths import HOLDING_NAME, local_root
from bcp.tiers.recover import recover_latest_with_info
from bcp.tiers.recovery_dir import RECOVERY_PREFIX, prepare, read_metadata
from helpers import assert_same, flip_bit

# -- one process: inventory ------------------------------------------------------------------------


def _state(seed: float) -> dict:
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6) * seed,
        "b": torch.full((5,), seed, dtype=torch.bfloat16),
        "step": int(seed),
    }


def _local_step(tmp_path, root: str, step: int, seed: float, *, hold: bool = True) -> str:
    """Save ``_state(seed)`` with one process and place it as local step ``step`` of
    ``root`` (its one data file in holding.json when ``hold``; stamped with the job id
    of the root when a tier stamped it). Returns the step dir."""
    ckpt = str(tmp_path / f"src-{step}-{seed}")
    bcp.save(_state(seed), ckpt)
    jobs.lay_out(ckpt, [root], [[0]], replicas=0, step=step, job=read_job(root) if os.path.isdir(root) else None)
    step_dir = os.path.join(root, step_name(step))
    if not hold:
        jobs.write_holding(step_dir, jobs.manifest_of(ckpt), [])
    return step_dir


def test_inventory_counts_only_files_in_holding_with_the_manifest_size(tmp_path):
    root = str(tmp_path / "root")
    held_dir = _local_step(tmp_path, root, 7, 1.0)
    _local_step(tmp_path, root, 8, 2.0, hold=False)  # the file is there, holding.json does not list it
    short_dir = _local_step(tmp_path, root, 9, 3.0)
    manifest = jobs.manifest_of(short_dir)
    with open(os.path.join(short_dir, manifest.data_files[0].path), "r+b") as f:
        f.truncate(manifest.data_files[0].nbytes - 1)  # listed, but not the manifest's size
    os.makedirs(os.path.join(root, f"{RECOVERY_PREFIX}abc"))  # never a holding
    os.makedirs(os.path.join(root, "step_12"))  # not a step directory name
    copies = {c.step: c for c in list_local(root)}
    assert sorted(copies) == [7, 8, 9]
    assert copies[7].held == (0,) and copies[7].n_files == 1 and copies[7].has_catalog
    assert copies[8].held == () and copies[9].held == ()
    assert copies[7].save_id == jobs.manifest_of(held_dir).save_id


def test_inventory_refuses_links_other_saves_and_corrupt_manifests(tmp_path):
    root = str(tmp_path / "root")
    linked = _local_step(tmp_path, root, 1, 1.0)
    path = os.path.join(linked, jobs.manifest_of(linked).data_files[0].path)
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)  # a symbolic link is never a holding
    other = _local_step(tmp_path, root, 2, 2.0)
    other_files = [f.path for f in jobs.manifest_of(other).data_files]
    jobs.write_holding(other, jobs.manifest_of(other), other_files, save_id="0123abcd")  # another save's
    bad = _local_step(tmp_path, root, 3, 3.0)
    with open(os.path.join(bad, MANIFEST_KEY), "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 1]))  # fails the manifest's own CRC32C
    names = _local_step(tmp_path, root, 4, 4.0)
    manifest = jobs.manifest_of(names)
    with open(os.path.join(names, HOLDING_NAME), "w") as f:  # bare names: not what the tier writes
        json.dump([p.path for p in manifest.data_files], f)
    lying = _local_step(tmp_path, root, 5, 5.0)
    entry = jobs.manifest_of(lying).data_files[0]
    add_held(lying, jobs.manifest_of(lying).save_id, [dataclasses.replace(entry, crc32c=entry.crc32c ^ 1)])
    kept = _local_step(tmp_path, root, 6, 6.0)
    copies = {c.step: c for c in list_local(root)}
    assert sorted(copies) == [1, 2, 4, 5, 6], "a manifest failing its CRC is no copy"
    assert copies[1].held == () and copies[2].held == () and copies[4].held == ()
    assert copies[5].held == (), "listed with a digest other than the manifest's"
    assert copies[6].held == (0,) and copies[6].save_id == jobs.manifest_of(kept).save_id


# -- one process: the choice -----------------------------------------------------------------------


def _copy(step: int, save: str, held: tuple[int, ...], n: int = 4, catalog: bool = True) -> StepCopy:
    return StepCopy(step, save, int(save, 16) & 0xFFFF, n, held, catalog)


def test_stale_copies_of_a_step_are_never_mixed():
    x, y = "65000000" + "0" * 16, "65000001" + "1" * 16
    listings = [[_copy(10, x, (0, 1))], [_copy(10, y, (2, 3))]]
    assert choose_local(listings) is None, "two saves of step 10 together hold every file name: not one step"
    older = [[_copy(10, x, (0, 1)), _copy(8, x, (0, 1, 2, 3))], [_copy(10, y, (2, 3))]]
    chosen = choose_local(older)
    assert chosen is not None and chosen.step == 8
    both = [[_copy(10, x, (0, 1, 2, 3))], [_copy(10, y, (0, 1, 2, 3))]]
    chosen = choose_local(both)
    assert chosen is not None and chosen.save_id == y, "two complete saves of one step: the newer save"
    assert chosen.holders == ((1,),) * 4


def test_a_step_needs_a_catalog_and_a_host_that_lists():
    x = "65000000" + "0" * 16
    assert choose_local([[_copy(3, x, (0, 1, 2, 3), catalog=False)], None]) is None
    chosen = choose_local([None, [_copy(3, x, (0, 1), catalog=False)], [_copy(3, x, (2, 3))]])
    assert chosen is not None and chosen.source == 2 and chosen.holders == ((1,), (1,), (2,), (2,))


@st.composite
def _listings(draw):
    saves = ["65000000" + "0" * 16, "65000001" + "1" * 16]
    hosts = draw(st.integers(1, 4))
    out = []
    for _h in range(hosts):
        if draw(st.booleans()) and draw(st.booleans()):
            out.append(None)
            continue
        copies = []
        for step in draw(st.sets(st.integers(0, 3), max_size=4)):
            save = draw(st.sampled_from(saves))
            held = tuple(sorted(draw(st.sets(st.integers(0, 3)))))
            copies.append(_copy(step, save, held))
        out.append(copies)
    return out


@given(_listings())
def test_choice_is_the_newest_step_one_save_holds_entirely(listings):
    chosen = choose_local(listings)
    complete = set()
    for listing in listings:
        for c in listing or ():
            held = set().union(
                *(d.held for other in listings for d in other or () if (d.step, d.save_id) == (c.step, c.save_id))
            )
            if held == {0, 1, 2, 3}:
                complete.add((c.step, c.save_id))
    if not complete:
        assert chosen is None
        return
    assert chosen is not None
    assert chosen.step == max(s for s, _ in complete)
    assert (chosen.step, chosen.save_id) in complete
    for i, holders in enumerate(chosen.holders):
        for h in holders:
            assert any(c.step == chosen.step and c.save_id == chosen.save_id and i in c.held for c in listings[h] or ())


def test_the_newer_tier_wins_and_a_tie_goes_to_the_local_one():
    assert local_wins(10, None) and local_wins(10, 10) and local_wins(10, 5)
    assert not local_wins(10, 11) and not local_wins(None, 3) and not local_wins(None, None)


# -- one process: the exchange plan ----------------------------------------------------------------


@st.composite
def _exchanges(draw):
    """Hosts, file holders, and each rank's (file, offset, bytes) requests: ranges of
    3 fragments per file (at 0, 1000, 2000), ranks of one host asking overlapping,
    touching or disjoint ranges, some empty."""
    hosts = draw(st.lists(st.integers(1, 3), min_size=2, max_size=4))  # ranks per host
    ids = [f"h{h}" for h, n in enumerate(hosts) for _ in range(n)]
    n_files = draw(st.integers(1, 4))
    holders = tuple(tuple(sorted(draw(st.sets(st.integers(0, len(hosts) - 1), min_size=1)))) for _ in range(n_files))
    frags = {f: [(o * 1000, draw(st.integers(1, 900))) for o in range(3)] for f in range(n_files)}
    requests = []
    for r in range(len(ids)):
        mine = ids[r]
        rows = []
        for f in range(n_files):
            if int(mine[1:]) in holders[f]:
                continue
            for o, n in frags[f]:
                if draw(st.booleans()):
                    lo = draw(st.integers(0, n))
                    rows.append((f, o + lo, draw(st.integers(0, n - lo))))
        requests.append(rows)
    return ids, holders, requests, draw(st.integers(1, 2000)), draw(st.integers(1, 700))


@given(_exchanges())
def test_exchange_delivers_each_requested_byte_once_per_host_within_the_round_budget(case):
    import numpy as np

    from bcp.tiers.inventory import LocalChoice

    ids, holders, requests, round_bytes, chunk = case
    hosts = HostMap.from_records([(i, None) for i in ids])
    of_rank = hosts.host_of_rank()
    assert of_rank == [hosts.host_of(r) for r in range(len(ids))]
    choice = LocalChoice(1, "ab", 0, holders, 0)
    ex = Exchange(types.SimpleNamespace(world_size=len(ids), rank=0), hosts, choice, None, "", "", round_bytes, chunk)  # type: ignore[arg-type]
    ex.plan([np.array(r, dtype=np.int64).reshape(-1, 3) for r in requests])
    got: dict[tuple[int, int], list[int]] = {}  # (host, file) -> every byte delivered, with repeats
    for pieces in ex.rounds_of:
        moved: dict[int, int] = {}
        for p in pieces:
            assert of_rank[p.sender] in holders[p.file], "served by a host that does not hold the file"
            assert of_rank[p.receiver] not in holders[p.file]
            assert 0 < p.nbytes <= chunk
            assert any(f == p.file and n for f, _o, n in requests[p.receiver]), "received by a rank that asked none"
            got.setdefault((of_rank[p.receiver], p.file), []).extend(range(p.offset, p.offset + p.nbytes))
            for who in (p.sender, p.receiver):
                moved[who] = moved.get(who, 0) + p.nbytes
        assert max(moved.values()) <= round_bytes, "a round over its budget"
    want: dict[tuple[int, int], set[int]] = {}
    for r, rows in enumerate(requests):
        for f, o, n in rows:
            if n:
                want.setdefault((of_rank[r], f), set()).update(range(o, o + n))
    assert set(got) == set(want)
    for key, delivered in got.items():
        assert len(delivered) == len(set(delivered)), f"{key}: a byte delivered twice to one host"
        assert set(delivered) == want[key], f"{key}: delivered bytes differ from the union of the requests"


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=12))
def test_merged_ranges_are_the_disjoint_union_of_the_ranges(ranges):
    import numpy as np

    from bcp.tiers.exchange import merge_ranges

    starts = np.array([s for s, _n in ranges], np.int64)
    ends = np.array([s + n for s, n in ranges], np.int64)
    lo, hi, group = merge_ranges(starts, ends)
    assert (lo < np.append(lo[1:], 1 << 40)).all() and (hi[:-1] < lo[1:]).all(), "not disjoint, ascending, apart"
    assert {x for a, b in zip(lo, hi, strict=True) for x in range(a, b)} == {
        x for s, n in ranges for x in range(s, s + n)
    } or all(n == 0 for _s, n in ranges)
    for (s, n), g in zip(ranges, group.tolist(), strict=True):
        assert lo[g] <= s and s + n <= hi[g], "an input range outside the merged range said to hold it"


# -- one process: recover and the manager ---------------------------------------------------------


def test_single_process_recovery_is_bit_exact_and_removes_its_directory(tmp_path):
    root = str(tmp_path / "local")
    _local_step(tmp_path, root, 10, 3.0)
    template = {"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    info = recover_latest_with_info(template, local_root=root, persistent_root=None, coord=Coordinator())
    assert info is not None and info.step == 10
    assert_same(dict(info.state), _state(3.0))
    assert info.bytes_received == info.bytes_sent == 0 and info.load.bytes_read > 0
    assert not [n for n in os.listdir(root) if n.startswith(RECOVERY_PREFIX)]
    assert sorted(os.listdir(root)) == [step_name(10)], "the local step itself is untouched"
    nothing = recover_latest_with_info(
        template, local_root=str(tmp_path / "none"), persistent_root=None, coord=Coordinator()
    )
    assert nothing is None


def test_a_host_holding_every_file_recovers_with_a_plain_load_and_no_read_plan_of_its_own(tmp_path, monkeypatch):
    """Nothing to fetch (every data file held here): no exchange, no second match and
    read plan before the load's own, no recovery directory (the load reads the local
    step itself), and the load neither reads nor decodes-and-checks twice the manifest
    and catalog the recovery read: the recovery costs a load plus its inventory."""
    import bcp.loader as loader
    import bcp.reader as reader
    import bcp.tiers.recover as recover
    import bcp.tiers.recovery_dir as recovery_dir

    root = str(tmp_path / "local")
    _local_step(tmp_path, root, 10, 3.0)

    def no_plan(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a read plan for the exchange was made though the host holds every file")

    def no_directory(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a recovery directory was built though the host holds every file")

    fetched: list[str] = []
    real_fetch = reader.fetch_catalog

    def counting_fetch(backend, manifest):  # type: ignore[no-untyped-def]
        fetched.append(backend.uri)
        return real_fetch(backend, manifest)

    monkeypatch.setattr(recover, "wanted_ranges", no_plan)
    monkeypatch.setattr(recover, "prepare", no_directory)
    monkeypatch.setattr(recovery_dir, "fetch_catalog", counting_fetch)
    monkeypatch.setattr(reader, "fetch_catalog", counting_fetch)
    monkeypatch.setattr(loader, "fetch_metadata", lambda *a, **k: no_plan())
    template = {"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    info = recover_latest_with_info(
        template, local_root=root, persistent_root=None, coord=Coordinator(), load_options=bcp.LoadOptions(trace=True)
    )
    assert info is not None and info.step == 10
    assert_same(dict(info.state), _state(3.0))
    assert "exchange" not in info.stages, sorted(info.stages)
    assert {"inventory", "metadata", "read"} <= set(info.stages), sorted(info.stages)
    assert not {"prepare", "match", "catalog"} & set(info.stages), sorted(info.stages)
    assert len(fetched) == 1, f"the catalog was read {len(fetched)} times: {fetched}"
    assert info.load.uri.endswith(step_name(10)), info.load.uri
    assert sorted(os.listdir(root)) == [step_name(10)]


def test_manager_takes_the_newer_tier_and_the_local_one_on_a_tie(tmp_path):
    persistent = str(tmp_path / "persistent")
    manager = bcp.CheckpointManager(persistent, async_save=False)
    manager.save(12, _state(12.0))
    template = {"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    assert manager.load_latest(template)[0] == 12, "no tier: the persistent tier as before"
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "shm"), persist_every=None)
    manager = bcp.CheckpointManager(persistent, async_save=False, tier=tier)
    root = local_root(tier.dir, persistent)
    _local_step(tmp_path, root, 10, 10.0)
    step, state = manager.load_latest(template)
    assert step == 12 and state["step"] == 12, "the persistent step is newer"
    _local_step(tmp_path, root, 12, 99.0)  # same step number, other values: which tier served it shows
    step, state = manager.load_latest(template)
    assert step == 12 and state["step"] == 99, "a tie goes to the local tier"
    assert_same(dict(state), _state(99.0))
    manifest_path = os.path.join(root, step_name(12), MANIFEST_KEY)
    os.remove(manifest_path)  # the local step 12 is gone; local 10 is older than persistent 12
    step, state = manager.load_latest(template)
    assert step == 12 and state["step"] == 12


# -- simulated hosts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """4 gloo ranks: persistent step 5 under a manager root, step 10 (save X) and a
    later save of step 10 (Y), and the references of steps 5 and 10."""
    out = str(tmp_path_factory.mktemp("tiers"))
    dist_jobs.spawn(jobs.save_job, 4, out)
    return out


def _roots(base, names: list[str], persistent: str) -> list[str]:
    """The local root each simulated host's tier uses (bcp.tiers.paths.local_root)."""
    return [local_root(base / n, persistent) for n in names]


def _job(persistent: str) -> str:
    """The job id of the persistent root (read, or created as the tier would)."""
    return job_identity(backend_for(persistent))


@pytest.mark.slow
def test_four_ranks_recover_from_replicas_and_refuse_what_is_not_held(saved, tmp_path):
    """2 hosts x 2 ranks saved, host B lost, replicas=1: the same world size recovers
    from A's replicas bit-exactly; a replica missing from holding.json, or two saves
    of step 10 each half held, fall back to persistent step 5; so does a corrupt
    byte in a fragment A serves (B's copy is lost): A's replica is quarantined."""
    x, y, persistent = os.path.join(saved, "x"), os.path.join(saved, "y"), os.path.join(saved, "persistent")
    ref5, ref10 = os.path.join(saved, "ref5.pt"), os.path.join(saved, "ref10.pt")
    job = _job(persistent)
    two = [[0, 1], [2, 3]]
    hosts = ("A", "A", "B", "B")
    scenarios = []

    lost = _roots(tmp_path, ["lost-a", "lost-b"], persistent)
    jobs.lay_out(x, lost, two, replicas=1, lost=(1,), job=job)
    scenarios.append(
        jobs.Scenario("B lost", hosts, dict(zip("AB", lost, strict=True)), persistent, "local", ref10, False)
    )

    stale = _roots(tmp_path, ["stale-a", "stale-b"], persistent)
    jobs.lay_out(x, stale, two, replicas=0, lost=(1,), job=job)
    jobs.lay_out(y, stale, two, replicas=0, lost=(0,), job=job)
    scenarios.append(jobs.Scenario("stale", hosts, dict(zip("AB", stale, strict=True)), persistent, "persistent", ref5))

    unlisted = _roots(tmp_path, ["unlisted-a", "unlisted-b"], persistent)
    jobs.lay_out(x, unlisted, two, replicas=1, lost=(1,), job=job)
    manifest = jobs.manifest_of(x)
    step_a = os.path.join(unlisted[0], step_name(jobs.LOCAL_STEP))
    jobs.write_holding(step_a, manifest, jobs.files_of_ranks(manifest, [0, 1]))  # the replica is not listed
    assert all(os.path.exists(os.path.join(step_a, f)) for f in jobs.files_of_ranks(manifest, [2, 3]))
    scenarios.append(
        jobs.Scenario("unlisted replica", hosts, dict(zip("AB", unlisted, strict=True)), persistent, "persistent", ref5)
    )

    corrupt = _roots(tmp_path, ["corrupt-a", "corrupt-b"], persistent)
    jobs.lay_out(x, corrupt, two, replicas=1, lost=(1,), job=job)
    replica = os.path.join(corrupt[0], step_name(jobs.LOCAL_STEP), jobs.files_of_ranks(manifest, [2])[0])
    with open(replica, "r+b") as f:  # the first fragment of rank 2's file, which rank 2 fetches from A
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x40]))
    scenarios.append(
        jobs.Scenario("corrupt", hosts, dict(zip("AB", corrupt, strict=True)), persistent, "persistent", ref5)
    )

    dist_jobs.spawn(jobs.scenarios_job, 4, scenarios)
    assert os.listdir(lost[1]) == [JOB_NAME], "the recovery directory of the new host B is removed"
    assert not os.path.exists(replica) and os.path.exists(replica + ".quarantined"), "the corrupt replica moved aside"


@pytest.mark.slow
def test_every_host_holding_every_file_recovers_in_one_broadcast_and_no_directory(saved, tmp_path):
    """2 hosts x 2 ranks, replicas=1: each host holds every file. The recovery through
    the manager sends the choice and the metadata in one broadcast, gathers no
    requests, builds no recovery directory (each host loads its local step), and the
    load reads no metadata of its own; the state is bit-exact."""
    x, persistent = os.path.join(saved, "x"), os.path.join(saved, "persistent")
    roots = _roots(tmp_path, ["all-a", "all-b"], persistent)
    jobs.lay_out(x, roots, [[0, 1], [2, 3]], replicas=1, job=_job(persistent))
    scenario = jobs.Scenario(
        "all held",
        ("A", "A", "B", "B"),
        dict(zip("AB", roots, strict=True)),
        persistent,
        "local",
        os.path.join(saved, "ref10.pt"),
        all_held=True,
    )
    dist_jobs.spawn(jobs.scenarios_job, 4, [scenario])


@pytest.mark.slow
def test_three_ranks_recover_from_replicas_and_two_lost_hosts_fall_back(saved, tmp_path):
    """Host A (2 ranks) and a new host recover 2 x 2 ranks' step from A's replicas;
    4 hosts x 1 rank with replicas=1 losing hosts 1 and 2 (each other's replica)
    falls back to the persistent step."""
    x, persistent = os.path.join(saved, "x"), os.path.join(saved, "persistent")
    ref5, ref10 = os.path.join(saved, "ref5.pt"), os.path.join(saved, "ref10.pt")
    job = _job(persistent)
    smaller = _roots(tmp_path, ["small-a", "small-b", "small-c"], persistent)
    jobs.lay_out(x, smaller[:2], [[0, 1], [2, 3]], replicas=1, lost=(1,), job=job)
    os.makedirs(smaller[2])
    resized = jobs.Scenario("A + new host", ("A", "A", "C"), {"A": smaller[0], "C": smaller[2]}, persistent, "local")
    resized = jobs.Scenario(**{**resized.__dict__, "ref": ref10, "via_manager": False, "round_bytes": 2048})

    four = _roots(tmp_path, ["h0", "h1", "h2", "h3", "h4"], persistent)
    jobs.lay_out(x, four[:4], [[0], [1], [2], [3]], replicas=1, lost=(1, 2), job=job)
    os.makedirs(four[4])
    two_lost = jobs.Scenario(
        "two hosts lost", ("h0", "h3", "h4"), {"h0": four[0], "h3": four[3], "h4": four[4]}, persistent, "persistent"
    )
    two_lost = jobs.Scenario(**{**two_lost.__dict__, "ref": ref5})
    dist_jobs.spawn(jobs.scenarios_job, 3, [resized, two_lost])


@pytest.mark.parametrize("world", [3, 2])
def test_uneven_reshard_moves_only_the_bytes_the_load_reads_and_never_reads_a_hole(tmp_path, world):
    """4 ranks saved uneven row, column and flat shards (64-byte checksum blocks) on 2
    hosts, replicas=1; host B lost, host A and a new host recover at 3 (A, A, C) and 2
    (A, C) ranks with other uneven cuts: bit-exact, the new host receives exactly its
    load's reads (runs + the rest of the blocks they touch), host A none; with one
    range left out of the exchange, every rank fails on a checksum mismatch."""
    saved = str(tmp_path / "saved")
    dist_jobs.spawn(jobs.uneven_save_job, 4, saved)
    roots = [str(tmp_path / n) for n in ("a", "b", "c")]
    jobs.lay_out(saved, roots[:2], [[0, 1], [2, 3]], replicas=1, lost=(1,))
    os.makedirs(roots[2])
    hosts = ("A", "A", "C") if world == 3 else ("A", "C")
    dist_jobs.spawn(jobs.uneven_recover_job, world, hosts, {"A": roots[0], "C": roots[2]})
    assert os.listdir(roots[2]) == [], "the new host's recovery directory is removed"


# -- one process: reads that wait for the exchange ------------------------------------------------


def test_a_gated_read_waits_for_its_bytes_and_a_failed_exchange_releases_it(tmp_path):
    import threading

    from bcp.backends import backend_for
    from bcp.tiers.arrival import Arrivals, GatedBackend

    (tmp_path / "f").write_bytes(bytes(range(100)))
    (tmp_path / "held").write_bytes(b"x" * 10)
    arrivals = Arrivals()
    gated = GatedBackend(backend_for(str(tmp_path)), {"f": 0}, arrivals)
    assert gated.read("held", 0, 10) == b"x" * 10, "a held file is read at once"
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(gated.read("f", 10, 30)))
    reader.start()
    arrivals.landed(0, 0, 20)
    reader.join(0.2)
    assert reader.is_alive() and not got, "bytes 20-40 have not landed: the read waits"
    arrivals.landed(0, 20, 50)
    reader.join(5)
    assert got == [bytes(range(10, 40))], "landed in two pieces: the read goes on"
    other = threading.Thread(target=lambda: got.append(gated.read("f", 60, 10)))
    other.start()
    other.join(0.2)
    assert other.is_alive(), "bytes another rank of the host receives: wait for the exchange's end"
    arrivals.end(None)
    other.join(5)
    assert got[-1] == bytes(range(60, 70))
    failed = Arrivals()
    errors: list[BaseException] = []

    def read_failed() -> None:
        try:
            GatedBackend(backend_for(str(tmp_path)), {"f": 0}, failed).read("f", 0, 10)
        except bcp.CorruptCheckpointError as e:
            errors.append(e)

    waiting = threading.Thread(target=read_failed)
    waiting.start()
    failed.end(ConnectionError("peer gone"))
    waiting.join(5)
    assert len(errors) == 1 and "exchange failed" in str(errors[0]) and "peer gone" in str(errors[0])


# -- a corrupt or missing local copy ---------------------------------------------------------------


def test_two_hosts_quarantine_a_corrupt_own_copy_and_take_the_replica_or_the_persistent_step(tmp_path):
    """2 gloo ranks as 2 hosts, a flipped byte in host A's own data file: with B's
    replica, step 10 exactly; without, persistent step 5; both ranks together, the
    WARNING naming the real file, and a second start that does not trip on it."""
    dist_jobs.spawn(jobs.corrupt_copy_job, 2, str(tmp_path))


def test_a_serving_hosts_unreadable_copy_is_quarantined_and_the_persistent_step_loads(tmp_path):
    """2 gloo ranks as 2 hosts, each rank's file on the other host only: host B's copy
    fails every read with EIO while it serves it in the exchange. B quarantines it and
    both ranks load persistent step 5, where the OSError used to stop every start."""
    dist_jobs.spawn(jobs.unreadable_copy_job, 2, str(tmp_path))


def test_a_host_without_room_for_the_recovery_directory_loads_the_persistent_step(tmp_path):
    """2 gloo ranks as 2 hosts, host A's file system full while the exchange writes
    what it fetched (ENOSPC): both ranks load persistent step 5 with a WARNING, nothing
    quarantined, on every start (the OSError used to stop each one)."""
    dist_jobs.spawn(jobs.full_host_job, 2, str(tmp_path))


def test_an_incremental_step_that_changed_nothing_recovers_on_two_hosts(tmp_path):
    """2 gloo ranks as 2 hosts, incremental local steps, step 2 all references to step
    1: recovered exactly on both starts (its catalog's folder used to be missing)."""
    dist_jobs.spawn(jobs.unchanged_incremental_job, 2, str(tmp_path))


def test_a_recovery_directory_is_private_whatever_the_umask(tmp_path):
    """What the recovery directory holds is 0700 (directories, the parents too) and 0600
    (files: links, holes, catalog, manifest) under umask 0, as the rest of the tier."""
    ckpt = str(tmp_path / "ckpt")
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "shm"), replicas=0, persist_every=None)
    with bcp.CheckpointManager(ckpt, async_save=False, tier=tier) as manager:
        manager.save(1, {"w": torch.ones(4), "v": torch.zeros(3)})
    root = local_root(tier.dir, ckpt)
    choice = choose_local([list_local(root)])
    assert choice is not None
    step_dir = os.path.join(root, step_name(1))
    metadata = read_metadata(step_dir, choice)
    manifest = Manifest.from_json(metadata.manifest, where="test")
    made = os.path.join(root, "recover-test")
    old = os.umask(0)
    try:
        prepare(os.path.join(made, step_name(1)), step_dir, manifest, metadata, frozenset())
    finally:
        os.umask(old)
    modes = {
        os.path.relpath(os.path.join(d, n), made): stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode)
        for d, dirs, files in os.walk(made)
        for n in dirs + files
    }
    assert len(modes) >= 5, modes  # the step, its data folder, a data file, the catalog and the manifest
    for name, mode in modes.items():
        assert mode == (0o700 if os.path.isdir(os.path.join(made, name)) else 0o600), (name, oct(mode))


_TEMPLATE = {"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}


def _corrupt_local_step(
    tmp_path, which: str, *, persistent_step: int | None, flip: bool = True
) -> tuple[bcp.CheckpointManager, str]:
    """A manager (root with ``persistent_step`` saved, if any) whose local tier holds
    step 12 with one flipped byte (with ``flip``) in its data file or its catalog.
    Returns the manager and that file."""
    persistent = str(tmp_path / "persistent")
    if persistent_step is not None:
        bcp.CheckpointManager(persistent, async_save=False).save(persistent_step, _state(float(persistent_step)))
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "shm"), replicas=0, persist_every=None)
    root = local_root(tier.dir, persistent)
    os.makedirs(root)
    jobs.stamp(root, _job(persistent))  # as this job's tier stamps its local root
    step_dir = _local_step(tmp_path, root, 12, 12.0)
    manifest = jobs.manifest_of(step_dir)
    entry = manifest.data_files[0] if which == "data" else manifest.catalog
    bad = os.path.join(step_dir, entry.path)
    if flip:
        flip_bit(bad, entry.nbytes // 2 if which == "catalog" else 3)  # byte 3: inside the first tensor's bytes
    return bcp.CheckpointManager(persistent, async_save=False, tier=tier), bad


@pytest.mark.parametrize("which", ["data", "catalog"])
def test_a_corrupt_local_copy_is_quarantined_and_the_persistent_step_loads(tmp_path, caplog, which):
    """A flipped byte in the host's own data file (or catalog), no other copy: the
    persistent step loads exactly, a WARNING names the real file and where it was
    moved, and a second start loads the same without tripping on it."""
    manager, bad = _corrupt_local_step(tmp_path, which, persistent_step=9)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        step, state = manager.load_latest(dict(_TEMPLATE))
    assert step == 9
    assert_same(dict(state), _state(9.0))
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"{bad} on host" in warned and f"quarantined as {bad}.quarantined" in warned, warned
    assert "loading persistent step 9 instead" in warned and RECOVERY_PREFIX not in warned, warned
    assert not os.path.exists(bad) and os.path.exists(bad + ".quarantined")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bcp"):
        step, state = manager.load_latest(dict(_TEMPLATE))
    assert step == 9 and state["step"] == 9
    again = "\n".join(r.getMessage() for r in caplog.records)
    assert "checksum" not in again and "quarantined" not in again and "1 newer local step lost" in again, again


@pytest.mark.parametrize("which", ["data", "catalog"])
def test_a_local_file_that_cannot_be_read_is_quarantined_and_recovery_goes_on(tmp_path, caplog, monkeypatch, which):
    """Step 12's own data file (or catalog) fails every read with EIO (a failing NVMe;
    EACCES reads the same): the copy is moved aside with a WARNING and persistent step
    9 loads, where the StorageError used to stop every start of the job."""
    manager, bad = _corrupt_local_step(tmp_path, which, persistent_step=9, flip=False)
    real_open = os.open

    def failing(path, *args, **kwargs):
        if os.fspath(path) == bad:
            raise OSError(errno.EIO, "Input/output error (injected)", bad)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        step, state = manager.load_latest(dict(_TEMPLATE))
    assert step == 9
    assert_same(dict(state), _state(9.0))
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"{bad} on host" in warned and "Input/output error" in warned, warned
    assert not os.path.exists(bad) and os.path.exists(bad + ".quarantined")


def test_a_corrupt_local_copy_with_nothing_else_raises_naming_the_quarantined_file(tmp_path):
    manager, bad = _corrupt_local_step(tmp_path, "data", persistent_step=None)
    with pytest.raises(bcp.CorruptCheckpointError) as raised:
        manager.load_latest(dict(_TEMPLATE))
    text = str(raised.value)
    assert f"quarantined as {bad}.quarantined" in text and RECOVERY_PREFIX not in text, text
    assert "checksum mismatch" in text and os.path.exists(bad + ".quarantined")


def test_a_lost_local_tier_warns_how_many_steps_may_be_lost(tmp_path, caplog):
    """Steps 1-6 saved with a local save every step and a drain every 4th; the whole
    local tier gone: the persistent step 4 loads, with a WARNING that up to 4 steps
    (5-8) are lost. Local copies older than the persistent step: a WARNING too."""
    import shutil

    persistent = str(tmp_path / "persistent")
    tier = bcp.LocalTier(keep_free=0.0, dir=str(tmp_path / "shm"), replicas=0, persist_every=4)
    with bcp.CheckpointManager(persistent, async_save=False, tier=tier) as manager:
        for step in range(1, 7):
            manager.save(step, _state(float(step)))
    root = local_root(tier.dir, persistent)
    assert {step_name(s) for s in (5, 6)} <= set(os.listdir(root))
    shutil.rmtree(root)
    manager = bcp.CheckpointManager(persistent, async_save=False, tier=tier)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        step, state = manager.load_latest(dict(_TEMPLATE))
    assert step == 4
    assert_same(dict(state), _state(4.0))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "local tier" in r.getMessage()]
    assert any(
        "none of the 1 hosts holds a local step" in m
        and "loading persistent step 4 instead" in m
        and "up to 4 steps lost" in m
        for m in warned
    ), warned
    caplog.clear()
    _local_step(tmp_path, root, 3, 3.0)  # only a step older than the persistent one survives
    with caplog.at_level(logging.WARNING, logger="bcp"):
        assert manager.load_latest(dict(_TEMPLATE))[0] == 4
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("lost its copies of step 4 and later" in m and "up to 4 steps lost" in m for m in warned), warned


@given(st.integers(1, 5), st.one_of(st.none(), st.integers(1, 12)), st.integers(0, 40))
def test_a_lost_local_tier_may_cost_the_local_saves_up_to_the_next_drain(every, drain, persistent):
    """The bound a lost local tier's WARNING gives, against counting the steps: the
    multiples of ``every`` after the persistent step, up to the next drain."""
    from bcp.tiers.fallback import lost_after

    text = lost_after(persistent, bcp.LocalTier(every=every, persist_every=drain), [])
    if drain is None:
        assert "not known" in text
        return
    following = next(s for s in range(persistent + 1, persistent + drain + 1) if s % drain == 0)
    most = sum(1 for s in range(persistent + 1, following + 1) if s % every == 0)
    assert f"up to {most} step" in text and f"next drain at step {following})" in text, text
    assert "lost" in lost_after(persistent, None, []) and "steps 7, 9" in lost_after(persistent, None, [7, 9])


def test_corrupt_bytes_no_host_can_blame_fall_back_to_the_persistent_step(tmp_path, caplog, monkeypatch):
    """When every copy passes its host's check (bytes damaged between hosts; here the
    check is made to pass), nothing is quarantined and the persistent step loads,
    with a WARNING saying so; without a persistent step, the error says so too."""
    import bcp.tiers.recovery_dir as recovery_dir

    monkeypatch.setattr(recovery_dir, "verify", lambda *args: None)
    manager, bad = _corrupt_local_step(tmp_path, "data", persistent_step=9)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        step, state = manager.load_latest(dict(_TEMPLATE))
    assert step == 9 and state["step"] == 9 and os.path.exists(bad)
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert "passed its check" in warned and "loading persistent step 9 instead" in warned, warned
    alone, _bad = _corrupt_local_step(tmp_path / "alone", "data", persistent_step=None)
    with pytest.raises(bcp.CorruptCheckpointError, match=r"passed its check.*no step to load instead"):
        alone.load_latest(dict(_TEMPLATE))
