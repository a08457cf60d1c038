"""The format must keep loading: tests/golden/v1 was written by bcp 0.1 (format v1),
tests/golden/v2 by the first bcp writing format v2 (manifest with its own CRC32C);
both hold a catalog v1 (one Arrow IPC file). tests/golden/catalog-v2 was written by
the first bcp writing catalog v2 (sections, head, trailer; manifest version 2). All
are committed. tests/golden/v3 holds two siblings written by the first bcp writing
manifest version 3: ``base`` and ``step``, an incremental checkpoint whose unchanged
pieces are references to ``base``'s data file. Never regenerate one; add the next version beside them
(tests/golden/make_golden.py) when the format changes."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

import bcp
from bcp.metadata.manifest import FORMAT_VERSION, LATEST_VERSION, REFERENCES_VERSION
from golden_state import golden_state, golden_step_state
from helpers import assert_same
from test_roundtrip import zeros_like_state

GOLDEN_ROOT = pathlib.Path(__file__).parent / "golden"
VERSIONS = [1, 2]


@pytest.fixture(params=VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def golden(request) -> tuple[int, pathlib.Path]:
    return request.param, GOLDEN_ROOT / f"v{request.param}"


def _copy(tmp_path, src: pathlib.Path) -> str:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)  # reading must not need write access, but keep the tree pristine anyway
    return str(dst)


def test_there_is_a_golden_checkpoint_for_every_format_version():
    assert list(range(1, FORMAT_VERSION + 1)) == VERSIONS
    every = [*VERSIONS, *range(FORMAT_VERSION + 1, LATEST_VERSION + 1)]  # v3 and later: tests below
    assert sorted(p.name for p in GOLDEN_ROOT.iterdir() if p.is_dir() and p.name.startswith("v")) == [
        f"v{v}" for v in every
    ]


def test_golden_manifest_and_catalog(golden):
    version, path = golden
    r = bcp.open(str(path))
    assert r.manifest.version == version and r.manifest.format == "bcp-checkpoint"
    assert r.manifest.user_metadata == {"purpose": "golden format test"}
    assert r.meta("model.layer.1.w_fp16").shape == torch.Size([6, 4])
    assert r.meta("model.fp8").dtype == torch.float8_e4m3fn
    emb, head = r.meta("model.embed.weight").fragments[0], r.meta("model.head.weight").fragments[0]
    assert emb.byte_offset == head.byte_offset, "tied weights must still share bytes"
    doc = json.loads((path / "manifest.json").read_bytes())
    assert ("manifest_crc32c" in doc) == (version >= 2)
    if version >= 2:
        assert list(doc)[-1] == "manifest_crc32c"


def test_golden_loads_bit_exactly_without_template(golden):
    _version, path = golden
    assert_same(_canonical(golden_state()), bcp.open(str(path)).state(), ordered=False)


def test_golden_loads_into_a_template(golden, tmp_path):
    _version, path = golden
    uri = _copy(tmp_path, path)
    expected = golden_state()
    template = zeros_like_state(expected)
    template["optim"]["state"] = {}  # like a fresh optimizer
    out = bcp.load(template, uri)
    assert_same(_canonical(expected), out, ordered=False)


def test_golden_verifies(golden):
    from bcp.verify import verify_checkpoint

    _version, path = golden
    report = verify_checkpoint(str(path))
    assert report["ok"], report["problems"]


def test_an_edited_golden_v2_manifest_is_refused(tmp_path):
    """v2's manifest checks itself: the same edit a v1 manifest cannot detect is refused."""
    uri = _copy(tmp_path, GOLDEN_ROOT / "v2")
    manifest = pathlib.Path(uri) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"stop"', 1))
    with pytest.raises(bcp.CheckpointError, match="CRC32C"):
        bcp.open(uri)


CATALOG_V2 = GOLDEN_ROOT / "catalog-v2"


def test_golden_catalog_v2_loads_bit_exactly():
    from bcp.metadata.catalog import sections

    r = bcp.open(str(CATALOG_V2))
    assert r.manifest.version == 2 and r.manifest.user_metadata == {"purpose": "golden format test"}
    catalog = next(CATALOG_V2.glob("gen-*/fragments.arrow")).read_bytes()
    assert sections.is_v2(catalog) and catalog[:6] == b"ARROW1"
    assert_same(_canonical(golden_state()), r.state(), ordered=False)
    emb, head = r.meta("model.embed.weight").fragments[0], r.meta("model.head.weight").fragments[0]
    assert emb.byte_offset == head.byte_offset, "tied weights must still share bytes"


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "head-then-sections"])
def test_golden_catalog_v2_loads_into_a_template(tmp_path, monkeypatch, whole):
    import bcp.reader

    monkeypatch.setattr(bcp.reader, "WHOLE_CATALOG_BYTES", 1 << 30 if whole else 0)
    uri = _copy(tmp_path, CATALOG_V2)
    expected = golden_state()
    template = zeros_like_state(expected)
    template["optim"]["state"] = {}
    assert_same(_canonical(expected), bcp.load(template, uri), ordered=False)


def test_golden_catalog_v2_verifies():
    from bcp.verify import verify_checkpoint

    report = verify_checkpoint(str(CATALOG_V2))
    assert report["ok"], report["problems"]


V3 = GOLDEN_ROOT / "v3"


def test_golden_v3_step_refers_to_its_sibling():
    r = bcp.open(str(V3 / "step"))
    assert r.manifest.version == REFERENCES_VERSION and r.manifest.user_metadata == {"purpose": "golden format test"}
    (ref,) = r.manifest.references
    base = bcp.open(str(V3 / "base")).manifest
    assert ref.checkpoint == "base" and ref.path.split("/")[0] == base.generation
    own = [f for f in r.manifest.data_files if f.checkpoint is None]
    assert sum(f.nbytes for f in own) < ref.nbytes  # most of the state is read from base


@pytest.mark.parametrize(("name", "state"), [("base", golden_state), ("step", golden_step_state)])
def test_golden_v3_loads_bit_exactly(name, state, tmp_path):
    assert_same(_canonical(state()), bcp.open(str(V3 / name)).state(), ordered=False)
    uri = _copy(tmp_path, V3) + f"/{name}"  # the siblings copied together: a reference is relative
    template = zeros_like_state(state())
    template["optim"]["state"] = {}
    assert_same(_canonical(state()), bcp.load(template, uri), ordered=False)


def test_golden_v3_verifies_and_its_root_too():
    from bcp.verify import verify_checkpoint, verify_root

    report = verify_checkpoint(str(V3 / "step"))
    assert report["ok"], report["problems"]
    report = verify_root(str(V3))
    assert report["ok"] and len(report["checkpoints"]) == 2, report


def _canonical(state):
    from bcp.tensor_io import host_contiguous

    if isinstance(state, torch.Tensor):
        return host_contiguous(state)
    if type(state) is dict:
        return {k: _canonical(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_canonical(v) for v in state]
    return state
