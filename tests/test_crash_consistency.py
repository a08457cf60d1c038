"""A CheckpointManager training job killed at its file events by the external crash
tool ckpt-chaos (PyPI): every resume must continue from a committed step and end
with the uninterrupted run's weights, byte for byte.

This is the CI-sized run (a few crash points, spread over the three modes; ckpt-chaos
runs two points at a time, as CI has 2 cores and a point's runs are one process each
that mostly imports); the full runs (every event, sync and async, under load) are
described in docs/reliability.md. The job
is tests/chaos/manager_job.py; tests/chaos/tier_job.py is the same training with the
local tier on 2 simulated hosts (one process each, ckpt-chaos --ranks 2), killed on
one host.

ckpt-chaos starts every run's process (the fault-free one, the control, each crash and
each resume) as ``tests/chaos/fork_server.py run``: a fork of a server that imported
torch and bcp once runs the job script, armed by ckpt-chaos's own start-up hook, instead
of a process importing them anew (3-4 s of CPU a run; the same file events, checked).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bcp.backends import backend_for as bcp_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "chaos" / "manager_job.py"
TIER_JOB = ROOT / "tests" / "chaos" / "tier_job.py"
INCREMENTAL_JOB = ROOT / "tests" / "chaos" / "incremental_job.py"
FORK_SERVER = ROOT / "tests" / "chaos" / "fork_server.py"


def _chaos() -> str:
    exe = shutil.which("ckpt-chaos") or str(pathlib.Path(sys.executable).with_name("ckpt-chaos"))
    if not pathlib.Path(exe).exists():
        pytest.skip("ckpt-chaos is not installed (pip install ckpt-chaos: the test extra has it)")
    return exe


@pytest.fixture(scope="module")
def job_server(tmp_path_factory) -> Iterator[list[str]]:
    """A fork server for the jobs (tests/chaos/fork_server.py); the command prefix that runs a script through it."""
    sock = str(tmp_path_factory.mktemp("chaos-server") / "s")
    assert len(sock) < 100, f"a Unix socket path must be short: {sock}"
    server = subprocess.Popen(
        [sys.executable, str(FORK_SERVER), "serve", sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline()
        assert line.strip() == "ready", f"the fork server did not start: {line!r}"
        yield [sys.executable, str(FORK_SERVER), "run", sock]
    finally:
        server.stdin.close()  # the server ends when its stdin does
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_a_resumed_job_that_exits_without_saving_exits_cleanly(tmp_path):
    """Found by ckpt-chaos: a job resumed at its last step (nothing left to save) exited
    while the staging reservation that load_latest starts was still allocating, and
    the process aborted ("terminate called without an active exception"). Plain
    processes, not the fork server: the race needs a real interpreter's teardown."""
    run = [sys.executable, str(JOB), str(tmp_path), "async", "2"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "fresh start" in first.stdout, first.stdout + first.stderr
    again = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 1" in again.stdout and "terminate called" not in again.stderr


def _run_chaos(
    tmp_path, chaos_options: list[str], job: list[str], env: dict | None = None, modes: str = "before,torn,term"
) -> list[dict]:
    """Run ckpt-chaos on ``job`` (its crash points in before/torn/term modes, the final
    weights judged against the control run's); check that it passed, that the control
    run and at least 3 crash points were judged and that no resume raised; every
    point's result.json."""
    work = tmp_path / "chaos"
    command = [
        _chaos(),
        "run",
        *chaos_options,
        "--result-file",
        "{out}/final.pt",
        "--step-regex",
        r"resumed from step (\d+)",
        "--modes",
        modes,
        "--timeout",
        "240",
        "--work",
        str(work),
        "--",
        *job,
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=tmp_path, env=env)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    results = [json.loads(p.read_text()) for p in work.glob("pt_*/result.json")]
    assert len(results) >= 4, report  # the control run and crash points were judged
    assert "SILENT_DIVERGENCE" not in report and "HARD_FAIL" not in report, report
    assert all(r["outcome"]["raised"] is None for r in results), report
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_manager_job_always_resumes_exactly(mode, tmp_path, job_server):
    """4 points (ckpt-chaos spreads each mode's share evenly over the events): "before"
    at the first file event (nothing written yet) and at the middle one (mid-save),
    "torn" at the first write that can be torn, "term" (SIGTERM, then a kill) at the
    first event."""
    _run_chaos(tmp_path, ["--max-points", "4", "--jobs", "2"], [*job_server, str(JOB), "{out}", mode, "4"])


@pytest.mark.slow
def test_killed_incremental_job_always_resumes_exactly(tmp_path, job_server):
    """tests/chaos/incremental_job.py: incremental saves (base = the newest committed
    step) with retention by bcp.delete (keep 1: each older step retired, kept for its
    readers) killed at its file events: mid-save, mid-hold, mid-deletion. Every resume
    collects what gc may, verifies every committed step (verify_root: no step refers to
    bytes that are gone), loads the newest and checks it against the digest that step
    recorded (the job raises otherwise); the final weights match the control run's."""
    # 13 "before" points spread evenly over the job's ~87 file events (4 saves of ~15 events,
    # holds and deletions): each save's data, catalog and commit, the holds of steps 1-3, and
    # the deletions of steps 1 and 2 after their manifest went (their generations and holds
    # left for the resume's gc); about 11 s here. Other file events in a save shift the points.
    options = ["--max-points", "13", "--jobs", "2"]
    results = _run_chaos(tmp_path, options, [*job_server, str(INCREMENTAL_JOB), "{out}", "4"], modes="before")
    crashes = [r for r in results if r["label"] != "no crash (control)"]
    assert len(crashes) >= 10 and all(r["crashed"] for r in crashes), results
    holds = [r for r in crashes if r["event"][1].startswith("step_")]  # a hold's partial file or its rename
    assert holds, f"no crash point while holds were written: {[r['event'] for r in crashes]}"
    assert max(r["outcome"]["resumed_from_step"] or 0 for r in crashes) >= 2, "no crash after retention deleted"
    from bcp.discovery import committed_steps
    from bcp.verify import verify_root

    roots = sorted((tmp_path / "chaos").glob("pt_*/out/ckpt"))
    assert len(roots) == len(results), roots
    for root in roots:  # after each resumed run: the last step (and one a kill kept from deletion), whole
        steps = committed_steps(bcp_backend(str(root)))
        assert steps[-1] == 3 and len(steps) <= 2, (root, steps)
        report = verify_root(str(root))
        assert report["ok"] and report["fragments"] > 0, report["problems"]


@pytest.mark.slow
def test_killed_two_host_tier_job_always_resumes_exactly(tmp_path, job_server):
    """The local tier's job on 2 simulated hosts, host 1's process killed at its file
    events (its local saves, the replicas it receives, its part of the drains); the
    resume recovers from the local tier or the drained steps and must end bit-exact."""
    # ckpt-chaos 0.1.8's run mode arms rank CKPT_CHAOS_CRASH_RANK (default 0), not --crash-rank: set both
    env = dict(os.environ, CKPT_CHAOS_CRASH_RANK="1")
    # "torn" tears Python open() writes: the local tier writes none (every file through an
    # O_NOFOLLOW descriptor), so before/term share the points, spread over host 1's events.
    # 3 points: "before" at host 1's first event (the job's directory, nothing written) and
    # at its middle one (the local save of step 1), "term" at the first event; "term" at
    # the middle event added a second kill of the same save with nothing new to judge.
    options = ["--ranks", "2", "--crash-rank", "1", "--max-points", "3", "--jobs", "2"]
    results = _run_chaos(tmp_path, options, [*job_server, str(TIER_JOB), "{out}", "4"], env, modes="before,term")
    crashes = [r for r in results if r["label"] != "no crash (control)"]
    assert crashes and all(r["crashed"] for r in crashes), f"a crash point did not kill host 1: {results}"


STEP_JOB = ROOT / "tests" / "chaos" / "step_job.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_preempted_step_job_saves_at_the_notice_and_resumes_exactly(mode, tmp_path, job_server):
    """Issue 40: ckpt-chaos's "term" mode (SIGTERM at a file event of a save, a kill after
    the grace period) on a job saving through ``CheckpointManager.step`` with preemption
    on, every 2 steps. A notice inside the save of an even step is saved by the next
    step() at the next (odd) step, committed, and the job exits before the kill: the
    resume goes on from that step and ends bit-exact."""
    job = [*job_server, str(STEP_JOB), "{out}", mode, "6"]
    results = _run_chaos(tmp_path, ["--max-points", "3", "--jobs", "2"], job, modes="term")
    crashes = [r for r in results if r["label"] != "no crash (control)"]
    assert crashes, results
    for r in crashes:  # stopped by step() after the notice, before the kill, and resumed from the step it saved
        assert r["rc"] == 0 and not r["crashed"] and r["outcome"]["resumed_from_step"] is not None, r
    # a notice inside the save of an even step is saved at the next (odd) step: not a step of the interval
    assert any(r["outcome"]["resumed_from_step"] % 2 == 1 for r in crashes), results


INCREMENTAL_MANAGER_JOB = ROOT / "tests" / "chaos" / "incremental_manager_job.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_incremental_manager_job_always_resumes_exactly(mode, tmp_path, job_server):
    """tests/chaos/incremental_manager_job.py: ``CheckpointManager(incremental=True,
    keep_last=2)`` itself, sync and async, killed at its file events: mid-save, mid-hold,
    mid-retention (a step's deletion, a retired generation's collection). Every resume
    (and the control run's end) verifies every committed step (verify_root) and loads each
    against the digest it saved (the job raises otherwise); the final weights match the
    control run's; afterwards each root holds the newest two steps, whole.

    BCP_CHAOS_POINTS=N raises the number of "before" points (1000: every file event)."""
    points = os.environ.get("BCP_CHAOS_POINTS", "6")
    options = ["--max-points", points, "--jobs", "2"]
    job = [*job_server, str(INCREMENTAL_MANAGER_JOB), "{out}", mode, "4"]
    results = _run_chaos(tmp_path, options, job, modes="before")
    crashes = [r for r in results if r["label"] != "no crash (control)"]
    assert len(crashes) >= min(int(points), 6) and all(r["crashed"] for r in crashes), results
    assert max(r["outcome"]["resumed_from_step"] or 0 for r in crashes) >= 2, "no crash after retention deleted"
    from bcp.discovery import committed_steps
    from bcp.verify import verify_root

    roots = sorted((tmp_path / "chaos").glob("pt_*/out/ckpt"))
    assert len(roots) == len(results), roots
    for root in roots:
        assert committed_steps(bcp_backend(str(root))) == [2, 3], root
        report = verify_root(str(root))
        assert report["ok"] and report["fragments"] > 0, report["problems"]


INCREMENTAL_TIER_JOB = ROOT / "tests" / "chaos" / "incremental_tier_job.py"


@pytest.mark.slow
@pytest.mark.parametrize("crash_rank", [0, 1])
def test_killed_incremental_drains_never_commit_a_step_missing_bytes(crash_rank, tmp_path, job_server):
    """tests/chaos/incremental_tier_job.py: ``LocalTier(incremental=True)`` on 2 simulated
    hosts, every second step drained to the root as an incremental step (holds on the
    root's older steps, the referenced files it lacks uploaded under their steps' names),
    host 0 (the drains' coordinator: holds, catalog, manifest) or host 1 (its data files
    and its share of the referenced ones) killed at its file events. Every resume (and
    the control run's end) verifies every committed step of the root and loads each
    against its digest (the job raises otherwise) and recovers from the local tier or the
    root; the final weights match the control run's; afterwards every root verifies.

    BCP_CHAOS_POINTS=N raises the number of points (1000: every file event)."""
    env = dict(os.environ, CKPT_CHAOS_CRASH_RANK=str(crash_rank))
    points = os.environ.get("BCP_CHAOS_POINTS", "3")
    options = ["--ranks", "2", "--crash-rank", str(crash_rank), "--max-points", points, "--jobs", "2"]
    job = [*job_server, str(INCREMENTAL_TIER_JOB), "{out}", "4"]
    results = _run_chaos(tmp_path, options, job, env, modes="before")
    crashes = [r for r in results if r["label"] != "no crash (control)"]
    # with every file event (BCP_CHAOS_POINTS=1000) a few of the last may not come (the
    # resumed run's events drift: latest.json of the final drain); 3 points all kill
    killed = sum(r["crashed"] for r in crashes)
    assert crashes and killed >= 0.9 * len(crashes), f"crash points did not kill host {crash_rank}: {results}"
    from bcp.discovery import committed_steps
    from bcp.verify import verify_root

    for root in sorted((tmp_path / "chaos").glob("pt_*/out/ckpt")):
        # steps 0 and 2 are drained (a drain killed is not made again: the resume goes on from the local step)
        steps = committed_steps(bcp_backend(str(root)))
        assert steps in ([0], [2], [0, 2]), (root, steps)
        report = verify_root(str(root))
        assert report["ok"] and report["fragments"] > 0, report["problems"]
