"""Hostile torch.save files given to ``bcp convert --from torch`` (``from_torch``):
a zip whose entries declare far more than the file holds is refused before torch
inflates it (a 510 KiB bomb took 512 MiB), names outside the archive are refused, and
what torch's weights-only loader refuses is a FormatError naming the file, never code
run from it."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch

import bcp
from bcp.convert import from_torch
from bcp.convert.torch_save import check_archive
from bcp.errors import FormatError


def _good(tmp_path) -> str:
    path = str(tmp_path / "good.pt")
    torch.save({"w": torch.arange(1024)}, path)
    return path


def _rewritten(tmp_path, change) -> str:
    """good.pt with each entry's (name, bytes, compression) passed through ``change``."""
    good, bad = _good(tmp_path), str(tmp_path / "bad.pt")
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            name, data, compress = change(info.filename, src.read(info.filename))
            dst.writestr(name, data, compress_type=compress)
    return bad


def test_a_zip_bomb_is_refused_before_it_is_inflated(tmp_path):
    bomb = _rewritten(
        tmp_path,
        lambda n, b: (n, b + bytes(64 << 20), zipfile.ZIP_DEFLATED) if n.endswith("data.pkl") else (n, b, 0),
    )
    assert os.path.getsize(bomb) < 1 << 20
    with pytest.raises(FormatError, match=r"bad\.pt: its zip entries declare \d+ bytes, far more than its"):
        from_torch(bomb, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../escape/data.pkl", "/abs/data.pkl"])
def test_an_entry_named_outside_the_archive_is_refused(tmp_path, name):
    path = str(tmp_path / "names.pt")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(name, b"x")
    with pytest.raises(FormatError, match=r"a zip entry named .* lies outside the archive"):
        check_archive(path)


def test_a_storage_shorter_than_declared_is_a_format_error_naming_the_file(tmp_path):
    bad = _rewritten(tmp_path, lambda n, b: (n, b[:8] if n.endswith("/data/0") else b, zipfile.ZIP_STORED))
    with pytest.raises(FormatError, match=r"bad\.pt: not a torch\.save file bcp can read: RuntimeError"):
        from_torch(bad, str(tmp_path / "out"))


class _Marker:
    def __reduce__(self):
        return (os.system, ("touch marker-of-code-run",))


def test_a_pickle_that_runs_code_is_refused_naming_the_file_and_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.zeros(2), "evil": _Marker()}, path)
    with pytest.raises(FormatError, match=r"evil\.pt: holds what torch's weights-only loader refuses"):
        from_torch(path, str(tmp_path / "out"))
    assert not (tmp_path / "marker-of-code-run").exists()


def test_a_good_file_still_converts(tmp_path):
    from_torch(_good(tmp_path), str(tmp_path / "out"))
    assert torch.equal(
        bcp.load({"w": torch.zeros(1024, dtype=torch.int64)}, str(tmp_path / "out"))["w"], torch.arange(1024)
    )


@pytest.mark.parametrize(
    "pickled",
    [
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nK\x01\x85R.",  # an allowed rebuild called with too few arguments
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(K\x01K\x02K\x03K\x04tR.",  # and with wrong ones
        b"\x80\x02h\x05.",  # a memo entry never stored
    ],
)
def test_a_data_pkl_that_makes_torch_raise_anything_is_a_format_error(tmp_path, pickled):
    """Failed before for the first two: a TypeError from torch's rebuild escaped, naming no file."""
    bad = _rewritten(tmp_path, lambda n, b: (n, pickled if n.endswith("data.pkl") else b, zipfile.ZIP_STORED))
    with pytest.raises(FormatError, match=r"bad\.pt: not a torch\.save file bcp can read: (TypeError|KeyError)"):
        from_torch(bad, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_exported_training_state_comes_back_only_with_allow_pickle(tmp_path):
    """A TrainingState's torch export holds numpy RNG states, which torch's weights-only
    loader refuses: the error names the cause (not torch's first line of advice), and the
    caller's explicit --allow-pickle converts it back, RNG states included."""
    import numpy as np

    from bcp.cli.main import main as cli_main

    model = torch.nn.Linear(3, 2)
    bcp.TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1)).save(str(tmp_path / "ck"))
    assert cli_main(["convert", str(tmp_path / "ck"), str(tmp_path / "m.pt"), "--to", "torch"]) == 0
    with pytest.raises(FormatError, match=r"m\.pt: .*allow_pickle.*Unsupported global"):
        from_torch(str(tmp_path / "m.pt"), str(tmp_path / "back"))
    assert cli_main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "back"), "--to", "bcp", "--allow-pickle"]) == 0
    state = bcp.open(str(tmp_path / "back"), allow_pickle=True).state()
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert np.array_equal(state["rng"]["numpy"][1], np.random.get_state()[1])
