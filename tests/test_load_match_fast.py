"""The per-tensor bookkeeping of a load in fewer calls (issue 37): matching plain
tensor leaves, detaching a template and decoding a catalog's strings give exactly what
the general paths give (local_pieces for every leaf, a recursive detach)."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp import loader
from bcp.backends import backend_for
from bcp.errors import FormatError, StateMismatchError
from bcp.metadata.catalog.arrow import string_codes
from bcp.reader import fetch_metadata, open_reader
from bcp.state import detach_stateful

DTYPES = [torch.float32, torch.float16, torch.int64, torch.bfloat16]
#: what the template holds at a stored key: the same tensor, one of another dtype (a
#: cast), of another shape, a Parameter, a tensor needing grad; or the key left out
HOW = ["same", "cast", "shape", "param", "grad", "absent"]

leaf_specs = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 3), max_size=3), st.sampled_from(HOW)),
    min_size=1,
    max_size=6,
)


def plan_fields(plan: loader.LoadPlan) -> tuple:
    """A load plan as comparable values (destinations by identity)."""
    requests = [(r.fqn, tuple(r.box[0]), tuple(r.box[1]), id(r.dest)) for r in plan.tensor_requests]
    return (
        requests,
        sorted(plan.consumed),
        plan.missing,
        plan.unexpected,
        plan.shape_mismatch,
        plan.dtype_mismatch,
        plan.kind_mismatch,
        [leaf.fqn for leaf in plan.object_loads],
    )


def matched(reader, template, strict: bool) -> tuple | str:
    try:
        return plan_fields(loader.match_state(reader, template, strict, 1, None))
    except StateMismatchError as e:
        return str(e)


def _saved(specs, name: str) -> tuple[dict, str]:
    """The stored state of ``specs`` (zeros) and an object, saved to a new memory root."""
    stored: dict = {f"t{i}": torch.zeros(shape, dtype=dtype) for i, (dtype, shape, _how) in enumerate(specs)}
    stored["obj"] = {"lr": 0.1}
    uri = f"memory://{name}-{uuid.uuid4().hex[:8]}/ck"
    bcp.save(stored, uri)
    return stored, uri


@settings(max_examples=40, deadline=None)
@given(specs=leaf_specs, strict=st.booleans(), extra=st.booleans())
def test_matching_plain_tensors_equals_the_general_path(specs, strict, extra):
    """Every kind of plain leaf (match, cast, shape mismatch, Parameter, grad, missing,
    an object where a tensor is stored, an extra key): the plan, or the mismatch error,
    is what matching every leaf through local_pieces gives."""
    _stored, uri = _saved(specs, "match-fast")
    template: dict = {}
    for i, (dtype, shape, how) in enumerate(specs):
        key = f"t{i}"
        if how == "same":
            template[key] = torch.ones(shape, dtype=dtype)
        elif how == "cast":
            template[key] = torch.ones(shape, dtype=torch.float64)
        elif how == "shape":
            template[key] = torch.ones([*shape, 2], dtype=dtype)
        elif how in ("param", "grad") and dtype.is_floating_point:
            template[key] = torch.nn.Parameter(torch.ones(shape, dtype=dtype), requires_grad=how == "grad")
    if extra:
        template["extra"] = torch.ones(2)
        template["t0"] = template.get("t0", 3)  # an object where a tensor is stored: a kind mismatch
    template["obj"] = {"lr": 0.0}
    backend = backend_for(uri)
    reader = open_reader(backend, fetch_metadata(backend))
    try:
        fast = matched(reader, template, strict)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader, "_PLAIN_TENSORS", ())  # every leaf through _match_tensor's local_pieces
            general = matched(reader, template, strict)
    finally:
        reader.close()
    assert fast == general


@settings(max_examples=30, deadline=None)
@given(st.recursive(st.just("t"), lambda kids: st.dictionaries(st.sampled_from("abc"), kids, max_size=3), max_leaves=8))
def test_detaching_a_template_without_stateful_objects_keeps_it_and_finds_the_ones_inside(shape):
    """Plain tensors are kept without a call each: a template of tensors comes back as
    the very same object; a Stateful among them is still found and expanded."""

    def build(node):
        return torch.zeros(2) if node == "t" else {k: build(v) for k, v in node.items()}

    state = {"root": build(shape)}
    detached, found = detach_stateful(state)
    assert detached is state and found == []
    module = torch.nn.Linear(2, 2)
    with_module = {"root": build(shape), "m": module}
    detached, found = detach_stateful(with_module)
    assert found == [((("d", "m"),), module)]
    assert set(detached["m"]) == {"weight", "bias"} and detached["root"] is with_module["root"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["t", "p", "x", 1]), max_size=6))
def test_a_dict_of_plain_tensors_is_detached_without_a_call_a_key(kinds):
    """A flat dict of str keys and plain tensors (the usual load template) is returned as
    it is without a Python call a key (was one ``_plain_key`` call a key: 0.15 us a tensor
    of a 10,000-tensor load); any other dict still goes the general way, with the same answer."""
    from bcp import state as state_module

    calls = []
    real = state_module._plain_key

    def counting(key):
        calls.append(key)
        return real(key)

    values = {"t": torch.zeros(1), "p": torch.nn.Parameter(torch.zeros(1)), "x": {"in": torch.zeros(1)}}
    state = {
        (f"k{i}" if kind != 1 else i): values[kind] if kind != 1 else torch.zeros(1) for i, kind in enumerate(kinds)
    }
    state_module._plain_key = counting
    try:
        detached, found = detach_stateful(state)
    finally:
        state_module._plain_key = real
    assert detached is state and found == []
    plain = all(type(k) is str for k in state) and all(
        type(v) in (torch.Tensor, torch.nn.Parameter) for v in state.values()
    )
    if plain:
        assert calls == []
    else:  # an int key or a nested dict: the general walk, a call a key as before
        assert len(calls) >= len(state)


def test_a_null_string_in_a_catalog_column_is_refused():
    """The None check over a dictionary's words is one C pass; it still refuses a null
    word (null rows are refused before, where the table is read)."""
    words = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.int32()), pa.array(["a", None]))
    with pytest.raises(FormatError, match="null values in the catalog"):
        string_codes(pa.chunked_array([words]), "the catalog")
    codes, values = string_codes(pa.chunked_array([["a", "b", "a"], ["b", "c"]]), "the catalog")
    assert [values[c] for c in codes.tolist()] == ["a", "b", "a", "b", "c"]


def test_any_dtensor_asks_once_per_type_and_not_at_all_without_the_module(monkeypatch):
    """Failed before (no any_dtensor: match_state called is_dtensor once per leaf): the
    guard against filling an optimizer's empty state beside DTensors looks at each
    distinct type once, and at none while DTensor's module was never imported."""
    import sys
    import types

    from bcp.shards import any_dtensor

    asked: list[type] = []

    class Meta(type):
        def __subclasscheck__(cls, sub):
            asked.append(sub)
            return type.__subclasscheck__(cls, sub)

    class FakeDTensor(metaclass=Meta):
        pass

    class Sub(FakeDTensor):
        pass

    plain = [torch.zeros(1) for _ in range(50)] + [torch.nn.Parameter(torch.zeros(1))]
    monkeypatch.delitem(sys.modules, "torch.distributed.tensor", raising=False)
    assert not any_dtensor(iter([*plain, Sub()]))  # no module: no DTensor can exist
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", types.SimpleNamespace(DTensor=FakeDTensor))
    assert not any_dtensor(iter(plain))
    assert sorted(t.__name__ for t in asked) == ["Parameter", "Tensor"]
    assert any_dtensor(iter([*plain, Sub(), 3]))


