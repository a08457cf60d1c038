"""bcp.integrations.transformers: Trainer checkpoints mirrored to a bcp URI by
BcpCheckpointCallback and restored by restore_checkpoint; a run resumed from the store
is bit-identical to the uninterrupted one (1 process, and DDP over 2 gloo ranks)."""

from __future__ import annotations

import filecmp
import importlib
import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from bcp.backends import backend_for
from bcp.backends.memory import clear_memory_store
from bcp.errors import CorruptCheckpointError
from bcp.integrations import transformers as bcp_transformers
from bcp.integrations.transformers import (
    MANIFEST_NAME,
    BcpCheckpointCallback,
    complete_checkpoints,
    mirror_checkpoint,
    read_manifest,
    restore_checkpoint,
)
from dist_jobs import spawn
from trainer_jobs import (
    BIG_STEPS,
    SAVE_EVERY,
    STEPS,
    assert_resumed_bit_identical,
    big_ddp_job,
    ddp_job,
    params,
    run,
    trainer,
)

FILES = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """One uninterrupted run mirrored to a file URI (and, keeping only the last, to
    memory://), and a run resumed from its checkpoint 2 restored from the file URI."""
    work = tmp_path_factory.mktemp("trainer")
    uri = str(work / "store")
    keep_one = BcpCheckpointCallback("memory://trainer-keep/run", keep_last=1)
    yield work, uri, keep_one, run(str(work), uri, extra_callbacks=[keep_one])
    clear_memory_store("trainer-keep")


def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(one_run):
    _work, _uri, _keep, result = one_run
    assert_resumed_bit_identical(result, "1 process")


def test_every_file_of_the_checkpoint_round_trips_byte_for_byte(one_run):
    _work, uri, _keep, result = one_run
    restored, original = result["restored"], result["original"]
    assert set(os.listdir(restored)) >= FILES
    assert sorted(os.listdir(restored)) == sorted(os.listdir(original))
    _match, mismatch, errors = filecmp.cmpfiles(original, restored, os.listdir(original), shallow=False)
    assert mismatch == [] and errors == []
    assert complete_checkpoints(backend_for(uri)) == [SAVE_EVERY, STEPS]


def test_keep_last_deletes_older_checkpoints_from_the_store(one_run):
    _work, _uri, keep_one, _result = one_run
    assert keep_one.mirrored == [SAVE_EVERY, STEPS]
    backend = backend_for("memory://trainer-keep/run")
    assert complete_checkpoints(backend) == [STEPS]
    assert not any(k.startswith(f"checkpoint-{SAVE_EVERY}/") for k in backend.list())


def test_rng_state_matters_so_its_round_trip_is_tested(one_run, tmp_path):
    """Without rng_state.pth the resumed run's dropout masks differ: the bit-identical
    resume above depends on the RNG state coming back from the store."""
    _work, uri, _keep, result = one_run
    path = restore_checkpoint(uri, str(tmp_path / "restored"), step=SAVE_EVERY)
    os.remove(os.path.join(path, "rng_state.pth"))
    resumed, _ = trainer(str(tmp_path / "out"), str(tmp_path / "unused"))
    resumed.train(resume_from_checkpoint=path)
    got = params(resumed)
    assert any(not torch.equal(got[k], v) for k, v in result["full"].items())


def test_restore_takes_the_newest_complete_checkpoint(one_run, tmp_path):
    _work, uri, _keep, _result = one_run
    copy = str(tmp_path / "store")
    shutil.copytree(uri, copy)
    assert restore_checkpoint(copy, str(tmp_path / "a")) == str(tmp_path / "a" / f"checkpoint-{STEPS}")
    os.remove(os.path.join(copy, f"checkpoint-{STEPS}", MANIFEST_NAME))  # an upload that did not finish
    assert restore_checkpoint(copy, str(tmp_path / "b")) == str(tmp_path / "b" / f"checkpoint-{SAVE_EVERY}")
    assert restore_checkpoint(str(tmp_path / "empty"), str(tmp_path / "c")) is None


def test_a_corrupted_byte_is_detected_on_restore_naming_the_file(one_run, tmp_path):
    _work, uri, _keep, _result = one_run
    copy = str(tmp_path / "store")
    shutil.copytree(uri, copy)
    victim = tmp_path / "store" / f"checkpoint-{STEPS}" / "optimizer.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint-{STEPS}/optimizer\.pt: .* CRC32C") as caught:
        restore_checkpoint(copy, str(tmp_path / "out"))
    assert caught.value.file == f"checkpoint-{STEPS}/optimizer.pt"
    assert not os.path.exists(tmp_path / "out" / f"checkpoint-{STEPS}" / "optimizer.pt")


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "bcp.integrations.transformers")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'bcp-checkpoint\[transformers\]'"):
        importlib.import_module("bcp.integrations.transformers")


