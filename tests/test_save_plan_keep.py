"""A rank's prepared tensors kept between saves (``bcp.kept_plans``, issue 37).

The second save of an unchanged structure must not plan again (counted, not
timed); a save whose structure changed in any way the plan depends on (keys and
their order, dtype, shape, strides, storage offset, memory sharing, conjugate and
negative bits, shards, copy path) must plan again, so that the checkpoint holds
exactly the second state.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
from bcp.io_scheduler.kept_pipelines import make_pipeline
from bcp.kept_plans import LocalPlans, fingerprint
from bcp.planning.cache import clear_plan_caches, plan_cache_for
from bcp.save_phases import prepare_save
from bcp.state import flatten_state
from cuda_fakes import fake_cuda  # noqa: F401 - the fixture
from helpers import examples, tensor_bytes_equal


def local_plans() -> LocalPlans:
    """The single-process save's kept structures (its coordinator's cache key is "local")."""
    return plan_cache_for("local").local(LocalPlans)


def read_back(uri: str) -> dict:
    return bcp.open(uri).state()


def assert_exactly(loaded: dict, state: dict) -> None:
    """Same keys in the same order, and every tensor the same dtype, shape and bits."""
    assert list(loaded) == list(state)
    for key, want in state.items():
        got = loaded[key]
        if isinstance(want, list):
            assert_exactly(dict(enumerate(got)), dict(enumerate(want)))
            continue
        if isinstance(want, bcp.TensorShard | bcp.FlatShard):
            want = want.local.view(want.global_shape)
        want = want.resolve_conj().resolve_neg()
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert tensor_bytes_equal(got, want), key


def test_the_second_save_of_a_structure_reuses_its_plan(tmp_path):
    clear_plan_caches()
    state = {"a": torch.randn(4, 3), "b": torch.arange(10), "step": 3}
    bcp.save(state, str(tmp_path / "x"))
    plans = local_plans()
    assert (plans.built, plans.reused) == (1, 0)
    state["a"].add_(1)  # values change, structure does not
    state["step"] = 4
    bcp.save(state, str(tmp_path / "x"), overwrite=True)
    assert (plans.built, plans.reused) == (1, 1)
    loaded = read_back(str(tmp_path / "x"))
    assert torch.equal(loaded["a"], state["a"]) and loaded["step"] == 4
    bcp.save({**state, "c": torch.ones(2)}, str(tmp_path / "x"), overwrite=True)  # a new key: planned
    assert (plans.built, plans.reused) == (2, 1)


def test_saves_cycling_through_three_structures_reuse_each(tmp_path):
    """A process saving three states in turn (a model, its optimizer, a benchmark's
    sizes) plans each once: neither the rank's kept structures nor the coordinator's
    plans are evicted by the third."""
    clear_plan_caches()
    states = [{f"t{i}": torch.randn(3) for i in range(n)} for n in (1, 2, 3)]
    for _ in range(3):
        for n, state in enumerate(states):
            bcp.async_save(state, str(tmp_path / f"s{n}"), overwrite=True).wait()
    assert (local_plans().built, local_plans().reused) == (3, 6)
    assert len(plan_cache_for("local").held()) == 3


def test_the_pipeline_plan_is_kept_with_the_structure(tmp_path):
    """The file layout and chunks are made once per (structure, writes, settings)."""
    clear_plan_caches()
    state = {f"t{i}": torch.randn(i + 1) for i in range(20)}
    made = []
    for _ in range(3):
        bcp.async_save(state, str(tmp_path / "x"), overwrite=True).wait()
        kept = next(iter(local_plans()._plans.values()))
        made.append([id(p) for p in kept.pipelines.values()])
    assert len(made[0]) == 1 and made[0] == made[1] == made[2]
    assert (local_plans().built, local_plans().reused) == (1, 2)


def test_a_kept_plan_gives_what_planning_gives():
    """Items, layout and digest of a reused plan equal a fresh one's, with this save's tensors."""
    a = torch.randn(6, 4)
    state = {"a": a, "tied": a, "s": bcp.TensorShard(torch.randn(2, 2), (2, 2), (0, 0)), "o": "x"}
    plans = LocalPlans()
    first = prepare_save(state, 0, False, plans=plans)
    again = {**state, "a": a.detach(), "tied": a.detach()}  # new tensor objects over the same memory
    second = prepare_save(again, 0, False, plans=plans)
    fresh = prepare_save(again, 0, False)
    assert (plans.built, plans.reused) == (1, 1)
    assert second.local is first.local and second.layout.digest() == fresh.layout.digest()
    assert [(i.plan, i.piece.box, i.tensor) for i in second.items] == [
        (i.plan, i.piece.box, i.tensor) for i in fresh.items
    ]
    assert all(
        s.piece.tensor is f.piece.tensor or s.tensor == 2 for s, f in zip(second.items, fresh.items, strict=True)
    )
    assert second.items[0].piece.tensor is again["a"]
    assert fresh.items[1].plan.alias_of == "a"


def test_a_kept_plan_holds_no_tensor():
    """The cache must not keep the caller's memory alive after the save."""
    plans = LocalPlans()
    t = torch.randn(1000)
    prepare_save({"t": t}, 0, False, plans=plans)
    kept = next(iter(plans._plans.values()))
    assert not any(isinstance(v, torch.Tensor) and v.numel() for v in _walk(kept))


