"""Per-tensor fixed costs (issue 37 item 4): the usual load (one writer saved each
tensor whole, the whole tensor is wanted) is planned without the general planner's
numpy, the catalog entries a load needs are built together, small staging copies
are single memmoves, key paths are encoded once; and none of it changes a byte of
what is saved or loaded, whatever changes between saves."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.io_scheduler import read_plan
from bcp.io_scheduler.chunk_bytes import copy_bytes
from bcp.metadata import Catalog, Fragment, TensorEntry
from bcp.metadata.catalog import core
from bcp.state import path_to_json, path_to_str


def mixed_state(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out: dict = {"model": {}, "step": torch.tensor(float(seed))}
    for i in range(n):
        shape = [(3,), (2, 5), (4, 1, 3), ()][i % 4]
        out["model"][f"w{i}"] = torch.randn(shape, generator=g) if shape else torch.tensor(float(i))
    out["model"]["empty"] = torch.zeros(0, 3)
    out["model"]["bf16"] = torch.randn(7, generator=g).to(torch.bfloat16)
    return out


def zeros_like(state: dict) -> dict:
    return {k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal(a[k], b[k])
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def state_keys(state: dict) -> list[str]:
    return [k for k, v in state.items() for k in (state_keys(v) if isinstance(v, dict) else [k])]


def test_whole_tensor_loads_use_no_general_planning(tmp_path, monkeypatch):
    """Failed before: every tensor went through touched_rows (0.1-0.2 ms each)."""
    state = mixed_state(40, 0)
    bcp.save(state, str(tmp_path / "c"))

    def general(*_a, **_k):
        raise AssertionError("the general planner ran for a whole single-fragment tensor")

    monkeypatch.setattr(read_plan, "touched_rows", general)
    monkeypatch.setattr(bcp.reader, "touched_rows", general)
    built: list[int] = []
    build = core.Catalog._build_entries
    monkeypatch.setattr(core.Catalog, "_build_entries", lambda self, todo: built.append(len(todo)) or build(self, todo))
    target = zeros_like(state)
    bcp.load(target, str(tmp_path / "c"))
    assert_equal(target, state)
    # failed before: entries were built one by one; then in one batch; now tensors stored
    # whole take the bulk path and build none (tests/test_load_bulk.py)
    assert len(built) <= 1 and sum(built) <= len(state_keys(state))


def test_a_part_of_a_tensor_still_takes_the_general_planner(tmp_path, monkeypatch):
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    bcp.save(state, str(tmp_path / "c"))
    calls: list[int] = []
    real = read_plan.touched_rows
    monkeypatch.setattr(read_plan, "touched_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    reader = bcp.open(str(tmp_path / "c"))
    part = torch.zeros(2, 4)
    reader.read_into("w", part, box=((1, 0), (2, 4)))
    assert torch.equal(part, state["w"][1:]) and calls


def entry_of(frags: list[Fragment]) -> TensorEntry:
    return Catalog(frags).tensors[frags[0].fqn]


@given(
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
    dest=st.integers(0, 5),
    held=st.booleans(),
)
def test_fast_plan_equals_the_general_plan(shape, dest, held):
    numel = int(np.prod(shape)) if shape else 1
    frag = Fragment("t", '[["d","t"]]', "float32", shape, (0,) * len(shape), shape, "f", 64, 4 * numel, (1,))
    entry = entry_of([frag])
    box = ((0,) * len(shape), shape)
    in_memory = frozenset({box}) if held else frozenset()
    fast = read_plan.plan_tensor_reads(entry, [box], in_memory=in_memory, dest=dest)
    general = read_plan.plan_tensor_reads(entry, [box, box], in_memory=in_memory, dest=dest)[: len(fast)]
    assert [(r.fragment, r.dest, r.src.tolist(), r.dst.tolist(), r.run_bytes) for r in fast] == [
        (r.fragment, r.dest, r.src.tolist(), r.dst.tolist(), r.run_bytes) for r in general
    ]
    assert len(fast) == (0 if held or numel == 0 else 1)


@given(n=st.sampled_from([0, 1, 7, 4096, (4 << 20) - 1, (4 << 20) + 3]), at=st.integers(0, 9))
def test_copy_bytes_is_exact_at_any_size_and_offset(n, at):
    """The staging copy (one memmove through numpy views of the tensors' bytes)."""
    src = torch.randint(0, 256, (n + at,), dtype=torch.uint8)[at:]
    dst = torch.full((n + 2,), 7, dtype=torch.uint8)
    copy_bytes(dst[1 : n + 1].numpy(), src.numpy())
    assert torch.equal(dst[1 : n + 1], src) and dst[0] == 7 and dst[-1] == 7


keys = st.one_of(st.text(min_size=1, max_size=6), st.integers(-3, 1000))
paths = st.lists(st.tuples(st.sampled_from(["d", "l", "t"]), keys), min_size=1, max_size=4).map(tuple)


@given(path=paths)
def test_path_to_str_is_the_stored_json_and_remembered(path):
    text = path_to_str(path)
    assert text == json.dumps(path_to_json(path), ensure_ascii=True, separators=(",", ":"))
    assert path_to_str(path) is text  # failed before: encoded again on every save


@pytest.mark.parametrize("saver", ["save", "async_save"])
def test_state_changed_between_saves_each_checkpoint_exact(tmp_path, saver):
    """Values, shapes, dtypes, names and nesting change between saves of one process:
    every checkpoint holds exactly its own state."""
    states = [mixed_state(12, 1), mixed_state(12, 2), mixed_state(5, 3)]
    states[1]["model"]["w3"] = torch.arange(6, dtype=torch.int64).reshape(3, 2)  # same name, new shape/dtype
    states[2]["model"] = {"w0": states[2]["model"], "x": torch.ones(2)}  # same keys, one level deeper
    for i, state in enumerate(states):
        uri = str(tmp_path / f"c{i}")
        if saver == "save":
            bcp.save(state, uri)
        else:
            bcp.async_save(state, uri).wait()
    for i, state in enumerate(states):
        target = zeros_like(state)
        bcp.load(target, str(tmp_path / f"c{i}"))
        assert_equal(target, state)
