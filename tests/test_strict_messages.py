"""What a non-strict load says and returns, and the prefix hint of key mismatches."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.errors import prefix_hint
from helpers import examples

_names = st.text("abcdefgh_", min_size=1, max_size=6)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_non_strict_load_warns_and_returns_what_it_skipped(tmp_path, caplog):
    model = _model()
    bcp.save({"model": model.state_dict(), "step": 3, "extra": torch.ones(2)}, tmp_path / "ck")
    wrapped = torch.nn.Module()
    wrapped.module = _model()
    state = {"model": wrapped.state_dict(), "step": torch.zeros(1), "other": 1}
    with caplog.at_level(logging.WARNING, logger="bcp"):
        info = bcp.load_with_info(state, tmp_path / "ck", strict=False)
    assert set(info.missing) == {f"model.module.{k}" for k in model.state_dict()} | {"other"}
    assert set(info.unexpected) == {f"model.{k}" for k in model.state_dict()} | {"extra"}
    assert info.kind_mismatch == ("step",) and info.skipped
    assert info.hint is not None and "'model.module.'" in info.hint and "'model.'" in info.hint
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = record.getMessage()
    assert "5 missing, 5 unexpected, 0 cast, 1 kind mismatches" in text
    assert "model.module.0.weight" in text and "hint:" in text


def test_the_warning_lists_at_most_eight_keys_per_kind(tmp_path, caplog):
    bcp.save({f"t{i}": torch.zeros(1) for i in range(20)}, tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="bcp"):
        info = bcp.load_with_info({"t0": torch.ones(1, dtype=torch.float64)}, tmp_path / "ck", strict=False)
    assert info.cast == ("t0",) and len(info.unexpected) == 19
    text = caplog.records[-1].getMessage()
    assert "... and 11 more" in text and "t0 (float32 -> float64)" in text


def test_a_matching_load_is_silent(tmp_path, caplog):
    bcp.save({"a": torch.zeros(2)}, tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="bcp"):
        info = bcp.load_with_info({"a": torch.ones(2)}, tmp_path / "ck", strict=False)
    assert not info.skipped and info.hint is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_strict_mismatch_suggests_stripping_the_ddp_prefix(tmp_path):
    wrapped = torch.nn.Module()
    wrapped.module = _model()
    bcp.save({"model": wrapped.state_dict()}, tmp_path / "ck")
    with pytest.raises(bcp.StateMismatchError) as caught:
        bcp.load({"model": _model().state_dict()}, tmp_path / "ck")
    error = caught.value
    assert "hint: 4 of 4 missing keys" in str(error) and "'model.module.'" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert again.hint == error.hint and str(again) == str(error)


_components = st.lists(_names, max_size=2)


@st.composite
def _wrapping_swap(draw) -> tuple[str, str]:
    """A state prefix and a stored prefix that differ by one run of components
    inserted in one of them (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    base = draw(_components)
    at = draw(st.integers(0, len(base)))
    inserted = draw(st.lists(_names, min_size=1, max_size=2))
    wrapped = base[:at] + inserted + base[at:]
    a, b = ("".join(k + "." for k in p) for p in (base, wrapped))
    return (a, b) if draw(st.booleans()) else (b, a)


@settings(max_examples=examples(50), deadline=None)
@given(
    keys=st.lists(st.lists(_names, min_size=1, max_size=3).map(".".join), min_size=1, max_size=6, unique=True),
    swap=_wrapping_swap(),
)
def test_prefix_hint_names_any_wrapping_swap(keys, swap):
    state_prefix, stored_prefix = swap
    missing = [state_prefix + k for k in keys]
    unexpected = [stored_prefix + k for k in keys]
    hint = prefix_hint(missing, unexpected)
    assert hint is not None and f"{len(keys)} of {len(keys)} missing keys" in hint
    # the swap it names turns every missing key into a stored one
    named = hint.split("the state has ")[1]
    said_state, said_stored = (part.split("'")[1] for part in named.split(" where the checkpoint has "))
    said_state = "" if said_state == "(no prefix)" else said_state
    said_stored = "" if said_stored == "(no prefix)" else said_stored
    assert all(m.startswith(said_state) and said_stored + m[len(said_state) :] in unexpected for m in missing)


@settings(max_examples=examples(50), deadline=None)
@given(
    keys=st.lists(_names, min_size=1, max_size=6, unique=True),
    head=_components,
    mine=_names,
    theirs=_names,
)
def test_prefix_hint_is_silent_when_a_component_is_replaced(keys, head, mine, theirs):
    """``model.extra.weight`` against ``model.2.weight`` is another model, not another wrapping."""
    if mine == theirs:
        return
    prefix = "".join(k + "." for k in head)
    missing = [f"{prefix}{mine}.{k}" for k in keys]
    unexpected = [f"{prefix}{theirs}.{k}" for k in keys]
    assert prefix_hint(missing, unexpected) is None


def test_prefix_hint_stays_silent_for_unrelated_keys():
    assert prefix_hint(["a.weight", "b.bias"], ["c.running_mean"]) is None
    assert prefix_hint(["x.weight", "y.weight", "z.weight"], ["p.x.weight"]) is None  # explains 1 of 3
    assert prefix_hint([], ["a"]) is None and prefix_hint(["a"], []) is None
    assert prefix_hint(["model.extra.weight", "model.extra.bias"], ["model.2.weight", "model.2.bias"]) is None
    assert prefix_hint(["model.weight"], ["model.weight"]) is None  # same prefix: nothing to swap


def test_a_strict_mismatch_names_at_most_eight_keys_per_kind_with_counts(tmp_path):
    stored = {f"layer{i}.weight": torch.zeros(2) for i in range(40)}
    stored |= {f"s{i}": torch.zeros(3) for i in range(12)}
    bcp.save(stored, tmp_path / "ck")
    state = {f"other{i}.weight": torch.zeros(2) for i in range(30)}
    state |= {f"s{i}": torch.zeros(4) for i in range(12)}
    with pytest.raises(bcp.StateMismatchError) as caught:
        bcp.load(state, tmp_path / "ck")
    text = str(caught.value)
    assert "(30 missing, 40 unexpected, 12 shape, 0 dtype, 0 kind mismatches)" in text
    assert "... and 22 more" in text and "... and 32 more" in text and "... and 4 more" in text
    assert text.count("weight") == 16 and len(text) < 1500, text
    # the error still holds every key for a program to use
    assert len(caught.value.missing) == 30 and len(caught.value.unexpected) == 40


def test_load_info_repr_shows_counts_and_names_not_tensor_data(tmp_path):
    bcp.save({"big": torch.arange(100_000.0), "n": 5}, tmp_path / "ck")
    info = bcp.load_with_info({"big": torch.zeros(100_000), "x": torch.zeros(1)}, tmp_path / "ck", strict=False)
    text = repr(info)
    assert "state=<2 leaves: big, x>" in text and "missing=<1: x>" in text and "unexpected=<1: n>" in text
    assert "tensor(" not in text and "99999" not in text and len(text) < 600, text


_SHARDED_TENSOR_JOB = r"""
import socket, sys, tempfile
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
# torch has no public constructor for the legacy class: its private module is the only
# way to build the object users of FSDP1's sharded state dict hand to bcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
import bcp
st = sharded_tensor.empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4, 4)
uri = tempfile.mkdtemp() + "/ckpt"
for what, call in (("save", lambda: bcp.save({"layer": {"w": st}}, uri)),
                   ("load", lambda: bcp.load({"layer": {"w": st}}, uri))):
    if what == "load":
        import torch
        bcp.save({"layer": {"w": torch.zeros(4, 4)}}, uri)
    try:
        call()
        print(what, "accepted")
    except bcp.UnsupportedStateError as e:
        print(what, "refused:", e)
dist.destroy_process_group()
"""


def test_a_legacy_sharded_tensor_is_refused_by_name():
    """FSDP1's ShardedTensor, saved or given as a load template, is refused naming the key
    and DTensor (before, it failed inside torch)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _SHARDED_TENSOR_JOB], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    for what in ("save", "load"):
        line = next(x for x in out.splitlines() if x.startswith(what))
        assert "refused" in line and "'layer.w'" in line and "DTensor" in line, out