def _walk(obj, seen=None):
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    children = []
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple):
        children = list(obj)
    elif hasattr(obj, "__dataclass_fields__"):
        children = [getattr(obj, f) for f in obj.__dataclass_fields__]
    for c in children:
        yield from _walk(c, seen)


def test_unfingerprintable_leaves_plan_every_time():
    plans = LocalPlans()
    state = {"s": torch.randn(3, 3).to_sparse()}
    assert fingerprint(flatten_state(state), 0)[0] is None
    with pytest.raises(bcp.UnsupportedStateError, match="'s'"):
        prepare_save(state, 0, False, plans=plans)


# -- a changed structure is never served a kept plan -----------------------------------------

MUTATIONS = (
    "values",
    "reshape",
    "dtype",
    "transpose",
    "offset",
    "add",
    "drop",
    "reorder",
    "rename",
    "tie",
    "untie",
    "conj",
    "neg",
    "shard",
    "flat",
    "nest",
    "realloc",
    "resize",
    "square",
    "rows",
    "conj_tie",
    "neg1",
)


def base_state() -> tuple[dict, dict]:
    """A state whose tensors share memory in the ways the mutations change, and the memory."""
    mem = torch.arange(48, dtype=torch.float32)
    c = torch.complex(torch.arange(6.0), -torch.arange(6.0) - 1)
    a = mem[:24].view(4, 6)
    state = {
        "a": a,
        "b": torch.arange(5, dtype=torch.int64),
        "c": c,
        "im": c.imag,
        "w": mem[24:36],
        "u": a,
        "q": mem[36:45].view(3, 3),
        "i1": c[5:].imag,  # one element: contiguous, so staged from its own memory as it is
    }
    return state, {"mem": mem, "c": c}


PLAIN = {"values", "reshape", "transpose", "shard", "nest", "realloc", "dtype", "resize", "flat", "tie", "untie"}


