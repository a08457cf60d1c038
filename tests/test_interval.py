"""``interval="auto"`` (issue 40): the cost model's optimum (bcp.schedule.waste), the
policy that measures and chooses (bcp.schedule.interval), the restart record it learns
the failure rate from (bcp.schedule.restarts), agreement across gloo ranks, and the
simulator's last line (bench/interval_sim.py)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import dist_jobs
import interval_jobs
from bcp.backends import backend_for
from bcp.cli import main as cli_main
from bcp.schedule import restarts
from bcp.schedule.auto import report_from_metadata, settings_of
from bcp.schedule.interval import IntervalPolicy, validate_snapshot
from bcp.schedule.waste import best_steps, optimal_seconds, waste_fraction, young_seconds
from conftest import new_bucket, store_uri
from netproxy import proxied

BENCH = Path(__file__).resolve().parent.parent / "bench"

costs = st.floats(0.01, 600.0)
mtbfs = st.floats(120.0, 30 * 86_400.0)
recoveries = st.floats(0.0, 600.0)
lags = st.floats(0.0, 300.0)
methods = st.sampled_from(["exact", "young"])


# -- the optimum ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(c=costs, m=mtbfs, r=recoveries, lag=lags, method=methods, factor=st.floats(1.05, 10.0))
def test_the_optimum_grows_with_the_save_cost_and_the_mtbf(c, m, r, lag, method, factor):
    base = optimal_seconds(c, r, m, lag, method)
    assert optimal_seconds(c * factor, r, m, lag, method) >= base * (1 - 1e-4)
    assert optimal_seconds(c, r, m * factor, lag, method) >= base * (1 - 1e-4)


@settings(max_examples=60, deadline=None)
@given(c=costs, m=mtbfs, r=recoveries, lag=lags, method=methods, step=st.floats(0.01, 30.0), unit=st.integers(1, 50))
def test_the_chosen_steps_waste_no_more_than_their_neighbours(c, m, r, lag, method, step, unit):
    n = best_steps(step, c, r, m, lag, method, multiple_of=unit)
    assert n % unit == 0 and n >= unit

    def w(k: int) -> float:
        return waste_fraction(k * step, c, r, m, lag, method)

    assert w(n) <= w(n + unit)
    if n > unit:
        assert w(n) <= w(n - unit)


@settings(max_examples=40, deadline=None)
@given(c=st.floats(0.1, 180.0), m=st.floats(3600.0, 30 * 86_400.0))
def test_the_exact_optimum_is_dalys_when_saves_are_cheap_against_failures(c, m):
    """Daly's higher-order estimate of the exponential model's optimum, sqrt(2CM) (1 +
    sqrt(C/2M)/3 + C/18M) - C, is close to the numerical one for C << M; Young's
    first-order one less so, the more so as C/M grows."""
    exact, young = optimal_seconds(c, 0.0, m), young_seconds(c, m)
    x = c / (2 * m)
    daly = young * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert abs(exact / daly - 1) < 0.01, (exact, daly)
    assert abs(exact / young - 1) < 2 * math.sqrt(x) + 1e-3, (exact, young)


def test_a_save_that_outlives_the_interval_costs_the_wait():
    """An async save committed 100 s after it returns makes a save 10 s later wait 90 s."""
    assert waste_fraction(10, 1, 0, 1e9, lag=100, method="young") == pytest.approx(91 / 10, rel=1e-6) or (
        waste_fraction(10, 1, 0, 1e9, lag=100, method="young") == 1.0
    )
    assert waste_fraction(200, 1, 0, 1e9, lag=100, method="young") == pytest.approx(1 / 200 + 200.0 / 2e9 + 1e-7)
    assert optimal_seconds(0.1, 0.0, 3600, lag=120) >= 100


# -- the policy -------------------------------------------------------------------------------

observations = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.floats(0.001, 10.0)),
        st.tuples(st.just("save"), st.sampled_from(["local", "persistent"]), st.floats(0.0, 100.0)),
        st.tuples(st.just("recovery"), st.floats(0.0, 600.0), st.sampled_from(["local", "persistent"])),
        st.tuples(st.just("restart"), st.floats(0.0, 1e6), st.integers(0, 5)),
    ),
    max_size=30,
)


def _fed(seq: list[tuple], mtbf: float | None, *, reporting: bool = False) -> IntervalPolicy:
    policy = IntervalPolicy(tiers=("local", "persistent"), mtbf_seconds=mtbf)
    for step, obs in enumerate(seq):
        if obs[0] == "step":
            policy.observe_step(obs[1])
        elif obs[0] == "save":
            policy.observe_save(obs[1], obs[2], total_seconds=obs[2] * 2, step=step)
            policy.agree()
            if reporting:  # one rank logging its choice (report(): any rank, no collective)
                policy.report()
        elif obs[0] == "recovery":
            policy.observe_recovery(obs[1], obs[2])
        else:
            policy.observe_restart(obs[1], obs[2])
    policy.agree()
    return policy


@settings(max_examples=40, deadline=None)
@given(seq=observations, mtbf=st.one_of(st.none(), st.floats(60.0, 1e7)))
def test_the_policy_is_a_function_of_its_observations(seq, mtbf):
    """Two ranks fed the same observations choose the same steps and report the same;
    a rank that adopts another's snapshot decides as that one does."""
    a, b = _fed(seq, mtbf), _fed(seq, mtbf)
    for tier in ("local", "persistent"):
        assert a.next_save_step(100, tier) == b.next_save_step(100, tier) >= 1
    assert a.report() == b.report()
    c = IntervalPolicy(tiers=("local", "persistent"), mtbf_seconds=mtbf)
    c.adopt(json.loads(json.dumps(a.snapshot())))  # through JSON: a manifest's copy
    assert c.interval_steps("local") == a.interval_steps("local")
    assert c.interval_steps("persistent") == a.interval_steps("persistent")
    local, persistent = a.interval_steps("local"), a.interval_steps("persistent")
    if local is not None and persistent is not None:
        assert persistent % local == 0, "drains copy local steps"


