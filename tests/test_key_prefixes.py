"""A checkpoint's entries each need a place of their own: ``reader.check_keys`` parses key
paths only where some FQN's part before a dot is itself an FQN, which
``bcp.state.a_dot_prefix_is_a_key`` finds set-wise (a model's 10,000 dotted names took
14 ms a load one dot at a time, about 2 by sets)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.state import a_dot_prefix_is_a_key
from helpers import examples

KEYS = st.sets(st.text(alphabet="ab.", max_size=6), max_size=12)


def _brute(keys: set[str]) -> bool:
    return any(k[:i] in keys for k in keys for i, c in enumerate(k) if c == ".")


@settings(max_examples=examples(600), deadline=None)
@given(keys=KEYS)
def test_found_exactly_when_some_part_before_a_dot_is_a_key(keys):
    """Keys of any dots (leading, trailing, doubled, the empty key): the same answer as
    every prefix of every key tested one by one."""
    assert a_dot_prefix_is_a_key(keys) == _brute(keys)


def test_a_model_of_dotted_names_has_none_and_a_nested_pair_is_found():
    names = {f"model.layers.{i // 8}.mlp.w{i % 8}.weight" for i in range(4000)}
    assert not a_dot_prefix_is_a_key(names)
    assert a_dot_prefix_is_a_key(names | {"model.layers.7"})
    assert a_dot_prefix_is_a_key({"a.b.c", "a"})  # two levels up


def test_a_legitimate_dotted_key_beside_its_prefix_still_loads(tmp_path):
    """``{"a": 1, "a.b": t}``: the FQNs meet as strings, not as key paths (parsed, kept)."""
    state = {"a": 1, "a.b": torch.arange(3.0)}
    bcp.save(state, str(tmp_path / "ck"))
    out = {"a": 0, "a.b": torch.zeros(3)}
    bcp.load(out, str(tmp_path / "ck"), allow_pickle=False)
    assert out["a"] == 1 and torch.equal(out["a.b"], torch.arange(3.0))