def mutate(state: dict, mem: dict, how: str) -> dict:
    s = dict(state)
    at = {"dtype": "w", "resize": "w", "reshape": "a", "transpose": "a", "flat": "a", "tie": "a", "untie": "a"}
    key = at.get(how, "b")
    if how in PLAIN and not isinstance(s.get(key), torch.Tensor):
        return s  # that leaf is gone or no longer a plain tensor
    if how == "values":
        s["b"] = s["b"] + 1
    elif how == "reshape":
        s["a"] = s["a"].reshape(-1)
    elif how == "dtype":
        s["w"] = s["w"].view(torch.int32)
    elif how == "transpose":
        s["a"] = s["a"].t()
    elif how == "offset":
        s["w"] = mem["mem"][25:37]
    elif how == "add":
        s["z"] = torch.ones(3)
    elif how == "drop":
        s.pop("b", None)
    elif how == "reorder":
        s = {k: s[k] for k in reversed(s)}
    elif how == "rename":
        s = {("bb" if k == "b" else k): v for k, v in s.items()}
    elif how == "tie":
        s["w"] = s["a"]
    elif how == "untie":
        s["u"] = s["a"].clone()
    elif how == "conj":
        s["c"] = mem["c"].conj()
    elif how == "neg":
        s["im"] = mem["c"].conj().imag  # same memory, shape, strides and dtype: only the negative bit differs
    elif how == "shard":
        s["b"] = bcp.TensorShard(s["b"], (5,), (0,))
    elif how == "flat":
        s["a"] = bcp.FlatShard(mem["mem"][:24], (4, 6), 0)
    elif how == "nest":
        s["b"] = [s["b"]]
    elif how == "realloc":
        s["b"] = s["b"].clone()
    elif how == "square":
        s["q"] = s["q"].t() if isinstance(s.get("q"), torch.Tensor) else s.get("q")  # only the strides change
    elif how == "rows":
        s["q"] = mem["mem"][36:45].view(3, 3)[:2]  # only the shape changes
    elif how == "conj_tie":
        s["cc"] = mem["c"].conj()  # the same memory as "c", other values: not a tied copy of it
    elif how == "neg1":
        s["i1"] = mem["c"][5:].conj().imag  # only the negative bit differs
    elif how == "resize":
        s["w"].resize_(3, 4)  # the same object, its shape changed in place
    return s


def _no_fsync(path: str) -> str:
    """A file URI without fsync: what is planned and written is the same, and the
    eight saves of each example no longer wait on the disk (nothing crashes here)."""
    return Path(path).as_uri() + "?fsync=false"


def check_second_save(root: str, first: list[str], second: list[str]) -> None:
    """Save state 1 (twice: its plans are kept), then state 2, then state 1 again, each
    way (sync and async keep pipeline plans of their own): each checkpoint holds
    exactly the state saved."""
    state, mem = base_state()
    for how in first:
        state = mutate(state, mem, how)
    later = state
    for how in second:
        later = mutate(later, mem, how)
    uri = _no_fsync(os.path.join(root, "x"))
    for save in (bcp.save, lambda s, u, **kw: bcp.async_save(s, u, **kw).wait()):
        for s in (state, state, later, state):
            save(s, uri, overwrite=True)
            assert_exactly(read_back(uri), s)


@pytest.mark.parametrize("how", MUTATIONS)
def test_each_change_is_planned_again(tmp_path, how):
    check_second_save(str(tmp_path), [], [how])


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.lists(st.sampled_from(MUTATIONS), max_size=2), second=st.lists(st.sampled_from(MUTATIONS), max_size=3))
def test_changes_in_any_combination_are_planned_again(tmp_path_factory, first, second):
    check_second_save(str(tmp_path_factory.mktemp("keep")), first, second)


def test_conjugate_and_negative_views_of_one_memory_are_not_tied(tmp_path):
    """Two views of the same memory with the same shape and strides, one lazily
    conjugated (or negated), hold different values: each is stored as itself."""
    c = torch.complex(torch.arange(3.0), -torch.arange(3.0) - 1)
    state = {"x": c, "y": c.conj(), "i": c.imag, "n": c.conj().imag, "again": c}
    bcp.save(state, str(tmp_path / "x"))
    loaded = read_back(str(tmp_path / "x"))
    assert_exactly(loaded, state)
    assert bcp.open(str(tmp_path / "x")).meta("again")  # still tied to "x" (same view, same bits): readable


def test_repeated_async_saves_hold_the_values_at_each_call(tmp_path):
    """Same structure every time (the kept plan serves every save after the first):
    each checkpoint holds the values of its own call, though the state changes at once."""
    clear_plan_caches()
    state = {f"t{i}": torch.full((i + 1, 3), float(i)) for i in range(30)}
    handles = []
    for step in range(4):
        handles.append((step, bcp.async_save(state, str(tmp_path / f"s{step}"))))
        for t in state.values():
            t.add_(100)  # right after the call: must not reach this save
    for step, handle in handles:
        handle.wait()
        loaded = read_back(str(tmp_path / f"s{step}"))
        for i in range(30):
            assert torch.equal(loaded[f"t{i}"], torch.full((i + 1, 3), float(i) + 100 * step))
    assert (local_plans().built, local_plans().reused) == (1, 3)


