"""Conversion never runs code from the checkpoint it reads, and never leaves stale
files beside what it writes (issue 14).

``bcp convert`` runs in this process (tests/cli_runner.py) except where the process
is what is checked: the one line on stderr of a refused DCP checkpoint, and a
conversion under an address-space limit."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import bcp
from bcp.convert import INDEX_NAME, from_dcp, from_safetensors, to_dcp, to_safetensors, to_torch
from bcp.convert.dcp_metadata import MetadataUnpickler, is_allowed
from cli_runner import cli


def cli_process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``bcp ARGS`` as users run it: ``python -m bcp.cli`` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


class _RunsCode:
    """Unpickling this calls os.system, which creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _dcp_checkpoint(path: Path, state: dict | None = None) -> dict:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = state or {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"epoch": 3, "name": "run-1", "raw": b"\x00\x01", "none": None, "nested": {"t": torch.arange(5)}},
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


# -- DCP .metadata ----------------------------------------------------------------------------------


def test_a_dcp_metadata_that_runs_code_is_refused_by_the_cli(tmp_path):
    src = tmp_path / "dcp"
    _dcp_checkpoint(src)
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    proc = cli_process("convert", str(src), str(tmp_path / "out"), "--to", "bcp")
    assert not marker.exists(), "converting a DCP checkpoint ran code from its .metadata"
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ".metadata" in proc.stderr and "system" in proc.stderr and "--allow-pickle" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_hostile_dcp_files_are_one_line_from_the_cli_naming_the_file(tmp_path):
    """A truncated data file (a bare EOFError from DCP before issue 36) and a
    34-byte .metadata asking for bytearray(3 GiB) (3.4 GiB of memory before the
    error) are each one line naming the file, the second under a 3 GiB address-space limit."""
    src = tmp_path / "dcp"
    _dcp_checkpoint(src)
    (data,) = src.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-64])
    proc = cli("convert", str(src), str(tmp_path / "out"), "--to", "bcp")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert data.name in proc.stderr and "bytes" in proc.stderr and "EOFError" not in proc.stderr, proc.stderr

    bomb = b"\x80\x04\x8c\x08builtins\x8c\tbytearray\x93\x8a\x05" + (3 << 30).to_bytes(5, "little") + b"\x85R."
    (src / ".metadata").write_bytes(bomb)
    limited = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
        "sys.argv = ['bcp', 'convert', sys.argv[1], sys.argv[2], '--to', 'bcp']; "
        "runpy.run_module('bcp.cli', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", limited, str(src), str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ".metadata" in proc.stderr and "bytearray" in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr


def test_code_hidden_inside_real_dcp_metadata_is_refused(tmp_path):
    """The payload sits deep inside an otherwise genuine Metadata (planner_data)."""
    from bcp.convert.dcp_metadata import read_metadata

    src = tmp_path / "dcp"
    _dcp_checkpoint(src)
    metadata = read_metadata(str(src))
    marker = tmp_path / "pwned"
    metadata.planner_data = {"model.0.weight": ("model", _RunsCode(marker))}
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(bcp.errors.PickleNotAllowedError, match=r"\.metadata.*'(posix|os)\.system'"):
        from_dcp(str(src), str(tmp_path / "out"))
    assert not marker.exists()


def test_allow_pickle_accepts_a_global_outside_the_allow_list(tmp_path):
    import datetime

    from bcp.convert.dcp_metadata import read_metadata

    src = tmp_path / "dcp"
    _dcp_checkpoint(src)
    metadata = read_metadata(str(src))
    metadata.planner_data = {**metadata.planner_data, "when": datetime.date(2024, 1, 2)}
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(bcp.errors.PickleNotAllowedError, match=r"datetime\.date"):
        read_metadata(str(src))
    assert read_metadata(str(src), allow_pickle=True).planner_data["when"] == datetime.date(2024, 1, 2)


