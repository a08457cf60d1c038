"""Hostile safetensors files given to ``bcp convert --from safetensors`` (and
``from_safetensors``): every header field is checked against the file before anything
is allocated or mapped, so a load never returns bytes it did not read (an empty span
for a tensor with elements gave uninitialised memory), never reads the header as data
(a negative offset), and never leaves the directory through the index."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.convert.safetensors import from_safetensors, map_safetensors, read_header, safetensors_files
from bcp.errors import FormatError
from helpers import examples


def _file(tmp_path, header: object, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> str:
    text = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return str(path)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"w": _entry(shape=[4096], offsets=[0, 0])},
            r"has 0 bytes at data_offsets \[0, 0\]; its shape \[4096\] needs",
        ),
        ({"w": _entry(offsets=[-8, 0])}, r"data_offsets \[-8, 0\] outside the file's 8 data bytes"),
        ({"w": _entry(offsets=[4, 0])}, r"data_offsets \[4, 0\] outside"),
        ({"w": _entry(offsets=[0, 16])}, r"outside the file's 8 data bytes"),
        ({"a": _entry(), "b": _entry()}, r"tensors 'a' and 'b' share bytes at data offset 0"),
        ({"w": _entry(shape=[-1])}, r"has shape \[-1\], not a list of sizes"),
        ({"w": _entry(shape=[True, 2])}, r"not a list of sizes"),
        ({"w": _entry(shape=[0, 10**30], offsets=[0, 0])}, r"not a list of sizes"),  # a TypeError from torch before
        ({"w": _entry(shape=[0, 2**62, 2**62], offsets=[0, 0])}, r"not a list of sizes"),  # torch's strides overflow
        ({"w": _entry(offsets=[0.0, 8.0])}, r"has data_offsets \[0\.0, 8\.0\], not \[start, end\]"),
        ({"w": {"dtype": "F32", "shape": [2]}}, r"data_offsets None"),
        ({"w": 5}, r"tensor 'w' is described by a JSON int, not an object"),
        ({"w": _entry(dtype="F99")}, r"has dtype 'F99', which bcp does not know"),
        ([1, 2], r"the safetensors header is a JSON list, not an object"),
    ],
)
def test_a_malformed_header_is_a_format_error_naming_the_file_and_tensor(tmp_path, header, message):
    path = _file(tmp_path, header, bytes(8))
    with pytest.raises(FormatError, match=message) as raised:
        map_safetensors(path)
    assert str(raised.value).startswith(path)


@pytest.mark.parametrize(
    ("raw", "length", "message"),
    [
        (b'{"w": 1, "w": 2}', None, r"not valid JSON: the key 'w' appears twice"),
        (b"\xff\xfe", None, r"not valid JSON"),
        (b"{}", 2**62, r"a safetensors header of 4611686018427387904 bytes does not fit its"),
        (b"", 0, r"header of 0 bytes"),
    ],
)
def test_a_header_that_is_not_json_or_not_in_the_file_is_refused_before_reading_it(tmp_path, raw, length, message):
    with pytest.raises(FormatError, match=message):
        map_safetensors(_file(tmp_path, None, raw=raw, length=length))


@pytest.mark.parametrize("name", ["../private/keys.safetensors", "/etc/x.safetensors", "..", "sub/x.safetensors", 3])
def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path, name):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(FormatError, match=r"weight_map names .*, not a file in"):
        safetensors_files(str(tmp_path))


_DTYPES = {"F32": 4, "F16": 2, "U8": 1, "I64": 8}


@settings(max_examples=examples(300), deadline=None)
@given(
    entries=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]),
        st.tuples(
            st.sampled_from(sorted(_DTYPES)),
            st.lists(st.integers(-1, 3), max_size=3),
            st.integers(-4, 40),
            st.integers(-4, 40),
        ),
        max_size=4,
    ),
    data=st.integers(0, 40),
)
def test_a_header_that_passes_describes_disjoint_spans_of_exactly_their_bytes(tmp_path_factory, entries, data):
    """Whatever the fields, read_header refuses them or every tensor it returns lies in
    the data, holds exactly its shape's bytes, and shares none with another."""
    header = {name: _entry(dtype, shape, (lo, hi)) for name, (dtype, shape, lo, hi) in entries.items()}
    path = _file(tmp_path_factory.mktemp("h"), header, bytes(data))
    with open(path, "rb") as f:
        try:
            start, found = read_header(path, f, os.path.getsize(path))
        except FormatError:
            return
    taken: list[tuple[int, int]] = []
    for dtype, shape, lo, hi in found.values():
        assert 0 <= lo <= hi <= data and hi - lo == math.prod(shape) * dtype.itemsize
        assert all(hi <= a or b <= lo for a, b in taken if hi > lo)
        taken.append((lo, hi))
    tensors = map_safetensors(path)
    assert sorted(tensors) == sorted(found) and start > 8
    assert all(t.numel() == math.prod(found[k][1]) for k, t in tensors.items())


def test_a_good_file_with_an_empty_tensor_maps_exactly(tmp_path):
    data = struct.pack("<4f", 1, 2, 3, 4)
    header = {
        "__metadata__": {"k": "v"},
        "w": _entry(shape=[2, 2], offsets=[0, 16]),
        "e": _entry(shape=[0, 3], offsets=[16, 16]),
    }
    tensors = map_safetensors(_file(tmp_path, header, data))
    assert torch.equal(tensors["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]])) and tensors["e"].shape == (0, 3)


def _shards(tmp_path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str]) -> str:
    from safetensors.torch import save_file

    for file, tensors in shards.items():
        save_file(tensors, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("shards", "weight_map", "message"),
    [
        ({"a.safetensors": {"a": torch.ones(2)}}, {"a": "a.safetensors", "b": "a.safetensors"}, r"names tensors no"),
        (
            {"a.safetensors": {"a": torch.ones(2)}, "b.safetensors": {"a": torch.zeros(2)}},
            {"a": "a.safetensors", "x": "b.safetensors"},
            r"b\.safetensors: tensor 'a' is in another shard too",
        ),
        (
            {"a.safetensors": {"a": torch.ones(2)}, "b.safetensors": {"b": torch.zeros(2)}},
            {"a": "b.safetensors", "b": "a.safetensors"},
            r"puts 'a' in 'b\.safetensors', but .*a\.safetensors holds it",
        ),
    ],
)
def test_shards_that_disagree_with_their_index_are_refused(tmp_path, shards, weight_map, message):
    """Failed before: a tensor the index names but no shard holds was dropped (a smaller
    model), and one held by two shards kept the last one read."""
    (tmp_path / "src").mkdir()
    src = _shards(tmp_path / "src", shards, weight_map)
    with pytest.raises(FormatError, match=message):
        from_safetensors(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
