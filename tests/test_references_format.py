"""Format version 3 metadata (FORMAT.md, "References" and "Holds"): data files that
refer to a sibling checkpoint's, the keys of siblings and holds, and the catalog's
optional ``digest`` column. Pure metadata: no save or load here."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.backends.registry import join_uri
from bcp.metadata import Catalog, FileEntry, FormatError, Fragment, Manifest, itemsize
from bcp.metadata.catalog import sections as sections_module
from bcp.metadata.catalog.arrow import ipc_file
from bcp.metadata.keys import (
    SIBLING_NAME_RE,
    catalog_key,
    data_file_key,
    generation_name,
    hold_key,
    parse_hold_key,
    reference_key,
    split_parent,
)
from bcp.metadata.manifest import FORMAT_VERSION, REFERENCES_VERSION, reseal
from helpers import examples

BLOCK = 1024
SAVE_ID = "0123456789abcdef01234567"
GEN = generation_name(SAVE_ID)

names = st.from_regex(SIBLING_NAME_RE, fullmatch=True).filter(lambda s: len(s) <= 40)
save_ids = st.from_regex(r"[0-9a-f]{1,24}", fullmatch=True)


# -- keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "parent", "name"),
    [
        ("s3://b/run/step_00000200", "s3://b/run", "step_00000200"),
        ("s3://b/run/step_1?region=x&a=b", "s3://b/run?region=x&a=b", "step_1"),
        ("s3://b/ckpt", "s3://b", "ckpt"),
        ("file:///tmp/run/a", "file:///tmp/run", "a"),
        ("file:///a", "file:///", "a"),
        ("/tmp/run/a/", "/tmp/run", "a"),
        ("/a", "/", "a"),
        ("run/a", "run", "a"),
        ("a", ".", "a"),
        ("memory://store/run/a", "memory://store/run", "a"),
    ],
)
def test_split_parent(uri, parent, name):
    assert split_parent(uri) == (parent, name)


@pytest.mark.parametrize("uri", ["s3://bucket", "s3://bucket/", "/", "memory://store", "run/..", ".", "a/."])
def test_split_parent_refuses_a_uri_without_a_last_segment(uri):
    with pytest.raises(ValueError, match="has no parent"):
        split_parent(uri)


@settings(max_examples=examples(100))
@given(
    st.sampled_from(["s3://bucket", "s3://bucket/run", "memory://m/x", "/tmp/r", "file:///tmp/r", "run"]),
    names.filter(lambda s: s not in (".", "..")),
    st.sampled_from(["", "?region=eu&x=1"]),
)
def test_split_parent_inverts_join_uri(parent, name, query):
    assert split_parent(join_uri(parent + query, name)) == (parent + query, name)


@settings(max_examples=examples(200))
@given(st.from_regex(r"gen-[0-9a-f]{1,24}", fullmatch=True), names, save_ids)
def test_hold_keys_round_trip(generation, referrer, save_id):
    key = hold_key(generation, referrer, save_id)
    assert key.startswith(f"{generation}/holds/")
    assert parse_hold_key(key) == (generation, referrer, save_id)


@pytest.mark.parametrize(
    "key",
    [
        "gen-ab/holds/step_1",  # no save id
        "gen-ab/holds/step_1.",  # empty save id
        "gen-ab/holds/step_1.XY",  # not lowercase hex
        "gen-ab/holds/.ab",  # no referrer
        "gen-ab/holds/../x.ab",
        "gen-ab/data/step_1.ab",
        "gen-AB/holds/step_1.ab",
        "gen-ab/holds/sub/step_1.ab",
        "manifest.json",
        "holds/step_1.ab",
    ],
)
def test_parse_hold_key_refuses_other_keys(key):
    assert parse_hold_key(key) is None


@pytest.mark.parametrize(
    ("generation", "referrer", "save_id"),
    [("gen-ab", "..", "ab"), ("gen-ab", "a/b", "ab"), ("data", "a", "ab"), ("gen-ab", "a", "AB"), ("gen-ab", "", "a")],
)
def test_hold_key_refuses_names_that_would_not_parse_back(generation, referrer, save_id):
    with pytest.raises(ValueError, match="hold"):
        hold_key(generation, referrer, save_id)


@pytest.mark.parametrize(
    ("checkpoint", "path"),
    [
        ("..", "gen-ab/data/f.bin"),
        (".", "gen-ab/data/f.bin"),
        ("/abs", "gen-ab/data/f.bin"),
        ("a/b", "gen-ab/data/f.bin"),
        ("a", "../gen-ab/data/f.bin"),
        ("a", "/gen-ab/data/f.bin"),
        ("a", "gen-ab/data/../f.bin"),
        ("a", "gen-ab/f.bin"),
        ("a", "mine/data/f.bin"),
    ],
)
def test_reference_key_refuses_anything_outside_a_sibling(checkpoint, path):
    with pytest.raises(ValueError, match="is not <sibling>/gen-<id>/data/<file>"):
        reference_key(checkpoint, path)
    assert reference_key("step_1", "gen-ab/data/rank00000-0.bin") == "step_1/gen-ab/data/rank00000-0.bin"


# -- manifest ---------------------------------------------------------------------------


@st.composite
def data_files(draw) -> tuple[FileEntry, ...]:
    own = draw(st.lists(st.integers(0, 99), max_size=3, unique=True))
    refs = draw(
        st.lists(
            st.tuples(names, save_ids.filter(lambda s: s != SAVE_ID), st.integers(0, 99)),
            max_size=4,
            unique_by=lambda t: (t[1], t[2]),
        )
    )
    nbytes, crcs = st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1)
    files = [FileEntry(data_file_key(GEN, r), draw(nbytes), draw(crcs)) for r in own]
    files += [
        FileEntry(data_file_key(generation_name(sid), r), draw(nbytes), draw(crcs), checkpoint=name)
        for name, sid, r in refs
    ]
    return tuple(draw(st.permutations(files)))


def _manifest(files: tuple[FileEntry, ...], **changes) -> Manifest:
    fields = {
        "save_id": SAVE_ID,
        "created": "2024-01-01T00:00:00Z",
        "world_size": 2,
        "catalog": FileEntry(catalog_key(GEN), 10, 5),
        "data_files": files,
        "objects": {},
        "checksum_block_bytes": BLOCK,
        "bcp_version": "t",
        "torch_version": "t",
    }
    return Manifest(**{**fields, **changes})


@settings(max_examples=examples(200))
@given(data_files())
def test_manifests_with_references_round_trip(files):
    m = _manifest(files)
    referring = any(f.checkpoint is not None for f in files)
    assert m.version == (REFERENCES_VERSION if referring else FORMAT_VERSION)
    data = m.to_json()
    doc = json.loads(data)
    assert doc["version"] == m.version
    for entry, f in zip(doc["data_files"], files, strict=True):
        assert ("checkpoint" in entry) == (f.checkpoint is not None)  # written only when set
    back = Manifest.from_json(data, where="m")
    assert back == m
    assert back.references == tuple(f for f in files if f.checkpoint is not None)
    assert back.own_files == tuple(f for f in files if f.checkpoint is None)


def test_a_manifest_without_references_stays_version_2():
    m = _manifest((FileEntry(data_file_key(GEN, 0), 4, 1),))
    assert m.version == 2 and b'"checkpoint"' not in m.to_json()


def test_a_writer_cannot_put_references_in_an_older_version():
    ref = FileEntry(data_file_key("gen-ab", 0), 4, 1, checkpoint="step_1")
    with pytest.raises(ValueError, match="need version 3"):
        _manifest((ref,), version=2)


def _doc_with_reference(**entry) -> dict:
    files = (
        FileEntry(data_file_key(GEN, 0), 4, 1),
        FileEntry(data_file_key("gen-ab", 0), 4, 1, checkpoint="step_1"),
    )
    doc = json.loads(_manifest(files).to_json())
    doc["data_files"][1].update(entry)
    return doc


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"checkpoint": ".."}, "data_files[1].checkpoint"),
        ({"checkpoint": "."}, "data_files[1].checkpoint"),
        ({"checkpoint": "/etc"}, "data_files[1].checkpoint"),
        ({"checkpoint": "a/b"}, "data_files[1].checkpoint"),
        ({"checkpoint": ""}, "data_files[1].checkpoint"),
        ({"checkpoint": None}, "data_files[1].checkpoint"),
        ({"checkpoint": 5}, "data_files[1].checkpoint"),
        ({"checkpoint": ["a"]}, "data_files[1].checkpoint"),
        ({"path": f"{GEN}/data/rank00000-1.bin"}, "data_files[1].path"),  # its own generation
        ({"path": "gen-ab/data/../../x"}, "data_files[1].path"),
        ({"path": "/gen-ab/data/x"}, "data_files[1].path"),
        ({"path": "../step_2/gen-ab/data/x"}, "data_files[1].path"),
        ({"path": "gen-ab/fragments.arrow"}, "data_files[1].path"),
        ({"path": "gen-ab/holds/x.ab"}, "data_files[1].path"),
        ({"path": "gen-AB/data/x"}, "data_files[1].path"),
        ({"path": "gen-ab/data/"}, "data_files[1].path"),
        ({"path": data_file_key(GEN, 0)}, "data_files[1].path"),
        ({"nbytes": -1}, "data_files[1].nbytes"),
    ],
)
def test_a_hostile_reference_is_refused_naming_the_field(entry, field):
    with pytest.raises(FormatError, match=rf"^m: field '{field}'".replace("[", r"\[").replace("]", r"\]")):
        Manifest.from_json(reseal(_doc_with_reference(**entry)), where="m")


def test_a_reference_needs_version_3():
    doc = _doc_with_reference()
    doc["version"] = 2
    with pytest.raises(FormatError, match=r"data_files\[1\]\.checkpoint.*needs format version 3.*version 2"):
        Manifest.from_json(reseal(doc), where="m")


def test_the_catalog_cannot_be_a_reference():
    doc = _doc_with_reference()
    doc["catalog"]["checkpoint"] = "step_1"
    with pytest.raises(FormatError, match=r"field 'catalog\.checkpoint'"):
        Manifest.from_json(reseal(doc), where="m")


def test_a_referenced_path_is_listed_once_even_under_two_checkpoints():
    doc = _doc_with_reference()
    doc["data_files"].append({**doc["data_files"][1], "checkpoint": "step_2"})
    with pytest.raises(FormatError, match=r"data_files\[2\]\.path.*listed once"):
        Manifest.from_json(reseal(doc), where="m")


def test_version_4_is_refused_naming_both_versions():
    doc = _doc_with_reference()
    doc["version"] = 4
    with pytest.raises(FormatError, match=r"format version 4 .*reads up to 3"):
        Manifest.from_json(reseal(doc), where="m")


# -- the catalog's digest column -----------------------------------------------------


@st.composite
def tiled_fragments(draw, *, digests: bool) -> list[Fragment]:
    """Whole tensors cut into row boxes (they tile, so decoded entries can be built)."""
    out = []
    for t in range(draw(st.integers(1, 4))):
        rows, cols = draw(st.integers(0, 6)), draw(st.integers(1, 3))
        dtype = draw(st.sampled_from(["float32", "int8", "bfloat16"]))
        cuts = sorted({*draw(st.lists(st.integers(0, rows), max_size=3)), 0, rows})
        for a, b in zip(cuts, cuts[1:] or [rows], strict=False):
            nbytes = (b - a) * cols * itemsize(dtype)
            out.append(
                Fragment(
                    fqn=f"t{t}",
                    key_path=f'[["d","t{t}"]]',
                    dtype=dtype,
                    global_shape=(rows, cols),
                    offsets=(a, 0),
                    lengths=(b - a, cols),
                    file=draw(st.sampled_from([f"{GEN}/data/rank00000-0.bin", "gen-ab/data/rank00001-0.bin"])),
                    byte_offset=draw(st.integers(0, 2**30)),
                    nbytes=nbytes,
                    checksums=tuple(draw(st.integers(0, 2**32 - 1)) for _ in range(-(-nbytes // BLOCK))),
                    writer_rank=draw(st.integers(0, 3)),
                    digest=draw(st.binary(min_size=16, max_size=16)) if digests else None,
                )
            )
    return out


@settings(max_examples=examples(100))
@given(st.booleans().flatmap(lambda d: tiled_fragments(digests=d)))
def test_catalogs_with_and_without_digests_round_trip(frags):
    with_digests = frags[0].digest is not None
    for data in (Catalog(frags).to_arrow(), Catalog(frags).to_arrow_v1()):
        back = Catalog.from_arrow(data, where="t", checksum_block_bytes=BLOCK)
        assert sorted(back.fragments, key=repr) == sorted(frags, key=repr)
        for fqn, entry in back.tensors.items():
            mine = sorted((f for f in frags if f.fqn == fqn), key=lambda f: (f.writer_rank, f.offsets))
            got = sorted(
                (entry.fragment(i) for i in range(entry.num_fragments)), key=lambda f: (f.writer_rank, f.offsets)
            )
            assert got == mine
            if with_digests:
                assert entry.digests is not None and entry.digests.shape == (entry.num_fragments, 16)
                assert [entry.digests[i].tobytes() for i in range(entry.num_fragments)] == [
                    entry.fragment(i).digest for i in range(entry.num_fragments)
                ]
            else:
                assert entry.digests is None
        schema = Catalog(frags).to_table().schema
        assert ("digest" in schema.names) == with_digests
        if with_digests:
            assert schema.field("digest").type == pa.binary(16)


def test_entries_built_together_carry_their_digests():
    frags = [
        Fragment(f"t{t}", f'[["d","t{t}"]]', "int8", (2,), (r,), (1,), "f", r, 1, (r,), 0, bytes([t, r] * 8))
        for t in range(3)
        for r in range(2)
    ]
    back = Catalog.from_arrow(Catalog(frags).to_arrow(), where="t", checksum_block_bytes=BLOCK)
    entries = back.entries(["t0", "t1", "t2"])  # one gather (Catalog._build_entries)
    for t, entry in enumerate(entries):
        assert entry.digests is not None
        assert [entry.digests[i].tobytes() for i in range(2)] == [bytes([t, r] * 8) for r in range(2)]


def test_a_sectioned_catalog_keeps_digests_across_sections():
    """Enough writers and rows for several sections, read in part and whole."""
    frags = [
        Fragment("w", '[["d","w"]]', "int8", (9000,), (i,), (1,), "f", i, 1, (0,), i % 8, i.to_bytes(16, "big"))
        for i in range(9000)
    ]
    data = Catalog(frags).to_arrow()
    whole = Catalog.from_arrow(data, where="t", checksum_block_bytes=BLOCK)
    assert whole.sections_held[1] > 1
    entry = whole.tensors["w"]
    by_offset = dict(zip(entry.offsets[:, 0].tolist(), (d.tobytes() for d in entry.digests), strict=True))
    assert by_offset == {i: i.to_bytes(16, "big") for i in range(9000)}


def test_a_catalog_whose_sections_disagree_on_the_digest_column_is_refused(monkeypatch):
    frags = [
        Fragment("w", '[["d","w"]]', "int8", (9000,), (i,), (1,), "f", i, 1, (0,), i % 8, i.to_bytes(16, "big"))
        for i in range(9000)
    ]
    real = sections_module.rows_table
    calls = []

    def second_without_digests(tensors, files, rows, version="1"):
        calls.append(1)
        return real(tensors, files, dataclasses.replace(rows, digests=None) if len(calls) == 2 else rows, version)

    monkeypatch.setattr(sections_module, "rows_table", second_without_digests)
    data = Catalog(frags).to_arrow()
    with pytest.raises(FormatError, match=r"^t: section \d+ has the digest column and section \d+ has not"):
        Catalog.from_arrow(data, where="t", checksum_block_bytes=BLOCK)


def _with_digest_column(column: pa.Array) -> bytes:
    frags = [Fragment("w", '[["d","w"]]', "int8", (2,), (r,), (1,), "f", r, 1, (0,), 0) for r in range(2)]
    table = Catalog(frags).to_table()
    return ipc_file(table.append_column("digest", column))


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (pa.array([b"a" * 16, b"b" * 16], pa.binary()), "column 'digest' is binary; expected fixed_size_binary"),
        (pa.array([b"a" * 8, b"b" * 8], pa.binary(8)), r"column 'digest' is fixed_size_binary\[8\]"),
        (pa.array([1, 2], pa.int64()), "column 'digest' is int64"),
        (pa.array([b"a" * 16, None], pa.binary(16)), "column 'digest' has null values"),
    ],
    ids=["binary", "8 bytes", "int", "null"],
)
def test_a_hostile_digest_column_is_refused_naming_it(column, message):
    with pytest.raises(FormatError, match=r"^t: " + message):
        Catalog.from_arrow(_with_digest_column(column), where="t", checksum_block_bytes=BLOCK)


def test_a_good_digest_column_written_by_hand_is_read():
    values = [bytes(range(16)), bytes(range(16, 32))]
    back = Catalog.from_arrow(
        _with_digest_column(pa.array(values, pa.binary(16))), where="t", checksum_block_bytes=BLOCK
    )
    assert [f.digest for f in back.fragments] == values


def test_fragments_with_and_without_digests_do_not_mix():
    a = Fragment("w", '[["d","w"]]', "int8", (2,), (0,), (1,), "f", 0, 1, (0,), 0, b"x" * 16)
    b = dataclasses.replace(a, offsets=(1,), byte_offset=1, digest=None)
    with pytest.raises(FormatError, match=r"catalog row 1: digest None is not 16 bytes"):
        Catalog([a, b])
    with pytest.raises(FormatError, match=r"catalog row 0: digest b'xx' is not 16 bytes"):
        Catalog([dataclasses.replace(a, digest=b"xx"), dataclasses.replace(b, digest=b"y" * 16)])


def test_from_table_keeps_a_writers_digest_column():
    frags = [Fragment("w", '[["d","w"]]', "int8", (2,), (r,), (1,), "f", r, 1, (0,), 0) for r in range(2)]
    table = Catalog(frags).to_table().append_column("digest", pa.array([b"a" * 16, b"b" * 16], pa.binary(16)))
    cat = Catalog.from_table(table)
    assert cat.tensors["w"].digests is not None
    assert [f.digest for f in Catalog.from_arrow(cat.to_arrow(), where="t", checksum_block_bytes=BLOCK).fragments] == [
        b"a" * 16,
        b"b" * 16,
    ]
    assert np.array_equal(cat.tensors["w"].digests, np.frombuffer(b"a" * 16 + b"b" * 16, np.uint8).reshape(2, 16))
    assert math.prod(cat.tensors["w"].digests.shape) == 32
