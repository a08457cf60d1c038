"""bcp's collectives never interleave: sync and async saves, loads, CheckpointManagers
and TrainingStates mixed on the same ranks all complete, and every checkpoint they
commit loads exactly (gloo, 2-3 processes; jobs in tests/order_jobs.py). The short
collective timeout makes an interleaving that deadlocks fail in seconds."""

from __future__ import annotations

import pytest
import torch

import dist_jobs
import order_jobs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("BCP_COLLECTIVE_TIMEOUT", "30")  # spawned ranks inherit it


def test_a_sync_save_while_an_async_save_commits(tmp_path):
    dist_jobs.spawn(order_jobs.async_then_sync_job, 2, str(tmp_path))


def test_loads_while_an_async_save_commits(tmp_path):
    dist_jobs.spawn(order_jobs.async_then_load_job, 2, str(tmp_path))


def test_a_manager_save_pending_across_bcp_save_and_load(tmp_path):
    dist_jobs.spawn(order_jobs.manager_and_save_job, 2, str(tmp_path))


def test_two_managers_saving_alternately(tmp_path):
    dist_jobs.spawn(order_jobs.two_managers_job, 2, str(tmp_path))


def test_random_interleavings_on_three_ranks(tmp_path):
    seeds, length = [0, 1, 2], 14
    dist_jobs.spawn(order_jobs.random_interleavings_job, 3, str(tmp_path), seeds, length)
    ran = (tmp_path / "sequences.txt").read_text().splitlines()
    assert ran == [f"seed {s}: {' '.join(order_jobs.random_sequence(s, length))}" for s in seeds]
    every_op = {op for s in seeds for op in order_jobs.random_sequence(s, length)}
    assert every_op == set(order_jobs.OPERATIONS), "the seeds cover every operation"


def test_random_sequences_are_the_same_on_every_rank():
    """What the job relies on: a sequence depends on its seed alone."""
    assert order_jobs.random_sequence(5, 20) == order_jobs.random_sequence(5, 20)
    assert order_jobs.random_sequence(5, 20) != order_jobs.random_sequence(6, 20)
