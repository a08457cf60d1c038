"""The v2 head's tensor table decoded in numpy passes (issue 37: a load of 10,000 small
tensors spent ~4 us a tensor in a Python loop here): the same table, the same checks of
untrusted bytes as the loop it replaced, shapes made only when asked for."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.metadata import FormatError
from bcp.metadata.catalog import MAX_TENSOR_BYTES, TensorTable
from bcp.metadata.catalog.head import tensor_table
from bcp.metadata.catalog.sections import TENSORS_SCHEMA
from bcp.metadata.dtypes import DTYPE_ITEMSIZE
from helpers import examples


def _table(names, key_paths, dtypes, shapes, *, name_words=None) -> pa.Table:
    """A tensor table in the head's column types; ``name_words`` gives the fqn column
    as a dictionary (indices into these words) instead of plain strings."""
    if name_words is None:
        fqn = pa.array(names, pa.string())
    else:
        fqn = pa.DictionaryArray.from_arrays(pa.array(names, pa.int32()), pa.array(name_words, pa.string()))
    return pa.Table.from_arrays(
        [
            fqn,
            pa.array(key_paths, pa.string()).dictionary_encode(),
            pa.array(dtypes, pa.string()).dictionary_encode(),
            pa.array([list(s) for s in shapes], TENSORS_SCHEMA.field("global_shape").type),
        ],
        names=TENSORS_SCHEMA.names,
    )


def _reference(names, key_paths, dtypes, shapes) -> TensorTable:
    """The per-tensor loop the vectorised decode replaced (and its checks), tensor by tensor."""
    if len(set(names)) != len(names):
        raise FormatError("twice")
    table = TensorTable()
    for f, k, d, shape in zip(names, key_paths, dtypes, shapes, strict=True):
        if any(x < 0 for x in shape):
            raise FormatError("negative")
        if d not in DTYPE_ITEMSIZE:
            raise FormatError("dtype")
        if float(math.prod(max(n, 1) for n in shape)) * DTYPE_ITEMSIZE[d] >= MAX_TENSOR_BYTES:  # torch's strides
            raise FormatError("large")
        table.add(f, k, d, tuple(shape))
    return table


def test_a_dictionary_naming_a_tensor_twice_is_a_format_error():
    """As many dictionary words as rows, but one word used twice and one never: a
    FormatError naming the file and the tensor (it was an AssertionError)."""
    table = _table([0, 0, 1], ["k"] * 3, ["float32"] * 3, [(1,)] * 3, name_words=["a", "b", "c"])
    with pytest.raises(FormatError, match=r"^cat\.arrow: .*'a' twice"):
        tensor_table(table, "cat.arrow")


def test_shapes_are_made_only_when_read():
    table = tensor_table(_table(["a", "b"], ["k", "k"], ["float32", "int8"], [(2, 3), ()]), "c")
    assert "shapes" not in vars(table)  # nothing per tensor until asked
    assert table.arrays.strides.tolist() == [3, 1]
    assert table.shapes == [(2, 3), ()]
    assert vars(table)["shapes"] is table.shapes  # made once, a plain attribute after that
    assert table.add("c", "k", "bool", (4,)) == 2 and table.shapes[2] == (4,)
    assert table.arrays.numel.tolist() == [6, 1, 4]  # rebuilt after add


_HUGE = st.sampled_from([0, 1, (1 << 62) - 1, 1 << 62, (1 << 63) - 1])
_DIMS = st.one_of(st.integers(0, 5), st.integers(0, 1 << 40), _HUGE)
_DTYPES = st.sampled_from(["float32", "bfloat16", "int8", "complex128", "bool", "float99", ""])


@st.composite
def tables(draw):
    n = draw(st.integers(0, 12))
    names = draw(st.lists(st.sampled_from([f"t{i}" for i in range(14)]), min_size=n, max_size=n))
    key_paths = draw(st.lists(st.sampled_from(["[]", '[["d","a"]]', '[["d","b"]]']), min_size=n, max_size=n))
    dtypes = draw(st.lists(_DTYPES, min_size=n, max_size=n))
    negative = draw(st.booleans())
    dims = _DIMS if not negative else st.one_of(_DIMS, st.integers(-3, -1))
    shapes = draw(st.lists(st.lists(dims, max_size=4).map(tuple), min_size=n, max_size=n))
    return names, key_paths, dtypes, shapes


@settings(max_examples=examples(300), deadline=None)
@given(tables())
def test_the_decode_agrees_with_the_loop_it_replaced(case):
    """Same verdict on every table (refused or not); when accepted, the same names,
    key paths, dtypes and shapes, and the same numpy columns a table built tensor by
    tensor has (strides and element counts saturated at MAX_TENSOR_BYTES, codes in
    order of first use)."""
    try:
        want = _reference(*case)
    except FormatError:
        want = None
    if want is None:
        with pytest.raises(FormatError, match=r"^where: "):
            tensor_table(_table(*case), "where")
        return
    got = tensor_table(_table(*case), "where")
    assert (got.names, got.key_paths, got.dtypes) == (want.names, want.key_paths, want.dtypes)
    assert got.index == want.index
    a, b = got.arrays, want.arrays
    for column in ("ndim", "starts", "shape", "strides", "numel", "kp", "dt"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert (a.key_paths, a.dtypes) == (b.key_paths, b.dtypes)
    assert got.shapes == want.shapes
    exact = [[math.prod(s[d + 1 :]) for d in range(len(s))] for s in want.shapes]
    assert a.strides.tolist() == [min(x, MAX_TENSOR_BYTES) for row in exact for x in row]
    assert a.numel.tolist() == [min(math.prod(s), MAX_TENSOR_BYTES) for s in want.shapes]


def _first_seen_reference(codes: list[int], values: list[str]) -> tuple[list[int], dict[str, int]]:
    """Codes renumbered in order of first use, by a pass over the rows."""
    new: dict[int, int] = {}
    out = [new.setdefault(c, len(new)) for c in codes]
    return out, {values[c]: k for c, k in new.items()}


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 6).flatmap(lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k - 1), max_size=40))))
def test_first_seen_agrees_with_a_pass_over_the_rows(case):
    """first_seen's codes and words are a pass's over the rows, in whatever order the
    codes come; codes already in order of first use (a head's dictionary-encoded key
    paths, one a tensor) are that pass's too (the shortcut that skips the sort)."""
    from bcp.metadata.catalog.tensors import first_seen

    k, codes = case
    values = [f"w{i}" for i in range(k)]
    for rows in (codes, _first_seen_reference(codes, values)[0]):  # as drawn, and already in order
        got_codes, got_words = first_seen(np.asarray(rows, np.int64), values)
        want_codes, want_words = _first_seen_reference(rows, values)
        assert got_codes.dtype == np.int64 and got_codes.tolist() == want_codes
        assert got_words == want_words and list(got_words.values()) == list(range(len(want_words)))


def test_codes_already_in_order_of_first_use_are_kept_as_they_are():
    """A head of tensors each with a key path of its own: its codes are in order of
    first use already (Arrow's dictionary encoding), so no sort renumbers them and no
    array is made (failed before: a new array, from np.unique and two argsorts)."""
    from bcp.metadata.catalog.tensors import first_seen

    codes = np.array([0, 1, 0, 2, 3, 1, 4], np.int64)
    got, words = first_seen(codes, ["a", "b", "c", "d", "e", "unused"])
    assert got is codes and words == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}
    names = [f"t{i}" for i in range(50)]
    table = tensor_table(_table(names, [f'[["d", "{n}"]]' for n in names], ["float32"] * 50, [(3,)] * 50), "where")
    assert table.key_paths == [f'[["d", "{n}"]]' for n in names] and table.arrays.kp.tolist() == list(range(50))
