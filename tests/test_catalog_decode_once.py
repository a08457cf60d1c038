"""A v2 catalog's strings are decoded once a load (issue 37: a load of 10,000 small
tensors decoded every tensor name and key path twice, in the head's tensor table and
again in each section's rows, ~1 us a tensor): the sections' rows are matched against
the head's Arrow columns in Arrow. The same rows and the same refusals as before."""

from __future__ import annotations

import collections
import itertools
import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcp.metadata import Catalog, FormatError, Fragment, crc32c, itemsize
from bcp.metadata.catalog import TensorArrays, arrow, head, sections, validate
from helpers import examples

BLOCK = 64


def _frags(n: int, writers: int = 1) -> list[Fragment]:
    """``n`` one-row tensors, each with a key path of its own, dealt over ``writers``."""
    return [
        Fragment(
            f"t{i}", json.dumps([["d", f"t{i}"]]), "float32", (2,), (0,), (2,), "f.bin", 8 * i, 8, (i,), i % writers
        )
        for i in range(n)
    ]


def _count_decoded(monkeypatch) -> collections.Counter:
    """Every string the catalog decodes into Python through ``string_codes`` (each
    module's reference) or the head's name decoder, counted."""
    seen: collections.Counter = collections.Counter()
    real = arrow.string_codes

    def counting(column, where):
        codes, values = real(column, where)
        seen.update(values)
        return codes, values

    for module in (arrow, head, validate):
        monkeypatch.setattr(module, "string_codes", counting)
    real_names = getattr(head, "_names", None)
    if real_names is not None:

        def names(column, where):
            out = real_names(column, where)
            seen.update(out[0])
            return out

        monkeypatch.setattr(head, "_names", names)
    return seen


@pytest.mark.parametrize("min_rows", [sections.MIN_SECTION_ROWS, 1])
@pytest.mark.parametrize("in_part", [False, True])
def test_each_tensor_name_and_key_path_is_decoded_once(monkeypatch, min_rows, in_part):
    """One section or many (each a subset of the tensors), whole or from the head: every
    name and key path of 40 tensors decoded exactly once (twice before)."""
    monkeypatch.setattr(sections, "MIN_SECTION_ROWS", min_rows)
    frags = _frags(40, writers=8)
    data = Catalog(frags).to_arrow()
    seen = _count_decoded(monkeypatch)
    if in_part:
        tail = data[-Catalog.tail_bytes(len(data), data[-sections.TRAILER.size :]) :]
        cat = Catalog.from_head(
            tail, file_size=len(data), fetch=lambda o, n: data[o : o + n], where="c", checksum_block_bytes=BLOCK
        )
        cat.require_all()
    else:
        cat = Catalog.from_arrow(data, where="c", checksum_block_bytes=BLOCK)
    assert (cat.sections_held[1] > 1) == (min_rows == 1)
    assert sorted(cat.fragments, key=lambda f: f.byte_offset) == frags
    strings = [f.fqn for f in frags] + [f.key_path for f in frags]
    assert {s: seen[s] for s in strings} == dict.fromkeys(strings, 1)


_WORDS = st.text(max_size=5)


