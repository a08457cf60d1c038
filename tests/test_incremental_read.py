"""Reading incremental checkpoints (FORMAT.md, "References"): a checkpoint whose
manifest lists data files of a sibling loads, verifies, describes itself and exports
exactly as the full checkpoint of the same state does. The incremental checkpoints
are built by hand (tests/incremental_helpers.py) from two full saves."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os

import pytest
import torch

import bcp
from bcp.backends import backend_for
from bcp.cli import main
from bcp.errors import CheckpointError, CorruptCheckpointError
from bcp.metadata import FormatError
from bcp.metadata.keys import MANIFEST_KEY
from bcp.metadata.manifest import reseal
from bcp.verify import verify_checkpoint
from helpers import assert_same
from incremental_helpers import make_incremental


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 16, generator=g),
            "b": torch.randn(16, generator=g),
            "emb": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        },
        "optim": {"m": torch.randn(64, 16, generator=g), "step": 3},
        "name": "run",
    }


def _next(state: dict) -> dict:
    """The state one step later: ``w`` changes in a few rows, ``m`` everywhere; ``b``
    and ``emb`` stay (the incremental checkpoint reads them from its base)."""
    out = copy.deepcopy(state)
    out["model"]["w"][:4] += 1
    out["optim"]["m"] *= 0.5
    out["optim"]["step"] = 4
    return out


def _saved(uri_of, **options) -> tuple[str, str, str]:
    """(base, full, incremental) URIs: three siblings under one parent."""
    base, full, inc = uri_of("step_1"), uri_of("full_2"), uri_of("step_2")
    bcp.save(_state(), base, storage_options=options or None)
    bcp.save(_next(_state()), full, storage_options=options or None)
    made = make_incremental(base, full, inc, storage_options=options)
    assert made.manifest.version == 3 and 0 < made.reused < made.fragments
    assert {f.checkpoint for f in made.manifest.references} == {"step_1"}
    return base, full, inc


@pytest.fixture
def siblings(uri_factory):
    return _saved(lambda name: uri_factory(f"run/{name}"))


def test_an_incremental_checkpoint_loads_like_the_full_one(siblings):
    _base, full, inc = siblings
    reader = bcp.open(inc)
    assert reader.manifest.version == 3
    assert_same(bcp.open(full).state(), reader.state())
    assert_same(_next(_state()), reader.state())
    template = copy.deepcopy(_state())
    for t in (template["model"]["w"], template["model"]["b"], template["optim"]["m"]):
        t.zero_()
    assert_same(_next(_state()), bcp.load(template, inc))
    assert torch.equal(reader.read("model.emb", box=((3, 0), (5, 8))), _state()["model"]["emb"][3:8])


def test_an_incremental_checkpoint_verifies(siblings):
    _base, _full, inc = siblings
    report = verify_checkpoint(inc)
    assert report["ok"], report["problems"]
    assert report["fragments_ok"] == report["fragments"] == len(bcp.open(inc).catalog.fragments)


def test_describe_and_inspect_name_the_references_and_their_owner(siblings):
    from bcp.describe import describe

    _base, _full, inc = siblings
    doc = describe(bcp.open(inc))
    owners = {r["checkpoint"] for r in doc["references"]}
    assert owners == {"step_1"} and all(r["path"].startswith("gen-") for r in doc["references"])
    by_fqn = {t["fqn"]: t for t in doc["tensors"]}
    assert by_fqn["model.b"]["referenced"] == 1 and by_fqn["optim.m"]["referenced"] == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", inc]) == 0
    text = out.getvalue()
    assert "(format v3)" in text and "of checkpoint step_1 beside it" in text
    assert "(1 in a sibling)" in text
    with contextlib.redirect_stdout(io.StringIO()) as js:
        assert main(["inspect", inc, "--json"]) == 0
    assert {r["checkpoint"] for r in json.loads(js.getvalue())["references"]} == {"step_1"}


def test_a_full_checkpoint_describes_no_references(uri_factory):
    from bcp.describe import describe

    uri = uri_factory("run/full")
    bcp.save(_state(), uri)
    doc = describe(bcp.open(uri))
    assert doc["references"] == [] and all("referenced" not in t for t in doc["tensors"])


def test_exports_of_an_incremental_checkpoint_equal_the_full_ones(tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import load as dcp_load

    from bcp.convert import to_dcp, to_safetensors, to_torch

    _base, full, inc = _saved(lambda name: str(tmp_path / "run" / name))
    for name, src in (("full", full), ("inc", inc)):
        to_torch(src, str(tmp_path / f"{name}.pt"))
        to_safetensors(src, str(tmp_path / f"{name}-st"))
        to_dcp(src, str(tmp_path / f"{name}-dcp"))
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True), torch.load(tmp_path / "inc.pt", weights_only=True))
    (shard,) = [p for p in os.listdir(tmp_path / "inc-st") if p.endswith(".safetensors")]
    got, want = load_file(tmp_path / "inc-st" / shard), load_file(tmp_path / "full-st" / shard)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    template = _state()
    template["model"]["w"].zero_()
    dcp_load(template, checkpoint_id=str(tmp_path / "inc-dcp"), no_dist=True)
    assert torch.equal(template["model"]["w"], _next(_state())["model"]["w"])
    assert torch.equal(template["model"]["emb"], _state()["model"]["emb"])


def test_an_incremental_checkpoint_on_s3_reads_its_sibling_there(moto_server):
    from conftest import new_bucket, store_uri

    bucket = new_bucket(moto_server)

    def uri_of(name: str) -> str:
        return store_uri("moto", moto_server, bucket, f"run/{name}")

    _base, full, inc = _saved(uri_of)
    assert_same(bcp.open(full).state(), bcp.open(inc).state())
    assert verify_checkpoint(inc)["ok"]


def test_resharding_load_of_an_incremental_checkpoint_on_three_ranks(tmp_path):
    """Saved by FSDP2 on 2 ranks (base and full), loaded on 3 from the incremental one."""
    import dist_jobs
    import incremental_jobs

    parent = tmp_path / "run"
    ref = str(tmp_path / "ref.pt")
    dist_jobs.spawn(incremental_jobs.two_saves_job, 2, str(parent / "step_1"), str(parent / "full_2"), ref)
    made = make_incremental(str(parent / "step_1"), str(parent / "full_2"), str(parent / "step_2"))
    assert 0 < made.reused < made.fragments, made
    dist_jobs.spawn(dist_jobs.load_sharded_job, 3, "fsdp", str(parent / "step_2"), ref)


# -- what is refused ----------------------------------------------------------------------


def _rewrite(uri: str, change) -> None:
    """Change the manifest at ``uri`` (a JSON document) and seal it again."""
    backend = backend_for(uri)
    doc = json.loads(backend.read(MANIFEST_KEY))
    change(doc)
    backend.write(MANIFEST_KEY, reseal(doc))


def _first_reference(doc: dict) -> dict:
    return next(f for f in doc["data_files"] if "checkpoint" in f)


def test_a_missing_referenced_file_is_refused_naming_it(siblings):
    base, _full, inc = siblings
    ref = next(f for f in bcp.open(inc).manifest.references)
    backend_for(base).delete(ref.path)
    with pytest.raises(
        CorruptCheckpointError, match=rf"data file '{ref.path}' of sibling checkpoint 'step_1' .* is missing"
    ):
        bcp.open(inc).state()
    problems = verify_checkpoint(inc)["problems"]
    assert any(ref.path in p and "step_1" in p and "is missing" in p for p in problems), problems


def test_a_referenced_file_of_the_wrong_size_is_refused_before_reading(siblings):
    base, _full, inc = siblings
    ref = next(f for f in bcp.open(inc).manifest.references)
    backend = backend_for(base)
    backend.write(ref.path, backend.read(ref.path) + b"\0")  # the bytes the rows name are intact
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"'{ref.path}' of sibling checkpoint 'step_1'.* holds {ref.nbytes + 1} bytes; "
        rf"the manifest says {ref.nbytes}",
    ):
        bcp.open(inc).read("model.b")
    assert not verify_checkpoint(inc)["ok"]


def test_a_flipped_byte_in_a_referenced_file_fails_naming_file_and_offset(siblings):
    base, _full, inc = siblings
    reader = bcp.open(inc)
    frag = reader.meta("model.b").fragments[0]
    assert frag.file in {f.path for f in reader.manifest.references}
    backend = backend_for(base)
    data = bytearray(backend.read(frag.file))
    data[frag.byte_offset + 5] ^= 0x40
    backend.write(frag.file, bytes(data))
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"file '{frag.file}' of sibling checkpoint 'step_1'.*bytes \[{frag.byte_offset}, ",
    ) as e:
        bcp.open(inc).read("model.b")
    assert e.value.file == frag.file and e.value.offset == frag.byte_offset
    problems = verify_checkpoint(inc)["problems"]
    assert len(problems) == 1 and "checksum mismatch" in problems[0] and frag.file in problems[0], problems


@pytest.mark.parametrize(
    ("value", "field"),
    [("..", "checkpoint"), ("/etc", "checkpoint"), ("../step_1", "checkpoint"), ("gen-ab/data/../../../x", "path")],
)
def test_a_reference_outside_the_parent_is_refused_naming_it(siblings, value, field):
    _base, _full, inc = siblings

    def change(doc: dict) -> None:
        _first_reference(doc)[field] = value

    _rewrite(inc, change)
    with pytest.raises(FormatError, match=rf"field 'data_files\[\d+\]\.{field}' is '{value}'"):
        bcp.open(inc)


def test_a_reference_to_a_sibling_that_is_not_there_is_refused_naming_it(siblings):
    _base, _full, inc = siblings
    _rewrite(inc, lambda doc: _first_reference(doc).update(checkpoint="step_0"))
    with pytest.raises(CorruptCheckpointError, match=r"of sibling checkpoint 'step_0' .*step_0/gen-.* is missing"):
        bcp.open(inc).state()


def test_a_checkpoint_with_references_opened_from_a_backend_object_is_refused(siblings):
    _base, _full, inc = siblings
    with pytest.raises(
        CheckpointError,
        match=r"incremental checkpoint: it reads data files of the checkpoint\(s\) step_1.*open it by its URI",
    ):
        bcp.open(backend_for(inc))
    template = _state()
    with pytest.raises(CheckpointError, match="open it by its URI"):
        bcp.load(template, backend_for(inc))


def test_a_full_checkpoint_opened_from_a_backend_object_still_loads(uri_factory):
    uri = uri_factory("run/full")
    bcp.save(_state(), uri)
    assert_same(_state(), bcp.open(backend_for(uri)).state())


def test_a_link_to_the_sibling_is_not_followed(tmp_path):
    """The file backend follows no symbolic link below the parent either."""
    base, _full, inc = _saved(lambda name: str(tmp_path / "run" / name))
    os.rename(base, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", base)
    with pytest.raises(OSError, match="symbolic link"):
        bcp.open(inc).state()


def test_the_parent_backend_is_built_with_the_same_storage_options(tmp_path, monkeypatch):
    import bcp.references

    _base, full, inc = _saved(lambda name: str(tmp_path / "run" / name))
    built = []
    real = bcp.references.backend_for

    def recording(uri, **options):
        built.append((uri, options))
        return real(uri, **options)

    monkeypatch.setattr(bcp.references, "backend_for", recording)
    assert_same(bcp.open(full).state(), bcp.open(inc, storage_options={"direct_reads": False}).state())
    assert built == [(str(tmp_path / "run"), {"direct_reads": False})]  # built once, for the incremental one only