def test_a_report_on_one_rank_changes_no_later_choice():
    """Identical agreed estimates (a save cost moved 0.4% between two agreements, within
    the ~1% a choice is kept for): the rank that called report() in between chooses
    what the other does; it used to keep the older choice (every 330 steps against 331:
    the ranks' collectives then mismatch)."""
    for cost in [3.90 + i * 0.002 for i in range(60)]:
        ranks = []
        for reporting in (True, False):
            policy = IntervalPolicy(mtbf_seconds=3600.0, alpha=1.0)
            policy.observe_step(0.5)
            policy.observe_save("persistent", cost, step=10)
            policy.agree()
            if reporting:
                policy.report()
            policy.observe_save("persistent", cost * 1.004, step=10)
            policy.agree()
            ranks.append(policy)
        assert ranks[0].agreed() == ranks[1].agreed()
        assert ranks[0].interval_steps() == ranks[1].interval_steps(), cost
        assert ranks[0].next_save_step(11) == ranks[1].next_save_step(11)


@settings(max_examples=40, deadline=None)
@given(seq=observations, mtbf=st.one_of(st.none(), st.floats(60.0, 1e7)))
def test_the_choice_does_not_depend_on_reports(seq, mtbf):
    """A rank calling report() after every agreement decides as one that never does."""
    a, b = _fed(seq, mtbf, reporting=True), _fed(seq, mtbf)
    for tier in ("local", "persistent"):
        assert a.next_save_step(100, tier) == b.next_save_step(100, tier)
    assert a.report() == b.report()


def test_the_interval_follows_the_measurements():
    """A slower store (a save costs 4x) lengthens the interval; an MTBF learned from
    frequent failures shortens it; the first save is due one step after the first asked."""
    policy = IntervalPolicy(mtbf_seconds=None, prior_mtbf_seconds=4 * 3600)
    assert policy.next_save_step(10) == 11 and policy.interval_steps() is None
    policy.observe_step(1.0)
    policy.observe_save("persistent", 2.0, step=11)
    policy.agree()
    before = policy.interval_steps()
    assert before is not None and policy.next_save_step(12) == 11 + before
    assert before == best_steps(1.0, 2.0, 2.0, 4 * 3600 + 3.0)
    for _ in range(10):
        policy.observe_save("persistent", 8.0, step=11)
    policy.agree()
    slower = policy.interval_steps()
    assert slower is not None and slower > 1.5 * before
    policy.observe_restart(3600.0, count=30, source="test")
    policy.agree()
    assert policy.interval_steps() < slower / 2  # type: ignore[operator]
    report = policy.report()
    assert "30 failure(s)" in report.mtbf_source and report.waste_seconds_per_hour is not None
    assert "interval auto: persistent every" in report.lines()[0]


