"""``bcp convert`` and ``bcp.convert`` against the files around them: a FIFO where an
input file should be (refused at once, never waited on), a DCP ``.metadata`` that is a
link (refused, as its data files are), an existing ``--to torch`` destination (kept
unless ``--overwrite``), a failed write (nothing left beside the destination, the file
named), a failed ``--overwrite`` safetensors export (the previous export intact), and
``--allow-pickle`` for the exports that hold objects."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import bcp
import bcp.convert.torch_save
from cli_runner import cli

STATE = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}


def _convert_process(*args: str) -> subprocess.CompletedProcess:
    """``bcp convert ARGS`` in a child (a hang is what is checked: it ends at the timeout)."""
    argv = [sys.executable, "-m", "bcp.cli", "convert", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)  # a loaded 2-core CI


def _one_line(result) -> str:
    err = result.stderr
    assert result.returncode == 1 and "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("where", ["torch", "dcp-metadata", "safetensors-index", "safetensors-shard"])
def test_a_fifo_in_an_input_files_place_is_refused_not_waited_on(tmp_path, where):
    if where == "torch":
        src = tmp_path / "model.pt"
        os.mkfifo(src)
        fifo = src
    elif where == "dcp-metadata":
        src = tmp_path / "dcp"
        dcp.save(STATE, checkpoint_id=str(src), no_dist=True)
        fifo = src / ".metadata"
        fifo.unlink()
        os.mkfifo(fifo)
    else:
        src = tmp_path / "hf"
        src.mkdir()
        if where == "safetensors-index":
            save_file(STATE, str(src / "model-00001-of-00001.safetensors"))
        fifo = src / ("model.safetensors.index.json" if where == "safetensors-index" else "model.safetensors")
        os.mkfifo(fifo)
    err = _one_line(_convert_process(str(src), str(tmp_path / "out"), "--to", "bcp"))
    assert f"{fifo}: not a regular file" in err, err
    assert not (tmp_path / "out").exists()


def test_a_dcp_metadata_link_is_refused_like_its_data_files(tmp_path):
    src, outside = tmp_path / "dcp", tmp_path / "elsewhere"
    dcp.save(STATE, checkpoint_id=str(src), no_dist=True)
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(outside), no_dist=True)
    (src / ".metadata").unlink()
    (src / ".metadata").symlink_to(outside / ".metadata")
    result = cli("convert", str(src), str(tmp_path / "out"), "--to", "bcp")
    assert "links are never followed" in _one_line(result) and not (tmp_path / "out").exists()


def test_to_torch_keeps_an_existing_destination_unless_overwrite(tmp_path):
    src = tmp_path / "ckpt"
    bcp.save(STATE, str(src))
    manifest = (src / "manifest.json").read_bytes()
    for dst in (src / "manifest.json", tmp_path / "keep.pt"):  # inside the input, too
        if dst.name == "keep.pt":
            dst.write_bytes(b"mine")
        result = cli("convert", str(src), str(dst), "--to", "torch")
        assert "exists (pass overwrite=True, --overwrite" in _one_line(result)
    assert (src / "manifest.json").read_bytes() == manifest and (tmp_path / "keep.pt").read_bytes() == b"mine"
    assert cli("convert", str(src), str(tmp_path / "keep.pt"), "--to", "torch", "--overwrite").returncode == 0
    assert torch.equal(torch.load(tmp_path / "keep.pt", weights_only=True)["w"], STATE["w"])
    (tmp_path / "a-dir").mkdir()
    result = cli("convert", str(src), str(tmp_path / "a-dir"), "--to", "torch", "--overwrite")
    assert "a directory" in _one_line(result) and not (tmp_path / "a-dir.partial").exists()


def test_a_failed_torch_write_leaves_nothing_and_names_the_file(tmp_path, monkeypatch):
    src, dst = tmp_path / "ckpt", tmp_path / "out.pt"
    bcp.save(STATE, str(src))

    def short_write(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")

    monkeypatch.setattr(bcp.convert.torch_save.torch, "save", short_write)
    with pytest.raises(OSError, match=f"writing {dst}: .*unexpected pos"):
        bcp.convert.to_torch(str(src), str(dst))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_failed_overwrite_of_a_safetensors_export_keeps_the_previous_one(tmp_path):
    """Two shards exported; a flipped byte in the checkpoint then fails the second
    export with --overwrite: the first export is whole, as it was (its index used to be
    removed before any read, and the shards replaced so far deleted)."""
    src, hf = tmp_path / "ckpt", tmp_path / "hf"
    state = {f"layer{i}": torch.full((256,), float(i)) for i in range(4)}
    bcp.save(state, str(src))
    assert cli("convert", str(src), str(hf), "--to", "safetensors", "--max-shard-size", "2KiB").returncode == 0
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    assert len([n for n in before if n.endswith(".safetensors")]) == 2
    (data,) = src.glob("gen-*/data/*.bin")
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # in the last tensor: the second shard's read fails
    data.write_bytes(bytes(raw))
    result = cli("convert", str(src), str(hf), "--to", "safetensors", "--max-shard-size", "2KiB", "--overwrite")
    assert "checksum" in _one_line(result).lower()
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    loaded = {}
    for name in before:
        if name.endswith(".safetensors"):
            loaded.update(load_file(str(hf / name)))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_allow_pickle_reaches_the_exports_that_hold_objects(tmp_path):
    src = tmp_path / "ckpt"
    bcp.save({"w": torch.ones(2), "opaque": datetime.timedelta(days=1)}, str(src), allow_pickle=True)
    refused = cli("convert", str(src), str(tmp_path / "out.pt"), "--to", "torch")
    assert "allow_pickle" in _one_line(refused).replace("-", "_")
    assert cli("convert", str(src), str(tmp_path / "out.pt"), "--to", "torch", "--allow-pickle").returncode == 0
    assert torch.load(tmp_path / "out.pt", weights_only=False)["opaque"] == datetime.timedelta(days=1)


def test_tied_keys_export_to_safetensors_as_two_equal_tensors(tmp_path):
    """A tie comes back from the checkpoint as one tensor; safetensors stores no shared
    memory, so the export writes each key's own copy (as before ties were kept)."""

    from bcp.convert import to_safetensors

    w = torch.randn(4, 4)
    bcp.save({"embed": w, "head": w}, str(tmp_path / "ck"))
    to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"))
    (file,) = (tmp_path / "out").glob("*.safetensors")
    got = load_file(str(file))
    assert torch.equal(got["embed"], w) and torch.equal(got["head"], w)


def test_a_file_uri_names_a_torch_or_safetensors_source_as_its_path(tmp_path):
    """``bcp convert file:///abs/model.pt`` read the URI as a file name (no such file)."""
    from bcp.cli.main import main as cli_main

    torch.save({"w": torch.arange(3.0)}, tmp_path / "m.pt")
    save_file({"a": torch.ones(2)}, str(tmp_path / "s.safetensors"))
    assert cli_main(["convert", f"file://{tmp_path}/m.pt", str(tmp_path / "from-torch"), "--to", "bcp"]) == 0
    assert cli_main(["convert", f"file://{tmp_path}/s.safetensors", str(tmp_path / "from-st"), "--to", "bcp"]) == 0
    assert torch.equal(bcp.open(str(tmp_path / "from-torch")).read("w"), torch.arange(3.0))
    assert torch.equal(bcp.open(str(tmp_path / "from-st")).read("a"), torch.ones(2))
