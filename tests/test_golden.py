"""The format must keep loading: tests/golden/v1 was written by bcp 0.1 (format v1)
and is committed. Never regenerate it; add v2 beside it when the format changes."""

from __future__ import annotations

import pathlib
import shutil

import torch

import bcp
from golden_state import golden_state
from helpers import assert_same
from test_roundtrip import zeros_like_state

GOLDEN = pathlib.Path(__file__).parent / "golden" / "v1"


def _copy(tmp_path) -> str:
    dst = tmp_path / "v1"
    shutil.copytree(GOLDEN, dst)  # reading must not need write access, but keep the tree pristine anyway
    return str(dst)


def test_golden_v1_manifest_and_catalog():
    r = bcp.open(str(GOLDEN))
    assert r.manifest.version == 1 and r.manifest.format == "bcp-checkpoint"
    assert r.manifest.user_metadata == {"purpose": "golden format test"}
    assert r.meta("model.layer.1.w_fp16").shape == torch.Size([6, 4])
    assert r.meta("model.fp8").dtype == torch.float8_e4m3fn
    emb, head = r.meta("model.embed.weight").fragments[0], r.meta("model.head.weight").fragments[0]
    assert emb.byte_offset == head.byte_offset, "tied weights must still share bytes"


def test_golden_v1_loads_bit_exactly_without_template():
    assert_same(_canonical(golden_state()), bcp.open(str(GOLDEN)).state(), ordered=False)


def test_golden_v1_loads_into_a_template(tmp_path):
    uri = _copy(tmp_path)
    expected = golden_state()
    template = zeros_like_state(expected)
    template["optim"]["state"] = {}  # like a fresh optimizer
    out = bcp.load(template, uri)
    assert_same(_canonical(expected), out, ordered=False)


def _canonical(state):
    from bcp.tensor_io import host_contiguous

    if isinstance(state, torch.Tensor):
        return host_contiguous(state)
    if type(state) is dict:
        return {k: _canonical(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_canonical(v) for v in state]
    return state