@st.composite
def catalogs(draw):
    """Tensors with any unicode names and key paths (key paths may repeat), one to three
    rows each (a dim-0 split), dealt over 1-4 writers."""
    names = draw(st.lists(_WORDS, min_size=1, max_size=8, unique=True))
    frags = []
    for name in names:
        kp, dtype = draw(_WORDS), draw(st.sampled_from(["float32", "int8", "bfloat16"]))
        size = draw(st.integers(0, 6))
        cuts = sorted({0, size, *draw(st.lists(st.integers(0, size), max_size=2))})
        for a, b in itertools.pairwise(cuts) if size else [(0, 0)]:
            nbytes = (b - a) * itemsize(dtype)
            sums = tuple(draw(st.integers(0, 2**32 - 1)) for _ in range(-(-nbytes // BLOCK)))
            writer = draw(st.integers(0, 3))
            frags.append(Fragment(name, kp, dtype, (size,), (a,), (b - a,), "f.bin", len(frags), nbytes, sums, writer))
    return frags


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frags=catalogs(), min_rows=st.sampled_from([1, 3, sections.MIN_SECTION_ROWS]))
def test_rows_matched_in_arrow_round_trip(monkeypatch, frags, min_rows):
    """Whatever the names and however the sections cut the rows, the decoded catalog
    holds exactly the rows it was built from, whole and read in part."""
    monkeypatch.setattr(sections, "MIN_SECTION_ROWS", min_rows)
    data = Catalog(frags).to_arrow()
    key = lambda f: f.byte_offset  # noqa: E731 (unique per row)
    back = Catalog.from_arrow(data, where="c", checksum_block_bytes=BLOCK)
    assert sorted(back.fragments, key=key) == frags
    tail = data[-Catalog.tail_bytes(len(data), data[-sections.TRAILER.size :]) :]
    part = Catalog.from_head(
        tail, file_size=len(data), fetch=lambda o, n: data[o : o + n], where="c", checksum_block_bytes=BLOCK
    )
    first = frags[0]
    part.require([(first.fqn, ((0,), first.global_shape))])
    if first.global_shape != (0,):  # an empty box meets no span: nothing read for it
        assert sorted(part.tensors[first.fqn].fragments, key=key) == [f for f in frags if f.fqn == first.fqn]
    part.require_all()
    assert sorted(part.fragments, key=key) == frags


@settings(max_examples=examples(300), deadline=None)
@given(
    vocab=st.lists(_WORDS, max_size=6, unique=True),
    chunks=st.lists(st.lists(_WORDS, max_size=6), max_size=3),
    encode=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_vocab_codes_agree_with_a_lookup_in_python(vocab, chunks, encode):
    """Per-row codes into ``vocab`` (-1 for a word not in it), plain or
    dictionary-encoded chunks alike: what ``vocab.index`` gives, row by row."""
    arrays = [
        pa.array(c, pa.string()).dictionary_encode() if e else pa.array(c, pa.string())
        for c, e in zip(chunks, encode, strict=False)
    ]
    names = pa.array(vocab, pa.string())
    got = [c for a in arrays for c in arrow.vocab_codes(pa.chunked_array([a]), names, "w")]
    plain = pa.chunked_array([a for a in arrays if not pa.types.is_dictionary(a.type)], pa.string())
    assert list(arrow.vocab_codes(plain, names, "w")) == [
        vocab.index(w) if w in vocab else -1 for w in plain.to_pylist()
    ]
    want = [vocab.index(w) if w in vocab else -1 for c in chunks for w in c]
    assert got == want


def test_a_null_word_in_a_dictionary_is_refused():
    words = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array(["a", None], pa.string()))
    with pytest.raises(FormatError, match=r"^w: null values"):
        arrow.vocab_codes(pa.chunked_array([words]), pa.array(["a"], pa.string()), "w")


def _head(data: bytes) -> head.Head:
    head_offset, crc = sections.read_trailer(data, len(data), "c")
    return head.decode_head(data[head_offset : -sections.TRAILER.size], head_offset, crc, where="c", budget=1 << 30)


def _resealed(data: bytes, h: head.Head) -> bytes:
    """``data`` with its head encoded again from ``h`` (changed) under a CRC32C that passes."""
    columns = ("sec_offset", "sec_length", "sec_crc", "sec_rows", "sec_first_writer", "sec_last_writer")
    table = list(zip(*[getattr(h, k).tolist() for k in columns], strict=True))
    new = sections.encode_head(h.tensors, table, [(h.span_section, h.span_tensor, h.span_first, h.span_last)])
    return data[: h.head_offset] + new + sections.TRAILER.pack(len(new), crc32c(new), 0, sections.MAGIC)


@pytest.mark.parametrize("min_rows", [sections.MIN_SECTION_ROWS, 1])
def test_a_section_naming_a_tensor_the_head_lacks_is_refused_naming_it(monkeypatch, min_rows):
    """The head's table renamed (its CRC32C resealed): the section's row names a tensor
    the table does not hold; the error names the section, the row and the tensor."""
    monkeypatch.setattr(sections, "MIN_SECTION_ROWS", min_rows)
    data = Catalog(_frags(6, writers=3)).to_arrow()
    h = _head(data)
    h.tensors.names[4] = "renamed"
    bad = _resealed(data, h)
    with pytest.raises(
        FormatError, match=r"^c \(section \d\) row \d: tensor 't4' is not in the catalog's tensor table"
    ):
        Catalog.from_arrow(bad, where="c", checksum_block_bytes=BLOCK)


def test_a_section_row_whose_key_path_differs_from_the_head_is_refused(monkeypatch):
    data = Catalog(_frags(6, writers=3)).to_arrow()
    h = _head(data)
    h.tensors.key_paths[2] = '[["d","elsewhere"]]'
    bad = _resealed(data, h)
    with pytest.raises(FormatError, match=r"fragments of 't2' disagree on dtype/shape/path"):
        Catalog.from_arrow(bad, where="c", checksum_block_bytes=BLOCK)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**62), max_size=5).map(tuple), max_size=30))
