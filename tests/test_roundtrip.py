"""Round trips of random nested states, every dtype, odd shapes, both backends."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from helpers import assert_same, stored_dtypes, tensor_bytes_equal

ALL_DTYPES = stored_dtypes()

shapes = st.lists(st.sampled_from([0, 1, 2, 3, 5, 17]), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw):
    """A tensor of any storable dtype with random bytes, sometimes as a strided view."""
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(shapes)
    numel = math.prod(shape)
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = base.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transpose", "step", "expand"]))
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif view == "step" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    elif view == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    return t


plain_objects = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.complex_numbers(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        | st.dictionaries(st.integers(-5, 5), inner, max_size=3)
        | st.frozensets(st.integers(), max_size=3)
    ),
    max_leaves=8,
)

keys = st.text(alphabet="abcxyz_é0", min_size=1, max_size=4)


@st.composite
def states(draw):
    """A nested dict with tensors and objects at various depths."""

    def node(depth):
        kind = draw(st.sampled_from(["tensor", "object", "dict", "list"] if depth < 3 else ["tensor", "object"]))
        if kind == "tensor":
            return draw(tensors())
        if kind == "object":
            return draw(plain_objects)
        if kind == "dict":
            names = draw(st.lists(keys, min_size=1, max_size=3, unique=True))
            return {n: node(depth + 1) for n in names}
        return [node(depth + 1) for _ in range(draw(st.integers(1, 3)))]

    names = draw(st.lists(keys, min_size=1, max_size=4, unique=True))
    return {n: node(1) for n in names}


def zeros_like_state(state, root=True):
    """A template: same structure, fresh zeroed tensors, placeholder objects."""
    if root:
        return {k: zeros_like_state(v, False) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.empty(state.shape, dtype=state.dtype)
    if isinstance(state, dict) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in state.values()):
        return {k: zeros_like_state(v, False) for k, v in state.items()}
    if isinstance(state, list) and _has_tensor(state):
        return [zeros_like_state(v, False) for v in state]
    return None if not _has_tensor(state) else state


def _has_tensor(x):
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, dict):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def canonical(state):
    """What a round trip yields: views become their contiguous values."""
    if isinstance(state, torch.Tensor):
        from bcp.tensor_io import host_contiguous

        return host_contiguous(state)
    if isinstance(state, dict):
        return {k: canonical(v) for k, v in state.items()}
    if isinstance(state, list):
        return [canonical(v) for v in state]
    return state


def no_fsync(uri: str) -> str:
    """A file location as a file URI without fsync (a memory URI as it is): the bytes
    written and read are the same, and the grid's hundreds of saves no longer wait on
    the disk (durability is not what these round trips check)."""
    return uri if "://" in uri else Path(uri).as_uri() + "?fsync=false"


@given(state=states())
def test_random_state_round_trip(uri_factory, state):
    uri = no_fsync(uri_factory())
    bcp.save(state, uri)
    template = zeros_like_state(state)
    loaded = bcp.load(template, uri)
    assert loaded is template, "load must fill and return the same state object"
    assert_same(canonical(state), loaded)
    # and without any template
    assert_same(canonical(state), bcp.open(uri).state(), ordered=False)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 0, 2), (1, 1, 1, 1), (5, 3)])
def test_every_dtype_and_odd_shape(uri_factory, dtype, shape):
    numel = math.prod(shape)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    uri = no_fsync(uri_factory())
    bcp.save({"t": t}, uri)
    reader = bcp.open(uri)
    assert reader.meta("t").shape == torch.Size(shape) and reader.meta("t").dtype == dtype
    assert tensor_bytes_equal(reader.read("t"), t)
    dest = {"t": torch.empty(shape, dtype=dtype)}
    bcp.load(dest, uri)
    assert tensor_bytes_equal(dest["t"], t)


def test_conjugate_and_negative_views_are_saved_as_values(uri):
    z = torch.randn(4, dtype=torch.complex64)
    bcp.save({"conj": z.conj(), "neg": z.conj().imag}, uri)
    r = bcp.open(uri)
    assert torch.equal(r.read("conj"), z.conj().resolve_conj())
    assert torch.equal(r.read("neg"), z.conj().imag.resolve_neg())


def test_tied_weights_are_stored_once(uri):
    w = torch.randn(256, 64)
    view_of_other = w[:, :32]
    info = bcp.save({"emb": w, "head": w, "part": view_of_other}, uri)
    r = bcp.open(uri)
    emb, head = r.meta("emb").fragments[0], r.meta("head").fragments[0]
    assert (emb.file, emb.byte_offset) == (head.file, head.byte_offset), "tied tensors must share bytes"
    assert info.bytes_written < 2 * w.numel() * 4, "tied weight written twice"
    assert torch.equal(r.read("part"), view_of_other)
    # loading into a template with tied weights keeps the tie and the values
    m = torch.zeros(256, 64)
    out = bcp.load({"emb": m, "head": m, "part": torch.zeros(256, 32)}, uri)
    assert out["emb"] is out["head"] and torch.equal(m, w)


def test_parameters_and_requires_grad_are_filled_in_place(uri):
    lin = torch.nn.Linear(8, 4)
    bcp.save(lin.state_dict(keep_vars=True), uri)
    other = torch.nn.Linear(8, 4)
    ptr = other.weight.data_ptr()
    bcp.load(other.state_dict(keep_vars=True), uri)
    assert other.weight.data_ptr() == ptr and other.weight.requires_grad
    assert torch.equal(other.weight, lin.weight) and torch.equal(other.bias, lin.bias)


def test_optimizer_state_loads_into_a_fresh_optimizer(uri):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step(), sched.step(), opt.zero_grad()
    bcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, uri)

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    state = bcp.load({"model": model2.state_dict(), "optim": opt2.state_dict(), "sched": sched2.state_dict()}, uri)
    opt2.load_state_dict(state["optim"])
    sched2.load_state_dict(state["sched"])
    assert_same(opt.state_dict(), opt2.state_dict(), "optim")
    assert sched2.last_epoch == sched.last_epoch == 3


def test_objects_keep_their_types(uri):
    objs = {
        "rng_py": __import__("random").getstate(),
        "rng_np": np.random.default_rng(3).bit_generator.state,
        "np_legacy": np.random.RandomState(1).get_state(),
        "odict": collections.OrderedDict(b=1, a=2),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "scalar": np.float32(1.5),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "tagged_key": {"$bcp": "not a tag"},
        "tensor_in_object": {(1, 2): torch.arange(3)},
        "inf": float("-inf"),
    }
    bcp.save(objs, uri)
    got = bcp.open(uri).objects()
    assert_same(objs, got)


def test_save_info_reports_what_was_written(uri):
    state = {"a": torch.zeros(1000), "b": torch.ones(10, dtype=torch.int64), "step": 7}
    info = bcp.save(state, uri, metadata={"run": "x"})
    assert (info.tensors, info.objects, info.fragments) == (2, 1, 2)
    assert info.tensor_bytes == 1000 * 4 + 10 * 8
    assert info.seconds > 0 and info.gbps > 0
    r = bcp.open(uri)
    assert r.manifest.user_metadata == {"run": "x"}
    assert r.manifest.world_size == 1 and r.manifest.stats["tensor_bytes"] == info.tensor_bytes


def test_read_a_box_of_one_tensor_reads_only_its_bytes(uri):
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    bcp.save({"w": w, "other": torch.zeros(1000)}, uri)
    reader = bcp.open(uri, verify=False)
    part = reader.read("w", box=((10, 4), (3, 5)))
    assert torch.equal(part, w[10:13, 4:9])
    stats = reader.read_into("w", torch.empty(3, 5), box=((10, 4), (3, 5)))
    # three rows of 5 floats, 27 floats apart: one request each, or one request reading
    # across both gaps where the backend says gaps that small cost less than a request
    gap = 27 * 4
    merged = bcp.backends.backend_for(uri).hints.read_gap_bytes > gap
    assert stats.bytes_read == 3 * 5 * 4 and stats.requests == (1 if merged else 3), stats
    assert stats.padding_bytes == (2 * gap if merged else 0) and stats.verify_bytes == 0, stats
    with pytest.raises(ValueError, match="outside"):
        reader.read("w", box=((60, 0), (5, 32)))
