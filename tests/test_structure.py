"""The shape of the package: one error hierarchy whose errors survive pickling (the
way they travel between ranks), one options type for every save, and no second
copy of a layer imported under another name."""

from __future__ import annotations

import fractions
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bcp
import bcp.errors
from bcp.backends import StorageError
from bcp.metadata.format_errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]

#: one instance of every public error, with its fields set
EXAMPLES = [
    bcp.errors.CheckpointNotFoundError("no checkpoint at x"),
    bcp.errors.IncompleteCheckpointError("no manifest"),
    bcp.errors.CheckpointExistsError("exists"),
    bcp.errors.CorruptCheckpointError("bad crc", fqn="w", file="gen-1/data/rank00000-0.bin", offset=4096),
    bcp.errors.CorruptManifestError("manifest.json: its CRC32C does not match"),
    bcp.errors.UnsupportedStateError("cannot save a lambda"),
    bcp.errors.PickleNotAllowedError("pickled", fqn="sched"),
    bcp.errors.ShardingError("shards overlap"),
    bcp.errors.ReplicaMismatchError("'x' (rank 1 differs from rank 0)", differing={"x": {0: [1]}}),
    bcp.errors.RankFailedError("rank 1 failed", errors={1: bcp.errors.ShardingError("overlap")}),
    bcp.errors.GroupConnectError("rank 2: set GLOO_SOCKET_IFNAME", rank=2, address="127.0.1.1"),
    bcp.errors.ConversionError("DCP could not write /x: KeyError: 'w'", errors={0: KeyError("w")}),
    bcp.errors.RanksMissingError("bcp.save: rank 1 did not call it", missing=[1], operation="bcp.save"),
    bcp.errors.ProcessGroupMissingError("bcp.save: WORLD_SIZE=2", variable="WORLD_SIZE=2", operation="bcp.save"),
    bcp.errors.StateMismatchError(
        "file:///x",
        missing=["a"],
        unexpected=["b"],
        shape_mismatch=[("c", (1,), (2,))],
        dtype_mismatch=[("d", "float32", "bfloat16")],
        kind_mismatch=[],
    ),
    bcp.errors.FormatError("manifest.json: field 'world_size' missing"),
    bcp.errors.StorageError("disk full", uri="file:///x", key="k", action="writing"),
    bcp.errors.ObjectNotFoundError("no such object", uri="s3://b/p", key="k", action="reading"),
    bcp.errors.ObjectExistsError("already there", uri="s3://b/p", key="manifest.json", action="committing"),
    bcp.errors.TransientError("503 SlowDown", uri="s3://b/p", key="k", action="writing"),
    bcp.errors.WriterClosedError("writer already committed", uri="file:///x", key="k", action="writing"),
]


def test_every_exported_error_has_an_example():
    exported = {getattr(bcp.errors, n) for n in bcp.errors.__all__}
    assert exported - {CheckpointError} == {type(e) for e in EXAMPLES}


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_errors_survive_pickling_with_type_message_and_fields(error):
    error.add_note("raised on the coordinator")
    error.extra_field = 7  # type: ignore[attr-defined]  # attributes added after construction travel too
    copy = pickle.loads(pickle.dumps(error))
    assert copy.__notes__ == ["raised on the coordinator"]
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    fields = {k: v for k, v in vars(error).items() if k != "__notes__"}
    assert {k: v for k, v in vars(copy).items() if k != "__notes__"}.keys() == fields.keys()
    for name, value in fields.items():
        if isinstance(value, dict) and all(isinstance(v, BaseException) for v in value.values()):
            assert {r: (type(v), str(v)) for r, v in getattr(copy, name).items()} == {
                r: (type(v), str(v)) for r, v in value.items()
            }
        else:
            assert getattr(copy, name) == value, name


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_one_of_two_roots(error):
    assert isinstance(error, CheckpointError) != isinstance(error, StorageError), "exactly one root"
    if isinstance(error, StorageError):
        assert isinstance(error, OSError), "storage errors are OSErrors"


def test_format_and_sharding_errors_are_checkpoint_errors():
    assert issubclass(bcp.FormatError, bcp.CheckpointError)
    assert issubclass(bcp.ShardingError, bcp.UnsupportedStateError)
    assert not issubclass(bcp.ShardingError, ValueError), "one kind of built-in error per class"


def test_unpicklable_error_is_carried_as_its_message():
    from bcp.coordination.collectives import portable

    class Holding(Exception):
        def __init__(self, message):
            super().__init__(message)
            self.lock = __import__("threading").Lock()

    sent = portable(Holding("disk on fire")).restore()
    assert isinstance(sent, bcp.RankFailedError) and "Holding: disk on fire" in str(sent)
    error = bcp.CorruptCheckpointError("bad", fqn="w")
    back = portable(error).restore()
    assert type(back) is bcp.CorruptCheckpointError and back.fqn == "w" and str(back) == "bad"


def test_large_error_travels_as_its_message():
    from bcp.coordination.collectives import MAX_ERROR_PICKLE_BYTES, portable

    big = bcp.UnsupportedStateError("too big")
    big.payload = b"x" * (MAX_ERROR_PICKLE_BYTES + 1)  # type: ignore[attr-defined]
    sent = portable(big)
    assert sent.pickled is None
    assert str(sent.restore()) == "UnsupportedStateError: too big"


def test_error_that_cannot_be_rebuilt_falls_back_to_its_message():
    from bcp.coordination.collectives import SentError

    sent = SentError("Weird", "no such class here", b"not a pickle")
    back = sent.restore()
    assert isinstance(back, bcp.RankFailedError) and str(back) == "Weird: no such class here"