@pytest.mark.slow
def test_ddp_over_two_gloo_ranks_resumes_bit_identical(tmp_path):
    spawn(ddp_job, 2, str(tmp_path), str(tmp_path / "store"), str(tmp_path / "result.pt"))
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert_resumed_bit_identical(result, "2 ranks")
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(result["restored"]))


def test_temporary_and_vanished_files_are_left_out_and_stale_keys_deleted(tmp_path, monkeypatch):
    """Only the final files of the folder reach the store: temporary names are skipped,
    a file deleted before its upload is left out of the store and the manifest, and
    keys of an earlier upload of the same step are gone."""
    folder = tmp_path / "checkpoint-5"
    (folder / "sub").mkdir(parents=True)
    for name, data in {"model.safetensors": b"m" * 100, "sub/rng.pth": b"r", "gone.json": b"{}"}.items():
        (folder / name).write_bytes(data)
    (folder / ".tmpu0hIlS").write_bytes(b"half a model")
    (folder / "optimizer.pt.bcp-0123abcd.tmp").write_bytes(b"half a download")
    backend = backend_for(str(tmp_path / "store"))
    backend.write("checkpoint-5/stale.bin", b"from an upload that never finished")
    backend.write("checkpoint-5/model.safetensors", b"an older save of this step")
    upload = bcp_transformers.upload_file

    def upload_after_a_deletion(backend, key, path):
        if key.endswith("gone.json") and os.path.exists(path):
            os.remove(path)  # deleted after the listing, before its upload
        return upload(backend, key, path)

    monkeypatch.setattr(bcp_transformers, "upload_file", upload_after_a_deletion)
    files = mirror_checkpoint(str(folder), backend, "checkpoint-5")
    assert sorted(files) == ["model.safetensors", "sub/rng.pth"]
    assert read_manifest(backend, "checkpoint-5") == files
    assert sorted(backend.list("checkpoint-5/")) == sorted(
        ["checkpoint-5/model.safetensors", "checkpoint-5/sub/rng.pth", f"checkpoint-5/{MANIFEST_NAME}"]
    )
    assert backend.read("checkpoint-5/model.safetensors") == b"m" * 100


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_32_mib_model_saved_every_step_on_several_ranks_mirrors_and_resumes(tmp_path, world):
    """Rank 0 writes the 32 MiB model through a temporary file while the other ranks
    are already in on_save: they list the folder only after the barrier, so the store
    holds exactly the final files of each step, and the resume is bit-identical."""
    summary = tmp_path / "summary.json"
    spawn(big_ddp_job, world, str(tmp_path), str(tmp_path / "store"), str(summary))
    done = json.loads(summary.read_text())
    assert sorted(done["stored"]) == [f"checkpoint-{s}" for s in range(1, BIG_STEPS + 1)]
    for keys in done["stored"].values():
        assert not any(os.path.basename(k).startswith(".tmp") for k in keys), keys
        assert {f"rng_state_{r}.pth" for r in range(world)} <= set(keys)


def test_a_folder_with_nothing_in_it_is_refused_and_the_store_left_as_it_was(tmp_path):
    """The Trainer saved elsewhere (hyperparameter_search's run-<trial>/): on_save found no
    folder. Failed before: the store's copy of that step was deleted and an empty manifest
    written, which counted as complete and restored to a path that did not exist."""
    good = tmp_path / "good" / "checkpoint-2"
    good.mkdir(parents=True)
    (good / "model.safetensors").write_bytes(b"m" * 10)
    backend = backend_for(str(tmp_path / "store"))
    mirror_checkpoint(str(good), backend, "checkpoint-2")
    callback = BcpCheckpointCallback(str(tmp_path / "store"))
    args, state = SimpleNamespace(output_dir=str(tmp_path / "out")), SimpleNamespace(global_step=2)
    with pytest.raises(FileNotFoundError, match=r"out/checkpoint-2: no checkpoint files there to mirror"):
        callback.on_save(args, state, None)
    assert complete_checkpoints(backend) == [2]
    assert list(read_manifest(backend, "checkpoint-2")) == ["model.safetensors"]


def test_keep_last_after_a_rollback_keeps_the_checkpoint_just_mirrored(tmp_path):
    """Resumed from step 4 with the abandoned run's step 8 still in the store: the new
    step 6 counts as the newest. Failed before: keep_last=1 deleted step 6 at once (8
    outranked it) and a restart restored the abandoned run."""
    backend = backend_for(str(tmp_path / "store"))
    for step in (4, 8, 6):  # the order the two runs mirrored them
        folder = tmp_path / "out" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([step]) * 8)
    callback = BcpCheckpointCallback(str(tmp_path / "store"), keep_last=1)
    for step in (4, 8, 6):
        callback.on_save(SimpleNamespace(output_dir=str(tmp_path / "out")), SimpleNamespace(global_step=step), None)
    assert complete_checkpoints(backend) == [6]
