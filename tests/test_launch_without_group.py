"""A job launched as several processes that never calls ``init_process_group``
(issue 36): before, rank 0 saved as if alone and rank 1 was told to pass
``overwrite=True``, which would make the ranks race. Now save, async_save, load and
the manager refuse on every rank, naming ``torch.distributed.init_process_group``
and ``process_group=bcp.LOCAL``; LOCAL still saves from one process, and a launch
of one process (``WORLD_SIZE=1``) is a single process as before."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.coordination.lanes import RANK_VARIABLES, WORLD_SIZE_VARIABLES, launched_among_several
from bcp.errors import ProcessGroupMissingError
from helpers import examples

SCRIPT = pathlib.Path(__file__).with_name("no_group_script.py")
LAUNCH_VARIABLES = (*WORLD_SIZE_VARIABLES, *RANK_VARIABLES, "SLURM_NTASKS", "LOCAL_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher's variables (the test run itself may be under one)."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def state() -> dict:
    return {"w": torch.arange(8, dtype=torch.float32), "step": 5}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_torchrun_without_init_process_group_is_refused_on_every_rank(tmp_path):
    """Two real processes under torchrun: every collective call raises
    ProcessGroupMissingError on both ranks, nothing is written where they would
    have raced, and process_group=bcp.LOCAL saves and loads each rank's own."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, tmp_path],
        env={**env, "BCP_COLLECTIVE_TIMEOUT": "30"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")), key=str)
    assert [r["rank"] for r in results] == ["0", "1"], done.stdout
    for r in results:
        for call in ("save", "async_save", "load", "manager"):
            kind, message = r[call]
            assert kind == "ProcessGroupMissingError", (r["rank"], call, message)
            assert "WORLD_SIZE=2" in message
            assert "torch.distributed.init_process_group()" in message and "process_group=bcp.LOCAL" in message
            assert "overwrite" not in message
        assert r["local"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]  # nothing at shared/ or managed/


@pytest.mark.parametrize("variable", ["RANK=1", "SLURM_PROCID=3", "SLURM_STEP_NUM_TASKS=4", "OMPI_COMM_WORLD_SIZE=2"])
def test_a_rank_of_several_without_a_group_writes_nothing(clean_env, tmp_path, variable):
    name, value = variable.split("=")
    clean_env.setenv(name, value)
    with pytest.raises(ProcessGroupMissingError, match="init_process_group") as caught:
        bcp.save(state(), tmp_path / "ck")
    assert caught.value.variable == variable and caught.value.operation == "bcp.save"
    with pytest.raises(ProcessGroupMissingError):
        bcp.CheckpointManager(tmp_path / "managed")
    assert list(tmp_path.iterdir()) == []
    bcp.save(state(), tmp_path / "alone", process_group=bcp.LOCAL)
    back = bcp.load({"w": torch.zeros(8), "step": 0}, tmp_path / "alone", process_group=bcp.LOCAL)
    assert torch.equal(back["w"], state()["w"]) and back["step"] == 5


def test_a_launch_of_one_process_is_a_single_process(clean_env, tmp_path):
    """torchrun --nproc_per_node 1 (and Lightning on one device) set WORLD_SIZE=1 and
    rank 0: nothing changes."""
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "SLURM_NTASKS": "8"}.items():
        clean_env.setenv(name, value)
    bcp.save(state(), tmp_path / "ck")
    back = bcp.load({"w": torch.zeros(8), "step": 0}, tmp_path / "ck")
    assert torch.equal(back["w"], state()["w"])
    with bcp.CheckpointManager(tmp_path / "managed", async_save=False) as manager:
        manager.save(1, state())
    assert manager.steps() == [1]


numbers = st.one_of(st.integers(0, 9).map(str), st.sampled_from(["", " 2", "x", "-1", "01"]))


@settings(max_examples=examples(200), deadline=None)
@given(st.dictionaries(st.sampled_from(LAUNCH_VARIABLES), numbers))
def test_several_exactly_when_a_world_size_is_above_one_or_a_rank_above_zero(environ):
    several = any(
        v.strip().isdigit() and int(v) > (1 if k in WORLD_SIZE_VARIABLES else 0)
        for k, v in environ.items()
        if k in WORLD_SIZE_VARIABLES or k in RANK_VARIABLES
    )
    found = launched_among_several(environ)
    assert (found is not None) == several
    if found is not None:
        name, value = found.split("=")
        assert environ[name].strip() == value
