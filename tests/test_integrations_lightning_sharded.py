"""bcp.integrations.lightning's sharded strategies with the real Lightning:
BcpModelParallelStrategy (FSDP2 in ``configure_model``) on 1 and 2 gloo ranks, resumed
bit-identically against an uninterrupted run, resumed on another number of ranks
exactly, retention through bcp.delete, and errors naming the checkpoint and the key
(tests/lightning_sharded_jobs.py). BcpFSDPStrategy (FSDP1) needs a GPU: tests/test_cuda.py."""

from __future__ import annotations

import pathlib
import uuid

import pytest

pytest.importorskip("lightning")

from bcp.backends.memory import clear_memory_store
from bcp.integrations.lightning import BcpFSDPStrategy, BcpModelParallelStrategy, checkpoint_uri
from dist_jobs import spawn
from lightning_sharded_jobs import batchnorm_fit, sharded_details, sharded_reload, sharded_resume, sharded_save


def test_path_objects_become_the_uris_they_were_made_from():
    assert checkpoint_uri(pathlib.PurePosixPath("memory://store/run/epoch=1.ckpt")) == "memory://store/run/epoch=1.ckpt"
    assert checkpoint_uri(pathlib.PurePosixPath("s3://bucket/run")) == "s3://bucket/run"
    assert checkpoint_uri("memory://store/x") == "memory://store/x"
    assert checkpoint_uri(pathlib.PurePosixPath("file:/abs/run")) == "file:/abs/run"  # RFC 8089's one-slash form
    assert checkpoint_uri(pathlib.PurePosixPath("runs/ck")) == "runs/ck"
    assert checkpoint_uri(pathlib.PurePosixPath("nosuchscheme:/x")) == "nosuchscheme:/x"  # not bcp's: a plain path


def test_strategies_refuse_a_full_checkpoint_setting():
    with pytest.raises(ValueError, match="save_distributed_checkpoint=True"):
        BcpModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="state_dict_type='sharded'"):
        BcpFSDPStrategy(state_dict_type="full")
    s = BcpModelParallelStrategy(2, 1, storage_options={"fsync": False}, save_distributed_checkpoint=True)
    assert s.storage_options == {"fsync": False} and not s.allow_pickle


@pytest.mark.slow
def test_sharded_resume_one_rank_in_memory():
    store = f"lf{uuid.uuid4().hex[:10]}"
    try:  # memory:// is per process: one rank
        spawn(sharded_resume, 1, f"memory://{store}")
    finally:
        clear_memory_store(store)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_resume_is_bit_identical(tmp_path, world):
    spawn(sharded_resume, world, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_sharded_resume_on_another_number_of_ranks_is_exact(tmp_path, saved, resumed):
    spawn(sharded_save, saved, str(tmp_path))
    spawn(sharded_reload, resumed, str(tmp_path))


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_fully_sharded_exactly(tmp_path):
    spawn(sharded_save, 2, str(tmp_path), "tp")
    spawn(sharded_reload, 2, str(tmp_path), "fsdp")


@pytest.mark.slow
def test_batchnorm_statistics_are_saved_from_rank_0(tmp_path):
    spawn(batchnorm_fit, 2, str(tmp_path))


def test_sharded_validate_and_errors(tmp_path):
    spawn(sharded_details, 1, str(tmp_path))