def test_verify_skips_pickled_objects_by_type(tmp_path):
    uri = str(tmp_path / "ck")

    bcp.save({"w": torch.ones(2), "o": fractions.Fraction(1, 3)}, uri, allow_pickle=True)  # no safe encoding
    reader = bcp.open(uri)
    with pytest.raises(bcp.PickleNotAllowedError) as caught:
        reader.read_object("o")
    assert caught.value.fqn == "o"
    from bcp.verify import verify_checkpoint

    report = verify_checkpoint(uri)
    assert report["ok"] and report["problems"] == [], report


# -- options ---------------------------------------------------------------------------


def test_save_options_are_shared_and_keywords_override(tmp_path):
    opts = bcp.SaveOptions(metadata={"run": "a"}, checksum_block_bytes=4096)
    bcp.save({"w": torch.ones(3)}, str(tmp_path / "a"), opts)
    bcp.save({"w": torch.ones(3)}, str(tmp_path / "a"), opts, overwrite=True, metadata={"run": "b"})
    manifest = bcp.open(str(tmp_path / "a")).manifest
    assert manifest.user_metadata == {"run": "b"} and manifest.checksum_block_bytes == 4096
    bcp.async_save({"w": torch.ones(3)}, str(tmp_path / "b"), opts).wait()
    assert bcp.open(str(tmp_path / "b")).manifest.user_metadata == {"run": "a"}


@pytest.mark.parametrize("call", ["save", "async_save"])
def test_unknown_save_option_names_the_known_ones(tmp_path, call):
    with pytest.raises(TypeError, match=r"unknown save option\(s\) overwite; the options are: overwrite, metadata"):
        getattr(bcp, call)({"w": torch.ones(1)}, str(tmp_path / "x"), overwite=True)
    assert not (tmp_path / "x").exists()


def test_save_options_are_frozen_and_checked():
    with pytest.raises(AttributeError):
        bcp.SaveOptions().overwrite = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="checksum_block_bytes"):
        bcp.SaveOptions(checksum_block_bytes=0)


def test_async_save_takes_metadata_at_the_call(tmp_path):
    metadata = {"run": "a", "tags": ["x"]}
    handle = bcp.async_save({"w": torch.ones(2)}, str(tmp_path / "ck"), metadata=metadata)
    metadata["run"] = object()  # changed (and made unsaveable) while the save is in flight
    metadata["tags"].append("y")
    handle.wait()
    assert bcp.open(str(tmp_path / "ck")).manifest.user_metadata == {"run": "a", "tags": ["x"]}


def test_manager_save_takes_save_options_but_not_the_ones_it_owns(tmp_path):
    manager = bcp.CheckpointManager(str(tmp_path), async_save=False)
    manager.save(1, {"w": torch.ones(2)}, options=bcp.SaveOptions(checksum_block_bytes=4096))
    assert bcp.open(manager.uri(1)).manifest.checksum_block_bytes == 4096
    manager.save(1, {"w": torch.zeros(2)}, overwrite=True)
    assert torch.equal(bcp.open(manager.uri(1)).read("w"), torch.zeros(2))
    with pytest.raises(TypeError, match="metadata belong to the manager"):
        manager.save(2, {"w": torch.ones(2)}, metadata={"x": 1})
    with pytest.raises(TypeError, match="storage_options belong to the manager"):
        manager.save(2, {"w": torch.ones(2)}, options=bcp.SaveOptions(storage_options={"fsync": "false"}))
    assert manager.steps() == [1]


@pytest.mark.parametrize(
    ("options", "kwargs"), [("SaveOptions", "SaveOptionsKwargs"), ("LoadOptions", "LoadOptionsKwargs")]
)
def test_keyword_types_match_the_options(options, kwargs):
    import dataclasses
    import typing

    import bcp.options

    fields = {f.name: f.type for f in dataclasses.fields(getattr(bcp.options, options))}
    hints = typing.get_type_hints(getattr(bcp.options, kwargs))
    assert list(hints) == list(fields), "the TypedDict for type checkers lists exactly the options, in order"


def test_load_options_and_keywords(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save({"w": torch.arange(4.0), "step": 3}, uri)
    lenient = bcp.LoadOptions(strict=False)
    info = bcp.load_with_info({"w": torch.zeros(4), "extra": torch.zeros(1)}, uri, lenient)
    assert (
        torch.equal(info.state["w"], torch.arange(4.0)) and info.missing == ("extra",) and info.unexpected == ("step",)
    )
    with pytest.raises(bcp.StateMismatchError):
        bcp.load({"w": torch.zeros(4)}, uri, lenient, strict=True)  # keywords win
    with pytest.raises(TypeError, match=r"unknown load option\(s\) strikt; the options are: strict, allow_pickle"):
        bcp.load({"w": torch.zeros(4)}, uri, strikt=False)


# -- one copy of each layer ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["metadata", "backends", "conformance"])
def test_layer_folders_cannot_be_imported_a_second_time_from_the_root(name):
    run = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert f"import bcp.{name}" in run.stderr, run.stderr[-500:]
    ok = subprocess.run([sys.executable, "-c", f"import bcp.{name}"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-500:]


def test_conformance_folder_under_pytest_is_an_empty_package_that_points_to_the_real_one():
    """pytest imports the suite's module by path in a development checkout; the folder
    is then an empty package whose attributes say where the classes are."""
    code = "import _pytest, conformance; conformance.BackendContractTests"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0
    assert "use bcp.conformance.BackendContractTests" in run.stderr, run.stderr[-500:]