@settings(max_examples=40, deadline=None)
@given(specs=leaf_specs, extra=st.booleans(), drop_object=st.booleans())
def test_unexpected_keys_are_the_stored_keys_no_leaf_claims(specs, extra, drop_object):
    """A non-strict load's ``unexpected`` (no lookup a stored key now when the leaves
    claimed as many keys as are stored) is every stored key the template does not hold,
    in stored order; a plain leaf's box is the stored shape, plain ints (no torch.Size)."""
    stored, uri = _saved(specs, "match-unexpected")
    template: dict = {}
    for i, (dtype, shape, how) in enumerate(specs):
        if how not in ("absent", "shape"):  # a shape mismatch raises even when not strict
            template[f"t{i}"] = torch.ones(shape, dtype=torch.float64 if how == "cast" else dtype)
    if extra:
        template["extra"] = torch.ones(2)  # missing, never unexpected
    if not drop_object:
        template["obj"] = {"lr": 0.0}
    backend = backend_for(uri)
    reader = open_reader(backend, fetch_metadata(backend))
    try:
        plan = loader.match_state(reader, template, False, 1, None)
        assert plan.unexpected == [key for key in reader.keys() if key not in template]
        assert plan.missing == (["extra"] if extra else [])
        for request in plan.tensor_requests:
            offsets, lengths = request.box
            assert type(lengths) is tuple and all(type(d) is int for d in (*offsets, *lengths))
            assert lengths == tuple(stored[request.fqn].shape) and not any(offsets)
    finally:
        reader.close()