def test_observations_out_of_range_are_ignored_and_arguments_checked():
    policy = IntervalPolicy(mtbf_seconds=3600)
    for bad in (-1.0, math.inf, math.nan, 1e12):
        policy.observe_step(bad)
        policy.observe_recovery(bad)
        policy.observe_save("persistent", bad)
    policy.agree()
    assert policy.report().step_seconds is None and policy.report().tiers[0].save_seconds is None
    with pytest.raises(ValueError, match="mtbf_seconds"):
        IntervalPolicy(mtbf_seconds=0.5)
    with pytest.raises(ValueError, match="tiers"):
        IntervalPolicy(tiers=("local",))
    with pytest.raises(ValueError, match="tier must be one of"):
        policy.observe_save("local", 1.0)


@pytest.mark.parametrize(
    "change",
    [
        {"step_seconds": "1"},
        {"step_seconds": -1.0},
        {"step_seconds": math.inf},
        {"failures": True},
        {"exposure": 1e300},
        {"save": {"elsewhere": {"cost": 1.0, "lag": 0.0, "n": 1}}},
        {"save": {"persistent": {"cost": 1e9, "lag": 0.0, "n": 1}}},
        {"save": {"persistent": [1, 2]}},
        {"restart_source": "x" * 1000},
        {"recovery": {"persistent": {"seconds": -1.0, "n": 1}}},
        {"recovery": []},
    ],
)
def test_a_hostile_snapshot_is_refused(change):
    good = IntervalPolicy(mtbf_seconds=3600).snapshot()
    validate_snapshot(good)
    with pytest.raises(ValueError, match="interval estimates"):
        validate_snapshot({**good, **change})


# -- the restart record -----------------------------------------------------------------------

NOW = 1_800_000_000.0


def test_the_record_counts_each_start_and_the_policy_learns_from_it(tmp_path):
    backend = backend_for(str(tmp_path))
    assert restarts.record_start(backend, NOW).restarts == 0
    for k in range(1, 5):
        seen = restarts.record_start(backend, NOW + 900 * k)
    assert seen.restarts == 4 and seen.exposure_seconds == 3600
    policy = IntervalPolicy(prior_mtbf_seconds=3600, prior_weight=1.0)
    policy.observe_restart(seen.exposure_seconds, seen.restarts)
    policy.agree()
    assert policy.mtbf()[0] == pytest.approx((3600 + 3600) / 5)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"format": "bcp-restarts", "version": 2, "starts": []}',
        b'{"format": "other", "version": 1, "starts": []}',
        b'{"format": "bcp-restarts", "version": 1, "starts": "1"}',
        b'{"format": "bcp-restarts", "version": 1, "starts": [1.0]}',  # 1970
        b'{"format": "bcp-restarts", "version": 1, "starts": [1e300]}',  # the future
        b'{"format": "bcp-restarts", "version": 1, "starts": [1800000000, true]}',
        b'{"format": "bcp-restarts", "version": 1, "starts": [1800000001, 1800000000]}',  # out of order
        b'{"format": "bcp-restarts", "version": 1, "starts": [NaN]}',
        json.dumps({"format": "bcp-restarts", "version": 1, "starts": [NOW] * 300}).encode(),
        b'{"format": "bcp-restarts", "version": 1, "starts": []' + b" " * (20 << 10) + b"}",
        b"[" * 100_000,
    ],
    ids=lambda d: d[:40].decode(errors="replace"),
)
def test_a_hostile_restart_record_is_refused_and_replaced(tmp_path, caplog, data):
    with pytest.raises(ValueError, match=r"."):
        restarts.decode(data, NOW)
    (tmp_path / restarts.KEY).write_bytes(data)
    caplog.set_level(logging.WARNING, logger="bcp.schedule.restarts")
    seen = restarts.record_start(backend_for(str(tmp_path)), NOW)
    assert seen.starts == (NOW,) and seen.restarts == 0
    assert "ignoring" in caplog.text and restarts.KEY in caplog.text
    assert restarts.decode((tmp_path / restarts.KEY).read_bytes(), NOW) == (NOW,)


