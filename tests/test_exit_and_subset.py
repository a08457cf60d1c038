"""The runtime paths of a real multi-process job: the last async save of a script that
ends (or destroys its process group) without wait() is committed on every rank;
CheckpointManager.close() waits; a save or load called by fewer ranks than its group
fails within BCP_RENDEZVOUS_TIMEOUT saying why, and process_group=bcp.LOCAL is the
single-process option (gloo, 2-3 processes; jobs in tests/subset_jobs.py, the
script in tests/exit_script.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import bcp
import dist_jobs
import exit_script
import subset_jobs
from bcp.metadata import MANIFEST_KEY

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

SCRIPT = pathlib.Path(__file__).with_name("exit_script.py")
RENDEZVOUS = 3.0  # BCP_RENDEZVOUS_TIMEOUT in these jobs
#: how long a call by rank 0 alone may take to fail: the rendezvous, plus slack for a loaded machine
BOUND = RENDEZVOUS + 7.0


def run_script(uri: pathlib.Path, mode: str, world: int = 2) -> list[subprocess.CompletedProcess]:
    """Run tests/exit_script.py as ``world`` real processes (one per rank)."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(dist_jobs.free_port()),
        WORLD_SIZE=str(world),
        BCP_COLLECTIVE_TIMEOUT="30",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(uri), mode],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    done = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{out}\n{err}"
    return done


def expected_w(world: int = 2) -> torch.Tensor:
    """The whole tensor the script's ranks save, each its rows."""
    rows = exit_script.ROWS
    per_rank = [torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + r * rows * 4 for r in range(world)]
    return torch.cat(per_rank)


def assert_committed(uri: pathlib.Path) -> None:
    reader = bcp.open(uri)
    assert reader.manifest.world_size == 2
    assert torch.equal(reader.read("w"), expected_w()) and reader.read("step") == 7


# -- exit and shutdown --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["end", "manager", "destroy"])
def test_the_last_async_save_is_committed_when_the_script_ends(tmp_path, mode):
    """The script returns (or calls destroy_process_group()) right after async_save,
    never calling wait(): every rank commits, at exit, and it loads exactly."""
    uri = tmp_path / "ck"
    done = run_script(uri, mode)
    for rank, proc in enumerate(done):
        assert "script done" in proc.stdout, proc.stdout
        assert "ERROR" not in proc.stderr, f"rank {rank}: {proc.stderr}"
        if mode != "manager":
            assert "save done=False" in proc.stdout, "the save was still in flight when the script ended"
    assert_committed(uri / "step_0000000007" if mode == "manager" else uri)


def test_destroy_process_group_while_the_commit_runs_still_commits(tmp_path):
    uri = tmp_path / "ck"
    done = run_script(uri, "destroy_late")
    for proc in done:
        assert "wait returned" in proc.stdout and "ERROR" not in proc.stderr, proc.stdout + proc.stderr
    assert_committed(uri)


def test_without_a_store_to_build_its_group_on_destroy_fails_loudly_at_once(tmp_path):
    """No MASTER_ADDR (init_method tcp:// or file://): bcp's background group is a
    new_group, which destroy_process_group() shuts down. The save fails on every
    rank with an ERROR naming destroy_process_group and saying nothing was committed,
    logged by the save's thread (before the exit handler's own report)."""
    uri = tmp_path / "ck"
    done = run_script(uri, "destroy_nostore")
    for rank, proc in enumerate(done):
        lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        assert lines, f"rank {rank} logged no error: {proc.stderr}"
        assert "destroy_process_group()" in lines[0] and "NOT committed" in lines[0], lines[0]
        assert "never waited for" in lines[-1], lines
    assert not (uri / MANIFEST_KEY).exists()
    assert not [p for p in uri.rglob("*") if p.is_file()], "the failed save left files"


def test_without_a_store_a_manifest_already_written_keeps_its_data(tmp_path):
    """Destroyed after the coordinator wrote the manifest: its data is kept (the
    checkpoint loads), rank 0's error says it is committed, rank 1's that it may be."""
    uri = tmp_path / "ck"
    done = run_script(uri, "destroy_late_nostore")
    assert "IS committed" in done[0].stderr and "wait raised" in done[0].stdout, done[0].stdout + done[0].stderr
    assert "may have committed" in done[1].stderr, done[1].stderr
    assert_committed(uri)


def test_manager_close_waits_for_the_pending_save(tmp_path):
    dist_jobs.spawn(subset_jobs.manager_close_job, 2, str(tmp_path / "run"))


# -- saves from a subset of ranks ---------------------------------------------------------------


@pytest.fixture
def rendezvous(monkeypatch):
    monkeypatch.setenv("BCP_RENDEZVOUS_TIMEOUT", str(RENDEZVOUS))
    monkeypatch.setenv("BCP_COLLECTIVE_TIMEOUT", "60")


@pytest.mark.parametrize(("what", "world"), [("save", 2), ("load", 2), ("async_save", 3)])
def test_a_call_by_rank_0_alone_fails_within_the_rendezvous_timeout(tmp_path, rendezvous, what, world):
    dist_jobs.spawn(subset_jobs.rank0_alone_job, world, str(tmp_path), what, BOUND)
    seconds = json.loads((tmp_path / f"elapsed-{what}.json").read_text())["seconds"]
    assert RENDEZVOUS - 0.5 <= seconds < BOUND, f"{what}: failed after {seconds:.2f} s"
    print(f"{what} by rank 0 alone of {world}: failed after {seconds:.2f} s")


def test_the_single_process_option_on_rank_0_alone_then_late_ranks_within_the_bound(tmp_path, rendezvous):
    dist_jobs.spawn(subset_jobs.local_option_job, 2, str(tmp_path), RENDEZVOUS / 2)


def test_a_group_of_some_ranks_saves_and_loads_alone(tmp_path, monkeypatch):
    # Not the 3 s rendezvous: rank 2's first bcp call (imports included) comes after
    # the pair's saves, and took over 3 s once on a loaded CI machine. No timeout is tested here.
    monkeypatch.setenv("BCP_RENDEZVOUS_TIMEOUT", "60")
    dist_jobs.spawn(subset_jobs.subgroup_job, 3, str(tmp_path))


def test_local_is_one_value_that_pickles_as_itself():
    import pickle

    assert pickle.loads(pickle.dumps(bcp.LOCAL)) is bcp.LOCAL
    assert repr(bcp.LOCAL) == "bcp.LOCAL"
    assert bcp.SaveOptions(process_group=bcp.LOCAL).process_group is bcp.LOCAL