def test_a_corrupt_dcp_metadata_is_a_format_error_naming_the_file(tmp_path):
    src = tmp_path / "dcp"
    _dcp_checkpoint(src)
    (src / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(bcp.errors.FormatError, match=r"\.metadata.*dict"):
        from_dcp(str(src), str(tmp_path / "out"))
    (src / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(bcp.errors.FormatError, match=r"\.metadata"):
        from_dcp(str(src), str(tmp_path / "out"))


def _globals_in(path: Path) -> set[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recording(f).load()
    return seen


def test_the_allow_list_covers_what_dcp_writes(tmp_path):
    """How the allow-list was derived: every global in the metadata of DCP
    checkpoints of several shapes is allowed (a torch upgrade that adds one fails here)."""
    states = {
        "model_optim": None,
        "dtypes": {
            str(dt): torch.zeros(2, dtype=dt)
            for dt in (torch.int8, torch.uint8, torch.int64, torch.bool, torch.complex64, torch.float16, torch.bfloat16)
        }
        | {
            "channels_last": torch.zeros(1, 3, 4, 4).to(memory_format=torch.channels_last),
            "transposed": torch.zeros(4, 3).t(),
            "scalar": torch.tensor(3.0),
            "empty": torch.zeros(0, 5),
            "param": torch.nn.Parameter(torch.randn(3)),
        },
        "objects": {"a": {"b": [torch.ones(2), 3, "x", (1, 2)]}, "bytes": b"raw", "f": 1.5, "none": None},
    }
    seen: set[tuple[str, str]] = set()
    for name, state in states.items():
        _dcp_checkpoint(tmp_path / name, state)
        seen |= _globals_in(tmp_path / name / ".metadata")
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    refused = sorted(g for g in seen if not is_allowed(*g))
    assert not refused, f"DCP metadata uses globals outside the allow-list: {refused}"


def test_the_allow_list_refuses_the_usual_gadgets():
    for module, name in [
        ("os", "system"),
        ("posix", "system"),
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("subprocess", "Popen"),
        ("torch", "load"),
        ("torch", "save"),
        ("torch.serialization", "load"),
        ("torch", "__builtins__"),
        ("torch", "float32.__class__"),
    ]:
        assert not is_allowed(module, name), f"{module}.{name} is allowed"
    plain_global = pickle.dumps(print)
    with pytest.raises(bcp.errors.PickleNotAllowedError, match=r"builtins\.print"):
        MetadataUnpickler(io.BytesIO(plain_global), path="x/.metadata").load()


# -- DCP non-tensor entries -------------------------------------------------------------------------


def test_real_dcp_checkpoints_convert_without_allow_pickle(tmp_path):
    src = tmp_path / "dcp"
    state = _dcp_checkpoint(src)
    info, skipped = from_dcp(str(src), str(tmp_path / "out"))
    assert skipped == []
    reader = bcp.open(str(tmp_path / "out"))
    for name, t in state["model"].items():
        assert torch.equal(reader.read(f"model.{name}"), t)
    assert torch.equal(reader.read("optim.state.0.exp_avg"), state["optim"]["state"][0]["exp_avg"])
    assert reader.read_object("optim.param_groups") == state["optim"]["param_groups"]
    assert reader.read_object("extra.epoch") == 3 and reader.read_object("extra.raw") == b"\x00\x01"
    assert reader.read_object("extra.name") == "run-1" and reader.read_object("extra.none") is None
    assert torch.equal(reader.read("extra.nested.t"), torch.arange(5))
    assert info.tensors == len(reader.tensor_keys())


def test_a_dcp_entry_that_runs_code_is_skipped_and_named_not_run(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "dcp"
    _dcp_checkpoint(src, {"w": torch.ones(3), "evil": _RunsCode(marker), "epoch": 7})
    proc = cli("convert", str(src), str(tmp_path / "out"), "--to", "bcp")
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "converting a DCP checkpoint ran code from a non-tensor entry"
    assert "skipped 1" in proc.stdout and "evil" in proc.stdout
    reader = bcp.open(str(tmp_path / "out"))
    assert set(reader.keys()) == {"w", "epoch"} and reader.read_object("epoch") == 7


def test_allow_pickle_converts_the_entries_that_need_it(tmp_path):
    import datetime

    src = tmp_path / "dcp"
    when = datetime.date(2024, 1, 2)
    _dcp_checkpoint(src, {"w": torch.ones(3), "when": when})
    _info, skipped = from_dcp(str(src), str(tmp_path / "safe"))
    assert skipped == ["when"] and set(bcp.open(str(tmp_path / "safe")).keys()) == {"w"}
    _info, skipped = from_dcp(str(src), str(tmp_path / "all"), allow_pickle=True)
    assert skipped == []
    assert bcp.open(str(tmp_path / "all"), allow_pickle=True).read_object("when") == when


# -- safetensors output -----------------------------------------------------------------------------


def _bcp_checkpoint(path: Path, n: int) -> str:
    bcp.save({f"t{i}": torch.full((1000,), float(i)) for i in range(n)}, str(path))
    return str(path)


def test_safetensors_export_refuses_a_non_empty_directory(tmp_path):
    src = _bcp_checkpoint(tmp_path / "ck", 4)
    out = tmp_path / "st"
    out.mkdir()
    (out / "config.json").write_text("{}")
    proc = cli("convert", src, str(out), "--to", "safetensors")
    assert proc.returncode == 1 and "not empty" in proc.stderr and "--overwrite" in proc.stderr, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json"]
    with pytest.raises(FileExistsError, match=r"config\.json"):
        to_safetensors(src, str(out))


def test_overwrite_removes_stale_shards_and_nothing_else(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "st"
    big = _bcp_checkpoint(tmp_path / "big", 6)
    assert cli("convert", big, str(out), "--to", "safetensors", "--max-shard-size", "8KB").returncode == 0
    old_shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(old_shards) == 3 and INDEX_NAME in os.listdir(out)
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "x.safetensors").write_bytes(b"kept: not in the output directory itself")
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"a link target")
    (out / "linked.safetensors").symlink_to(elsewhere)

    small = _bcp_checkpoint(tmp_path / "small", 2)
    proc = cli("convert", small, str(out), "--to", "safetensors", "--max-shard-size", "8KB")
    assert proc.returncode == 1 and "not empty" in proc.stderr
    proc = cli("convert", small, str(out), "--to", "safetensors", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt", "sub"]
    assert (out / "sub" / "x.safetensors").exists() and elsewhere.read_bytes() == b"a link target"
    assert sorted(load_file(str(out / "model.safetensors"))) == ["t0", "t1"]

    # sharded again over a single file: the new index names only the new shards
    proc = cli("convert", big, str(out), "--to", "safetensors", "--max-shard-size", "8KB", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    names = sorted(os.listdir(out))
    assert "model.safetensors" not in names and INDEX_NAME in names
    index = json.loads((out / INDEX_NAME).read_text())
    assert sorted(n for n in names if n.endswith(".safetensors")) == sorted(set(index["weight_map"].values()))


def test_to_torch_checks_the_data_file_before_making_scratch_space(tmp_path, monkeypatch):
    """A 32-byte data file declared (manifest and catalog alike) to hold a 2 GiB tensor:
    the export fails naming the file before a scratch file of 2 GiB is made."""
    import dataclasses

    import bcp.convert
    from bcp.backends import backend_for
    from bcp.metadata import MANIFEST_KEY, Catalog, FileEntry, Manifest, crc32c

    uri = str(tmp_path / "ck")
    bcp.save({"state": {"w": torch.arange(8, dtype=torch.float32)}}, uri)
    (frag,) = bcp.open(uri).meta("state.w").fragments
    backend = backend_for(uri)
    m = Manifest.from_json(backend.read(MANIFEST_KEY), where="test")
    big = 1 << 29  # float32 elements: 2 GiB
    huge = dataclasses.replace(
        frag, global_shape=(big,), lengths=(big,), nbytes=big * 4, checksums=(0,) * (big * 4 // m.checksum_block_bytes)
    )
    catalog = Catalog([huge]).to_arrow()
    backend.write(m.catalog.path, catalog)
    declared = tuple(dataclasses.replace(f, nbytes=big * 4) if f.path == frag.file else f for f in m.data_files)
    m = dataclasses.replace(m, catalog=FileEntry(m.catalog.path, len(catalog), crc32c(catalog)), data_files=declared)
    backend.write(MANIFEST_KEY, m.to_json())

    made: list[int] = []  # the sizes of the file-backed storages the export maps
    real = torch.UntypedStorage.from_file
    monkeypatch.setattr(
        torch.UntypedStorage,
        "from_file",
        lambda path, shared=False, nbytes=0: made.append(nbytes) or real(path, shared=shared, nbytes=nbytes),
    )
    with pytest.raises(bcp.CorruptCheckpointError, match="holds 32 bytes; the manifest says 2147483648") as e:
        bcp.convert.to_torch(uri, str(tmp_path / "out.pt"))
    assert e.value.file == frag.file
    assert made == []
    assert not (tmp_path / "out.pt").exists()
    bcp.save({"w": torch.ones(4)}, str(tmp_path / "small"))
    bcp.convert.to_torch(str(tmp_path / "small"), str(tmp_path / "small.pt"))
    assert made == [16], "the probe sees the scratch file of an export that goes ahead"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.uint8, torch.bool])
def test_empty_tensors_export_to_torch_and_dcp_and_load_there(tmp_path, dtype):
    """An empty tensor of a multi-byte dtype: to_torch wrote a 1-byte storage record that
    torch.load refused, and to_dcp failed viewing an empty byte buffer as the dtype."""
    state = {"e": torch.zeros(0, 5, dtype=dtype), "w": torch.ones(3, dtype=dtype)}
    bcp.save(state, str(tmp_path / "ck"))
    to_torch(str(tmp_path / "ck"), str(tmp_path / "model.pt"))
    got = torch.load(str(tmp_path / "model.pt"), weights_only=True)
    assert got["e"].shape == (0, 5) and got["e"].dtype == dtype and torch.equal(got["w"], state["w"])
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    back = {"e": torch.empty(0, 5, dtype=dtype), "w": torch.zeros(3, dtype=dtype)}
    dcp.load(back, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert back["e"].shape == (0, 5) and torch.equal(back["w"], state["w"])


def test_a_sharded_export_that_fails_midway_leaves_no_shard(tmp_path):
    """The second shard's bytes are corrupt: the export fails and removes the first
    shard it had published (without an index it read as a smaller model)."""
    ck = tmp_path / "ck"
    bcp.save({"a": torch.arange(1000.0), "b": torch.arange(1000.0) * 2}, str(ck))
    (data,) = list(ck.glob("gen-*/data/*.bin"))
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size - 100)
        f.write(b"\xff" * 50)  # inside 'b', the second shard
    with pytest.raises(bcp.CorruptCheckpointError):
        to_safetensors(str(ck), str(tmp_path / "st"), max_shard_bytes=4000)
    assert not list((tmp_path / "st").glob("*.safetensors"))


def test_a_sharded_export_failing_while_it_writes_a_shard_leaves_nothing_and_can_be_retried(tmp_path, monkeypatch):
    """The disk fills while the second shard is written: its partial file was left, and
    the retry refused the directory as not empty."""
    import safetensors.torch as st_module

    ck, dst = str(tmp_path / "ck"), tmp_path / "st"
    bcp.save({"a": torch.arange(1000.0), "b": torch.arange(1000.0) * 2}, ck)
    real, calls = st_module.save_file, []

    def full_disk(tensors, path, metadata=None):
        calls.append(path)
        real(tensors, path, metadata=metadata)  # the partial file is there
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(st_module, "save_file", full_disk)
    with pytest.raises(OSError, match="injected"):
        to_safetensors(ck, str(dst), max_shard_bytes=4000)
    assert os.listdir(dst) == []
    monkeypatch.setattr(st_module, "save_file", real)
    to_safetensors(ck, str(dst), max_shard_bytes=4000)
    from_safetensors(str(dst), str(tmp_path / "back"))
    assert torch.equal(bcp.open(str(tmp_path / "back")).read("b"), torch.arange(1000.0) * 2)


def test_shards_without_their_index_are_refused_on_import(tmp_path):
    bcp.save({"a": torch.arange(1000.0), "b": torch.arange(1000.0) * 2}, str(tmp_path / "ck"))
    to_safetensors(str(tmp_path / "ck"), str(tmp_path / "st"), max_shard_bytes=4000)
    (tmp_path / "st" / INDEX_NAME).unlink()
    with pytest.raises(bcp.FormatError, match=r"holds shards \(model-00001-of-00002\.safetensors, \.\.\.\) but no"):
        from_safetensors(str(tmp_path / "st"), str(tmp_path / "back"))