def test_a_tensor_that_becomes_a_device_tensor_takes_the_device_path(tmp_path, fake):
    """The copy path is part of the structure: the kept plan of a host tensor is not
    used once the same memory is a (fake) device tensor."""
    clear_plan_caches()
    t = torch.randn(64)
    bcp.async_save({"t": t}, str(tmp_path / "x")).wait()
    dev = fake.as_device(t)
    before = len(fake.log)
    bcp.async_save({"t": dev}, str(tmp_path / "x"), overwrite=True).wait()
    assert len(fake.log) > before and not fake.violations
    assert torch.equal(read_back(str(tmp_path / "x"))["t"], t)
    assert local_plans().built == 2


def test_pipeline_plans_are_keyed_by_the_settings(tmp_path):
    """A plan made for one slab size or backend is not used for another."""
    from bcp.io_scheduler.staging import StagingPool
    from bcp.kept_plans import prepare_tensors
    from bcp.target import resolve_backend

    state = {f"t{i}": torch.randn(10_000 * (i + 1)) for i in range(8)}
    plans = LocalPlans()
    prepared = prepare_tensors(flatten_state(state), 0, {}, plans=plans)
    writes = torch.arange(len(prepared.items)).numpy()
    backend = resolve_backend(str(tmp_path / "x"), None)
    small, big = StagingPool(1 << 20, slab_bytes=64 << 10), StagingPool(1 << 22, slab_bytes=1 << 20)
    memo = prepared.local.pipelines
    p1 = make_pipeline(backend, "k", 0, prepared.items, 4096, pool=small, stage_all=True, plans=memo, writes=writes)
    p2 = make_pipeline(backend, "k", 0, prepared.items, 4096, pool=big, stage_all=True, plans=memo, writes=writes)
    p3 = make_pipeline(backend, "k", 0, prepared.items, 4096, pool=small, stage_all=True, plans=memo, writes=writes)
    assert p1.plan is not p2.plan and p3.plan is p1.plan and len(memo) == 2
    assert max(c.nbytes for c in p2.plan.chunks) > 64 << 10 >= max(c.nbytes for c in p1.plan.chunks)


class Loud(str):
    """A key whose str() is not its format(): the FQN takes str(), as fqn_of does."""

    def __str__(self) -> str:
        return "loud"

    def __format__(self, spec: str) -> str:
        return "quiet"


keys = st.one_of(st.text(alphabet="ab.", max_size=2), st.integers(0, 3))
trees = st.recursive(
    st.sampled_from(["tensor", "param", 1.5]),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(keys, kids, max_size=3)),
    max_leaves=8,
)


def build(tree):
    if tree == "tensor":
        return torch.zeros(1)
    if tree == "param":
        return torch.nn.Parameter(torch.zeros(1))
    if isinstance(tree, list):
        return [build(t) for t in tree]
    if isinstance(tree, dict):
        return {k: build(v) for k, v in tree.items()}
    return tree


@settings(max_examples=examples(100), deadline=None)
@given(tree=st.dictionaries(keys, trees, max_size=4))
def test_flattening_names_every_leaf_by_its_path(tree):
    """The FQN built key by key equals fqn_of(path); collisions are still refused."""
    from bcp.state import fqn_of

    state = build(tree)
    try:
        leaves = flatten_state(state)
    except bcp.UnsupportedStateError as e:
        message = str(e)
        leaves = {}
        assert "flatten" in message
    for fqn, leaf in leaves.items():
        assert fqn == leaf.fqn == fqn_of(leaf.path)


def test_a_key_is_named_by_its_str():
    leaves = flatten_state({"m": {Loud("x"): torch.zeros(1), 2: [torch.ones(1)]}})
    assert list(leaves) == ["m.loud", "m.2.0"]
    with pytest.raises(bcp.UnsupportedStateError, match=r"same key 'a\.b'"):
        flatten_state({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})