def test_the_record_keeps_its_newest_starts(tmp_path):
    backend = backend_for(str(tmp_path))
    for k in range(restarts.MAX_STARTS + 10):
        seen = restarts.record_start(backend, NOW + k)
    assert len(seen.starts) == restarts.MAX_STARTS and seen.starts[-1] == NOW + restarts.MAX_STARTS + 9
    assert len((tmp_path / restarts.KEY).read_bytes()) <= restarts.MAX_BYTES


# -- several ranks ----------------------------------------------------------------------------


def test_every_rank_names_the_same_next_save_step(tmp_path):
    out = tmp_path / "chosen.txt"
    dist_jobs.spawn(interval_jobs.agreed_policy_job, 2, str(out))
    assert out.read_text().startswith("[(1, 'local'")


# -- the simulator ----------------------------------------------------------------------------


def test_the_simulator_ends_with_its_line():
    done = subprocess.run(
        [sys.executable, str(BENCH / "interval_sim.py"), "--quick", "--failures", "60", "--costs", "0.5,1.3,1.7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("fixed every 100 steps: worst") for line in lines)
    import re

    assert re.fullmatch(
        r"interval_sim: auto within -?\d+\.\d% of the best fixed interval over 6 traces, worst -?\d+\.\d%", lines[-1]
    ), lines[-1]


# -- the manager ------------------------------------------------------------------------------


def test_every_rank_of_an_auto_manager_saves_the_same_steps(tmp_path):
    out = tmp_path / "saved.txt"
    dist_jobs.spawn(interval_jobs.auto_manager_job, 2, str(tmp_path / "run"), str(out))
    saved = json.loads(out.read_text())
    assert bcp.CheckpointManager(tmp_path / "run").steps() == saved


def test_a_restarted_manager_starts_from_the_newest_estimates_and_counts_its_restarts(tmp_path, capsys):
    root = tmp_path / "run"
    state = {"w": torch.zeros(100)}
    with bcp.CheckpointManager(root, interval=bcp.IntervalPolicy(mtbf_seconds=1.0)) as manager:
        for step in range(60):
            time.sleep(0.02)
            manager.step(step, state)
        chosen = manager.report()
    assert chosen is not None and chosen.tiers[0].steps is not None
    assert len(manager.steps()) >= 2
    again = bcp.CheckpointManager(root, interval="auto")
    loaded, _ = again.load_latest(state)
    report = again.report()
    assert report is not None and loaded == manager.latest()
    assert report.step_seconds is not None and report.tiers[0].save_seconds is not None, "seeded from the manifest"
    assert "1 failure(s)" in report.mtbf_source and "average of 1 recovery" in report.tiers[0].recovery_source
    assert bcp.CheckpointManager(root).report() is None
    assert cli_main(["ls", str(root)]) == 0
    printed = capsys.readouterr().out
    assert "interval auto: persistent every" in printed and "MTBF 1 s (given)" in printed, printed
    assert cli_main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    (latest,) = [r for r in rows if r["latest"]]
    assert latest["interval"]["mtbf_seconds"] == 1.0 and latest["interval"]["tiers"][0]["tier"] == "persistent"
    assert all("interval" not in r for r in rows if not r["latest"])


def test_bcp_ls_says_when_the_interval_estimates_are_not_sane(tmp_path, capsys):
    root = tmp_path / "run"
    with bcp.CheckpointManager(root, interval="auto", async_save=False) as manager:
        for step in range(3):
            manager.step(step, {"w": torch.zeros(10)})
    doc = bcp.open(str(root / "step_0000000001")).manifest.user_metadata["bcp_manager"]
    doc["step"] = 9
    doc["interval"]["estimates"]["step_seconds"] = -5  # a newer step whose estimates are not sane
    bcp.save({"w": torch.zeros(10)}, str(root / "step_0000000009"), metadata={"bcp_manager": doc})
    assert cli_main(["ls", str(root)]) == 0
    assert "interval: unreadable (interval estimates: 'step_seconds' is -5" in capsys.readouterr().out
    assert cli_main(["ls", str(root), "--json"]) == 0
    (latest,) = [r for r in json.loads(capsys.readouterr().out) if r["latest"]]
    assert "'step_seconds' is -5" in latest["interval"]["error"]


def test_the_auto_interval_grows_when_the_store_slows_down(moto_server, tmp_path):
    """A real S3 server behind tests/netproxy.py: a few saves at loopback speed, then
    the same port answered by a proxy adding 0.1 s to every round trip; the manager's
    measured save cost grows and so does the interval it chooses."""
    bucket = new_bucket(moto_server)
    state = {"w": torch.randn(64, 64), "step": 0}
    policy = bcp.IntervalPolicy(mtbf_seconds=2.0, alpha=0.7)
    port = dist_jobs.free_port()

    step = 0

    def train(manager: bcp.CheckpointManager, saves: int) -> bcp.IntervalReport:
        nonlocal step
        while saves:
            step += 1
            time.sleep(0.01)  # a training step; nothing else between step() calls (it would count)
            manager.step(step, state)
            saves -= manager._started == step  # a save was made at this step
        report = manager.report()
        assert report is not None
        return report

    with proxied(moto_server.endpoint, port=port) as endpoint:
        uri = store_uri("moto", types.SimpleNamespace(endpoint=endpoint), bucket, "run")
        manager = bcp.CheckpointManager(uri, interval=policy, async_save=False)
        fast = train(manager, 3)
    with proxied(moto_server.endpoint, port=port, latency=0.1):
        slow = train(manager, 2)
        manager.close()
    (before,), (after,) = fast.tiers, slow.tiers
    assert before.seconds is not None and after.seconds is not None and after.save_seconds is not None
    assert after.save_seconds > 3 * before.save_seconds, (fast, slow)
    # in seconds of training: the steps also follow the step time, which a busy machine moves
    assert after.seconds > 1.3 * before.seconds, (fast, slow)


def test_an_auto_manager_with_a_local_tier_chooses_both_intervals(tmp_path):
    """Local saves and drains both follow the policy: the persistent interval is a
    multiple of the local one, drained steps reach the root, and a restart that recovers
    from the local tier measures that tier's recovery."""
    tier = bcp.LocalTier(keep_free=0.0, dir=tmp_path / "shm", every=1, persist_every=5, keep=2)
    policy = bcp.IntervalPolicy(tiers=("local", "persistent"), mtbf_seconds=2.0, local_loss_share=0.2)
    state = {"w": torch.zeros(1000)}
    with bcp.CheckpointManager(tmp_path / "run", tier=tier, interval=policy) as manager:
        for step in range(60):
            time.sleep(0.01)
            manager.step(step, state)
        report = manager.report()
    assert report is not None and [t.tier for t in report.tiers] == ["local", "persistent"]
    local, persistent = (t.steps for t in report.tiers)
    assert local is not None and persistent is not None and persistent % local == 0, report
    assert manager.steps() and manager.steps()[0] == 1, "the first save, drained"
    with pytest.raises(ValueError, match="tiers"):
        bcp.CheckpointManager(tmp_path / "other", interval=bcp.IntervalPolicy(tiers=("local", "persistent")))
    again = bcp.CheckpointManager(tmp_path / "run", tier=tier, interval="auto")
    step, _ = again.load_latest(state)
    after = again.report()
    assert step is not None and after is not None
    assert "average of 1 recovery" in after.tiers[0].recovery_source, after


@pytest.mark.parametrize(
    "doc",
    [
        "text",
        {"settings": "x"},
        {"settings": {"tiers": "persistent"}},
        {"settings": {"tiers": ["persistent"], "mtbf_seconds": "x"}},
        {"settings": {"tiers": ["persistent"], "alpha": math.nan}},
        {"settings": {"tiers": ["elsewhere"]}},
        {"settings": {"tiers": ["persistent"], "method": "guess"}},
    ],
)
def test_hostile_interval_metadata_is_refused(doc):
    good = {"settings": settings_of(IntervalPolicy()), "estimates": IntervalPolicy().snapshot()}
    assert report_from_metadata({"bcp_manager": {"interval": good}}) is not None
    assert report_from_metadata({"bcp_manager": {"step": 3}}) is None
    if isinstance(doc, dict) and isinstance(doc.get("settings"), dict):
        doc = {"settings": {**good["settings"], **doc["settings"]}, "estimates": good["estimates"]}
    with pytest.raises(ValueError, match="interval estimates"):
        report_from_metadata({"bcp_manager": {"interval": doc}})
