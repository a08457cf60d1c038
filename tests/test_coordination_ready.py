"""bcp's groups are ready before a save's phases start, and each phase enters the
coordination package once (docs/distributed.md, "Groups ready before the phases")."""

from __future__ import annotations

import pytest

import coordination_jobs
import dist_jobs


@pytest.mark.parametrize(("async_save", "tier"), [(False, False), (True, False), (True, True)])
def test_a_managers_saves_create_no_group(tmp_path, async_save, tier):
    local = str(tmp_path / "local") if tier else ""
    dist_jobs.spawn(coordination_jobs.no_group_created_in_manager_saves_job, 2, str(tmp_path / "ck"), async_save, local)


def test_the_first_async_save_creates_its_groups_before_its_first_phase(tmp_path):
    dist_jobs.spawn(coordination_jobs.free_async_save_groups_before_phases_job, 2, str(tmp_path / "ck"))


@pytest.mark.parametrize("async_save", [False, True])
def test_each_phase_of_a_managers_save_enters_the_package_once(tmp_path, async_save):
    dist_jobs.spawn(coordination_jobs.phases_enter_once_job, 3, str(tmp_path / "ck"), async_save)