def test_async_saves_of_every_dtype_and_shape_are_exact(tmp_path):
    """Staging reads dense host tensors through numpy where the dtype has a numpy twin
    and through a byte view otherwise: every stored dtype, 0-dim, a Parameter that
    requires grad and odd strides on size-1 dims, saved twice (the kept plan's way)."""
    from helpers import stored_dtypes

    g = torch.Generator().manual_seed(0)
    state: dict = {}
    for dtype in stored_dtypes():
        raw_bytes = torch.randint(0, 256, (24 * torch.empty(0, dtype=dtype).element_size(),), generator=g)
        t = raw_bytes.to(torch.uint8).view(dtype)
        state[f"{dtype}"] = t.view(2, 3, 4)
        state[f"{dtype}.0d"] = t[5:6].view(())
    state["param"] = torch.nn.Parameter(torch.randn(3, 4))
    state["odd"] = torch.randn(1, 5).as_strided((1, 5), (77, 1))
    assert state["odd"].is_contiguous()
    for _ in range(2):
        bcp.async_save(state, str(tmp_path / "x"), overwrite=True).wait()
        assert_exactly(read_back(str(tmp_path / "x")), state)


_KEYS = st.sampled_from(["a", "b", "a.b", "0", "1", "x"])
_LEAVES = st.sampled_from(["tensor", "object", "list"])
_TREES = st.recursive(_LEAVES, lambda children: st.dictionaries(_KEYS, children, min_size=1, max_size=4), max_leaves=12)


def _build(tree: Any, proxy: bool) -> Any:
    if isinstance(tree, dict):
        built = {k: _build(v, proxy) for k, v in tree.items()}
        return types.MappingProxyType(built) if proxy else built
    return {"tensor": torch.zeros(1), "object": 3, "list": [torch.ones(1), "s"]}[tree]


@settings(max_examples=examples(60), deadline=None)
@given(tree=st.dictionaries(_KEYS, _TREES, min_size=1, max_size=4))
def test_flattening_str_keyed_dicts_inline_matches_the_general_walk(tree):
    """Plain dicts of str keys are walked by a faster loop: the same leaves (names, key
    paths, values) in the same order, and the same refusals, as any other mapping."""
    state = _build(tree, proxy=False)
    proxied = types.MappingProxyType({k: _build(v, proxy=True) for k, v in tree.items()})

    def outcome(s: Any) -> Any:
        try:
            return [(f, leaf.path, _describe(leaf.value)) for f, leaf in flatten_state(s).items()]
        except bcp.UnsupportedStateError as e:
            return str(e)

    assert outcome(state) == outcome(proxied)


def _describe(value: Any) -> Any:
    if isinstance(value, types.MappingProxyType | dict):
        return {k: _describe(v) for k, v in value.items()}
    return ("tensor", value.tolist()) if isinstance(value, torch.Tensor) else repr(value)


