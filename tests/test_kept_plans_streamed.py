"""A kept structure found without keeping this save's fingerprint (``LocalPlans.find``)
and flattening that reuses the names and key paths of the last dict of the same keys
(``bcp.state._children``): the steady async save's per-tensor work (issue 37).

Many tensors (more than ``_STREAMED_FROM``) are compared row by row as they are read,
and a fingerprint's hash covers only the rows at its ends: a change in the middle of a
large state must still plan again.
"""

from __future__ import annotations

import collections
import tracemalloc
import types
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
from bcp.kept_plans import _STREAMED_FROM, LocalPlans, fingerprint  # private-ok: the streamed path's threshold
from bcp.planning.cache import clear_plan_caches, plan_cache_for
from bcp.save_phases import prepare_save
from bcp.state import flatten_state
from helpers import examples, tensor_bytes_equal

#: a plain state of this many tensors is compared row by row (``find``'s streamed path)
MANY = _STREAMED_FROM + 40

CHANGES = ("stride", "storage", "dtype", "view_of_other", "neg", "offset", "rename", "reshape")


def many_state(n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``n`` small tensors, square 2-D (a transpose changes only strides), out of one memory."""
    mem = torch.arange(n * 4 + 8, dtype=torch.float32)
    c = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    state = {f"t{i}": mem[4 * i : 4 * i + 4].view(2, 2) for i in range(n)}
    state["im"] = c.imag.view(2, 2)
    return state, {"mem": mem, "c": c}


def change(state: dict, mem: dict, how: str, at: int) -> dict:
    """``state`` with tensor ``at`` changed in one way a plan depends on (data_ptr,
    shape and dtype kept wherever the change allows)."""
    s = dict(state)
    key = f"t{at}"
    if how == "stride":
        s[key] = s[key].t()
    elif how == "storage":
        s[key] = s[key].clone()  # a new memory: another address
    elif how == "dtype":
        s[key] = s[key].view(torch.int32)
    elif how == "view_of_other":
        s[key] = s[f"t{at + 1}"]  # now tied to its neighbour
    elif how == "neg":
        s["im"] = mem["c"].conj().imag.view(2, 2)  # same address, shape, strides, dtype: only the bit
    elif how == "offset":  # the same address, as another storage's view at another offset
        shifted = torch.from_numpy(mem["mem"].numpy()[4:])  # a storage starting 4 elements later
        s[key] = torch.as_strided(shifted, (2, 2), (2, 1), 4 * at - 4) if at else s[key].clone()
    elif how == "rename":
        s = {("renamed" if k == key else k): v for k, v in s.items()}
    elif how == "reshape":
        s[key] = s[key].reshape(4)
    return s


def test_a_steady_save_keeps_no_row_per_tensor():
    """The second save of many tensors compares each tensor's fields as it reads them:
    the peak memory of preparing it grows by a few dozen bytes a tensor (the leaves),
    not by the fingerprint's row, sizes and strides (about 440 bytes a tensor before)."""

    def peak(n: int) -> int:
        state = {f"layer{i}": torch.zeros(2, 3) for i in range(n)}
        plans = LocalPlans()
        prepare_save(state, 0, False, plans=plans)
        prepare_save(state, 0, False, plans=plans)  # flattening's names and paths kept too
        tracemalloc.start()
        try:
            prepare_save(state, 0, False, plans=plans)
            top = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (plans.built, plans.reused) == (1, 2)
        return top

    small, large = peak(2 * _STREAMED_FROM), peak(4 * _STREAMED_FROM)
    per_tensor = (large - small) / (2 * _STREAMED_FROM)
    assert per_tensor < 150, f"{per_tensor:.0f} bytes a tensor"


@settings(max_examples=examples(40), deadline=None)
@given(n=st.sampled_from([2, 5, 40, MANY]), how=st.sampled_from(CHANGES), where=st.floats(0, 1), again=st.booleans())
def test_find_serves_a_kept_plan_exactly_when_the_fingerprints_are_equal(n, how, where, again):
    """Whatever changed and wherever (the middle of many tensors is outside the hash),
    ``find`` serves no kept plan: the fingerprints differ; the unchanged state is served
    its kept plan, whose layout is the one planning it afresh gives."""
    state, mem = many_state(n)
    later = change(state, mem, how, int(where * (n - 2)))
    plans = LocalPlans()
    first = prepare_save(state, 0, False, plans=plans)
    if again:
        prepare_save(state, 0, False, plans=plans)
    key, kept, values = plans.find(flatten_state(later), 0)
    assert kept is None and key is not None, how
    assert key != fingerprint(flatten_state(state), 0)[0] and key == fingerprint(flatten_state(later), 0)[0]
    assert len(values) == len(later) and all(a is b for a, b in zip(values, later.values(), strict=True))
    key, kept, values = plans.find(flatten_state(state), 0)
    assert kept is first.local and key == fingerprint(flatten_state(state), 0)[0]
    assert kept.digest == prepare_save(state, 0, False).layout.digest()


def test_a_change_in_the_middle_of_many_tensors_is_saved_as_it_is(tmp_path):
    """End to end, async: each change to a tensor in the middle of a large state (its
    row outside the hash) plans again and the checkpoint holds exactly the new state."""
    clear_plan_caches()
    state, mem = many_state(MANY)
    uri = str(tmp_path / "x")
    kept = plan_cache_for("local").local(LocalPlans)
    for saves, how in enumerate(CHANGES, start=1):
        bcp.async_save(state, uri, overwrite=True).wait()
        later = change(state, mem, how, MANY // 2)
        bcp.async_save(later, uri, overwrite=True).wait()
        loaded = bcp.open(uri).state()
        assert list(loaded) == list(later), how
        for k, want in later.items():
            want = want.resolve_neg()
            assert loaded[k].dtype == want.dtype and loaded[k].shape == want.shape, (how, k)
            assert tensor_bytes_equal(loaded[k], want), (how, k)
        assert kept.built == 1 + saves, how  # the state once, each change once


def test_flattening_again_reuses_names_and_paths():
    """A state flattened again gives the same name and key path objects (compared as
    themselves by the kept plan's rows), and its own values: a plain dict, a module's
    ``state_dict()`` (an OrderedDict) and an optimizer's state (int keys, dicts below)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "w": {f"w{i}": torch.zeros(1) for i in range(5)}}
    a = flatten_state(state)
    state["w"]["w2"] = torch.ones(1)
    state["model"], state["optim"] = model.state_dict(), optim.state_dict()  # new dicts of the same keys
    b = flatten_state(state)
    assert list(a) == list(b) and "optim.state.0.exp_avg" in b and "model.0.weight" in b
    assert all(a[k].path is b[k].path and a[k].fqn is b[k].fqn for k in a if isinstance(a[k].value, torch.Tensor))
    assert (
        b["w.w2"].value is state["w"]["w2"]
        and b["optim.state.1.exp_avg"].value is optim.state[model[0].bias]["exp_avg"]
    )


_NAMES = st.sampled_from(["a", "b", "c", "a.b", "0", "x", "y"])
_ANY_KEYS = st.one_of(st.sampled_from(["a", "b", "a.b", "0", "1"]), st.integers(0, 2), st.just(True))
_TREES = st.recursive(
    st.sampled_from(["tensor", "object", "list", "ids"]),
    lambda children: st.tuples(st.booleans(), st.dictionaries(_ANY_KEYS, children, min_size=1, max_size=4)),
    max_leaves=12,
)


def _tree(tree: Any, general: bool) -> Any:
    """A state of dicts (OrderedDicts where the tree says), or every mapping a proxy (the general walk)."""
    if isinstance(tree, tuple):
        ordered, items = tree
        built = {k: _tree(v, general) for k, v in items.items()}
        if general:
            return types.MappingProxyType(built)
        return collections.OrderedDict(built) if ordered else built
    leaves = {"tensor": torch.zeros(1), "object": 3, "list": [torch.ones(1), "s"], "ids": [0, 1.5, "s", None, True]}
    return leaves[tree]


def _describe(value: Any) -> Any:
    """A flattened leaf's value, comparable across walks."""
    if isinstance(value, types.MappingProxyType | dict):
        return {k: _describe(v) for k, v in value.items()}
    return ("tensor", value.tolist()) if isinstance(value, torch.Tensor) else repr(value)


def _outcome(s: Any) -> Any:
    """What flattening ``s`` gives: names, paths and values, or the refusal's message."""
    try:
        return [(f, leaf.path, _describe(leaf.value)) for f, leaf in flatten_state(s).items()]
    except bcp.UnsupportedStateError as e:
        return str(e)


@settings(max_examples=examples(80), deadline=None)
@given(tree=st.dictionaries(_ANY_KEYS, _TREES, min_size=1, max_size=4), twice=st.booleans())
def test_flattening_ordered_and_int_keyed_dicts_matches_the_general_walk(tree, twice):
    """OrderedDicts and dicts of int keys (a module's and an optimizer's state dicts) are
    walked by the fast loop: the same leaves, names, paths and refusals as any mapping,
    also when flattened a second time (the kept names and paths)."""

    state = {k: _tree(v, general=False) for k, v in tree.items()}
    if twice:
        _outcome(state)
    assert _outcome(state) == _outcome(types.MappingProxyType({k: _tree(v, general=True) for k, v in tree.items()}))


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    keys=st.lists(_NAMES, min_size=1, max_size=6, unique=True),
    swap=st.tuples(st.integers(0, 5), _NAMES),
    nested=st.booleans(),
    kinds=st.lists(st.sampled_from(["tensor", "object", "dict"]), min_size=6, max_size=6),
)
def test_flattening_after_a_similar_dict_matches_the_general_walk(keys, swap, nested, kinds):
    """A dict flattened right after one with the same count, first and last keys but
    another key (or value kind) in between gives its own names, paths and refusals,
    as the general walk (a mapping proxy) does."""

    def build(names: list[str], proxy: bool) -> Any:
        def value(kind: str) -> Any:
            if kind == "dict":
                inner = {"z": torch.ones(1)}
                return types.MappingProxyType(inner) if proxy else inner
            return {"tensor": torch.zeros(1), "object": 3}[kind]

        d = {k: value(kinds[i]) for i, k in enumerate(names)}
        d = types.MappingProxyType(d) if proxy else d
        outer = {"m": d} if nested else dict(d)
        return types.MappingProxyType(outer) if proxy else outer

    other = list(keys)
    i, name = swap
    if 0 < i < len(keys) - 1 and name not in keys:
        other[i] = name  # the same count and ends, another key between
    _outcome(build(keys, proxy=False))  # kept as the last dict of these ends
    assert _outcome(build(other, proxy=False)) == _outcome(build(other, proxy=True))


def test_the_kept_names_and_paths_stay_bounded(monkeypatch):
    """Flattening many different dicts keeps at most ``_CHILDREN_KEYS`` keys' names and
    paths (a dict larger than that is not kept), and each flattens to its own leaves."""
    from bcp import state as state_module  # private-ok below: the cache's bound, test introspection

    monkeypatch.setattr(state_module, "_CHILDREN", {})
    monkeypatch.setattr(state_module, "_children_held", 0)
    monkeypatch.setattr(state_module, "_CHILDREN_KEYS", 20)
    for i in range(50):
        leaves = flatten_state({f"m{i}": {"a": torch.zeros(1), f"b{i}": torch.ones(1)}})
        assert list(leaves) == [f"m{i}.a", f"m{i}.b{i}"]
        held = sum(len(kept[0]) for kept in state_module._CHILDREN.values())
        assert held <= 20 and state_module._children_held <= 20
    big = {f"k{i}": torch.zeros(1) for i in range(30)}
    assert list(flatten_state({"big": big})) == [f"big.k{i}" for i in range(30)]
    assert all(len(kept[0]) <= 20 for kept in state_module._CHILDREN.values())


def test_a_long_list_of_ids_is_told_tensorless_without_a_call_each():
    """An optimizer's param groups list every parameter's id: flattening finds that they
    hold no tensor in one pass (a few calls, not three for each id), and keeps them whole."""
    import sys

    ids = list(range(10_000))
    state = {"optim": {"param_groups": [{"lr": 0.1, "params": ids}], "state": {0: {"m": torch.zeros(1)}}}}
    calls = 0

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        leaves = flatten_state(state)
    finally:
        sys.setprofile(None)
    assert list(leaves) == ["optim.param_groups", "optim.state.0.m"]
    assert leaves["optim.param_groups"].value[0]["params"] is ids
    assert calls < 1_000, calls  # 293 here; 280,419 before (28 an id)