def test_shape_tuples_are_each_tensors_shape(shapes):
    """Shapes zipped from numpy columns, one rank at a time (0-d, mixed and uniform
    ranks), are the tuples of Python ints a loop over the tensors makes."""
    ndim = np.array([len(s) for s in shapes], np.int64)
    flat = np.array([d for s in shapes for d in s], np.int64)
    got = TensorArrays(ndim, flat, ["k"] * len(shapes), ["f"] * len(shapes)).shape_tuples()
    assert got == shapes
    assert all(type(d) is int for s in got for d in s)


def test_check_keys_tests_dot_prefixes_without_a_mapping_call_each(tmp_path, monkeypatch):
    """``check_keys`` looks every dot-prefix of every key up in the catalog's name dict
    (a Mapping ``__contains__`` call each was 0.9 us a tensor of a transformer's state),
    and still refuses a tensor stored inside another."""
    import torch

    import bcp
    from bcp.metadata.catalog.view import TensorsView

    state = {"model": {f"layers.{i}.attn.weight": torch.ones(2) for i in range(20)}, "step": 3}
    bcp.save(state, str(tmp_path / "ok"))
    reader = bcp.open(str(tmp_path / "ok"))
    calls = []
    real = TensorsView.__contains__
    monkeypatch.setattr(TensorsView, "__contains__", lambda self, fqn: calls.append(fqn) or real(self, fqn))
    reader.check_keys()
    assert calls == []
    bcp.save({"a": torch.ones(1), "a.b": torch.ones(1)}, str(tmp_path / "flat"))  # keys as strings: no clash
    bcp.open(str(tmp_path / "flat")).check_keys()


@pytest.mark.parametrize("used", [True, False])
def test_a_null_name_in_the_heads_dictionary_is_refused(used):
    """A dictionary-encoded name column with a null word, used by a row or not, is
    refused as before (the names are decoded by one cast, not word by word)."""
    words = pa.array(["a", None, "b"], pa.string())
    fqn = pa.DictionaryArray.from_arrays(pa.array([0, 1 if used else 2], pa.int32()), words)
    shape = pa.array([[1], [1]], sections.TENSORS_SCHEMA.field("global_shape").type)
    table = pa.Table.from_arrays(
        [fqn, pa.array(["k", "k"]), pa.array(["float32"] * 2), shape], names=sections.TENSORS_SCHEMA.names
    )
    with pytest.raises(FormatError, match=r"^w: null values"):
        head.tensor_table(table, "w")


def test_a_null_inside_a_shape_in_the_heads_tensor_table_is_refused():
    """The head's tensor table read again with one dimension of one shape null (its
    CRC32C resealed): refused as null values, not read as a NaN dimension."""
    data = Catalog(_frags(3)).to_arrow()
    head_offset, _crc = sections.read_trailer(data, len(data), "c")
    old = data[head_offset : -sections.TRAILER.size]
    lengths = sections.HEAD_PREFIX.unpack_from(old, 0)
    at = sections.HEAD_PREFIX.size
    parts = []
    for n in lengths:
        parts.append(old[at : at + n])
        at += n
    table = pa.ipc.open_file(pa.BufferReader(parts[0])).read_all()
    shapes = table.column("global_shape").to_pylist()
    shapes[1] = [None]
    index = table.schema.get_field_index("global_shape")
    table = table.set_column(index, table.schema.field(index), pa.array(shapes, table.schema.field(index).type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    parts[0] = sink.getvalue().to_pybytes()
    new = sections.HEAD_PREFIX.pack(*(len(p) for p in parts)) + b"".join(parts)
    with pytest.raises(FormatError, match=r"^c \(head, tensors\): null values"):
        head.decode_head(new, head_offset, crc32c(new), where="c", budget=1 << 30)