@settings(max_examples=examples(30), deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["plain", "shard", "tied", "obj"]), min_size=1, max_size=8),
    picks=st.lists(st.integers(0, 20), max_size=12),
)
def test_kept_items_read_as_the_planned_ones(kinds, picks):
    """A kept plan's items (made only when read, ``KeptItems``) and any subset of them
    (``take``, a rank's writes) read as the items planning gives: each item, their
    order, and the tensors column the pipeline reads (``tensors``)."""
    from bcp.kept_plans import KeptItems, take

    state: dict[str, Any] = {}
    for i, kind in enumerate(kinds):
        t = torch.randn(i + 2, 3)
        if kind == "shard":
            state[f"k{i}"] = bcp.TensorShard(t, (2 * (i + 2), 3), (i + 2, 0))
        elif kind == "tied" and any(type(v) is torch.Tensor for v in state.values()):
            state[f"k{i}"] = next(v for v in state.values() if type(v) is torch.Tensor)  # stored once
        elif kind == "obj":
            state[f"k{i}"] = {"n": i}
        else:
            state[f"k{i}"] = t
    plans = LocalPlans()
    prepare_save(state, 0, False, plans=plans)
    kept = prepare_save(state, 0, False, plans=plans)
    fresh = prepare_save(state, 0, False)
    assert isinstance(kept.items, KeptItems) and plans.reused == 1
    n = len(fresh.items)
    writes = np.array([p % n for p in picks] if n else [], dtype=np.int64)
    every = take(kept.items, np.arange(n))  # one rank writes every box: the kept items themselves, no index list
    assert every is kept.items
    cases = [(kept.items, fresh.items), (take(kept.items, writes), [fresh.items[i] for i in writes.tolist()])]
    cases.append((take(take(kept.items, writes[::-1]), np.arange(len(writes))), [fresh.items[i] for i in writes[::-1]]))
    for got, want in cases:
        assert len(got) == len(want)
        as_list = list(got)
        assert [(i.plan, i.piece.box, i.tensor) for i in as_list] == [(i.plan, i.piece.box, i.tensor) for i in want]
        assert all(a.piece.tensor is b.piece.tensor for a, b in zip(as_list, want, strict=True))
        assert all(a.piece.tensor is got[k].piece.tensor for k, a in enumerate(as_list))
        column = got.tensors() if isinstance(got, KeptItems) else [i.piece.tensor for i in got]
        assert all(a is b.piece.tensor for a, b in zip(column, want, strict=True)) and len(column) == len(want)


def test_a_dict_of_plain_tensors_is_flattened_without_a_python_call_per_tensor():
    """Flattening makes a Leaf per tensor of every save and load: for a dict of plain
    tensors the leaves are made and stored by C loops (before: one ``Leaf.__init__``
    a tensor), and each leaf reads back its name, key path and the tensor itself."""
    import sys

    state = {f"t{i}": torch.zeros(1) for i in range(1000)}
    flatten_state(state)  # the names and key paths kept
    calls: list[str] = []

    def profile(frame, event, _arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        leaves = flatten_state(state)
    finally:
        sys.setprofile(None)
    assert len(calls) < 50, f"{len(calls)} Python calls for 1,000 tensors"
    assert list(leaves) == list(state)
    for k, leaf in leaves.items():
        assert (leaf.fqn, leaf.path) == (k, (("d", k),)) and leaf.value is state[k] and leaf.is_tensor


def _reference_leaves(state: Any, path: tuple = ()) -> dict[str, tuple]:
    """fqn -> (key path, tensor) of a nested dict of str keys and tensors, flattened the
    plain way; ValueError when two entries flatten to one name."""
    out: dict[str, tuple] = {}
    for k, v in state.items():
        p = (*path, ("d", k))
        got = _reference_leaves(v, p) if isinstance(v, dict) else {".".join(str(e[1]) for e in p): (p, v)}
        for fqn, leaf in got.items():
            if fqn in out:
                raise ValueError(fqn)
            out[fqn] = leaf
    return out


_KEYS = st.sampled_from(["a", "b", "a.b", "b.a", "c"])
_STATES = st.recursive(
    st.dictionaries(_KEYS, st.builds(lambda: torch.zeros(1)), min_size=1, max_size=4),
    lambda inner: st.dictionaries(_KEYS, st.one_of(inner, st.builds(lambda: torch.zeros(1))), min_size=1, max_size=4),
    max_leaves=12,
)


@settings(max_examples=examples(200), deadline=None)
@given(state=_STATES)
def test_flattening_nested_dicts_of_tensors_matches_the_plain_walk(state):
    """Nested str-keyed dicts of plain tensors (keys with dots among them): the same
    leaves, in the same order, as a plain recursive walk, and a name reached twice is
    refused, whichever dict (taken by C loops or one by one) reaches it second."""
    from bcp.errors import UnsupportedStateError

    try:
        want = _reference_leaves(state)
    except ValueError:
        with pytest.raises(UnsupportedStateError, match="flatten to the same key"):
            flatten_state(state)
        return
    for _ in range(2):  # the second time with the names and key paths kept
        got = flatten_state(state)
        assert list(got) == list(want)
        assert all(got[k].path == p and got[k].value is v for k, (p, v) in want.items())
