"""manifest.json checks itself (FORMAT.md, "manifest.json"): its own CRC32C, and every
field's type and range. Objects decode to a value or to a FormatError naming the key.

The CRC rule is re-implemented here from the spec (``_seal``), so these tests check
the format, not only bcp's own writer against its own reader."""

from __future__ import annotations

import base64
import json
import pathlib
import re

import crc32c
import numpy as np
import pytest
import torch

import bcp
import bcp.cli
from bcp import objcodec
from bcp.metadata import MANIFEST_KEY, FormatError, Manifest
from bcp.verify import verify_checkpoint

GOLDEN_MANIFEST = pathlib.Path(__file__).parent / "golden" / "v1" / MANIFEST_KEY
FIELD = "manifest_crc32c"
_TRAILER = re.compile(rb'"manifest_crc32c"[ \t\n\r]*:[ \t\n\r]*"([0-9a-f]{8})"[ \t\n\r]*\}[ \t\n\r]*\Z')


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 4, generator=g),
        "optim": {"param_groups": [{"lr": 0.001, "params": [0, 1], "betas": (0.9, 0.95)}], "step": 1000},
        "name": "run",
    }


def _saved(tmp_path) -> pathlib.Path:
    root = tmp_path / "ck"
    bcp.save(_state(), str(root))
    return root


def _crc_of(data: bytes) -> int:
    """The spec's rule: CRC32C of the file with the field's 8 hex digits read as ASCII '0'."""
    m = _TRAILER.search(data)
    assert m is not None, "the manifest must end with its manifest_crc32c member"
    return crc32c.crc32c(data[: m.start(1)] + b"00000000" + data[m.end(1) :])


def _seal(doc: dict) -> bytes:
    """``doc`` written as a manifest with a valid manifest_crc32c, by the spec alone."""
    doc = {k: v for k, v in doc.items() if k != FIELD}
    doc[FIELD] = "00000000"
    data = json.dumps(doc, indent=2).encode()
    return data.replace(b'"00000000"\n}', f'"{crc32c.crc32c(data):08x}"\n}}'.encode())


def _doc(root: pathlib.Path) -> dict:
    return json.loads((root / MANIFEST_KEY).read_bytes())


def _parse(data: bytes) -> Manifest:
    return Manifest.from_json(data, where="x/manifest.json")


# -- the manifest's own checksum ------------------------------------------------------


def test_a_new_manifest_ends_with_its_own_crc32c(tmp_path):
    data = (_saved(tmp_path) / MANIFEST_KEY).read_bytes()
    doc = json.loads(data)
    assert list(doc)[-1] == FIELD and doc["version"] == 2
    assert int(doc[FIELD], 16) == _crc_of(data)
    assert _parse(_seal(doc)).objects == _parse(data).objects, "a manifest sealed by the spec must read"


def test_every_single_bit_flip_in_the_manifest_is_refused(tmp_path):
    data = (_saved(tmp_path) / MANIFEST_KEY).read_bytes()
    accepted, unnamed = [], []
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        try:
            _parse(bytes(flipped))
        except FormatError as e:
            if "x/manifest.json" not in str(e):
                unnamed.append(i)
        else:
            accepted.append(i)
    assert not unnamed, f"{len(unnamed)} errors do not name the file"
    assert not accepted, f"{len(accepted)} bit flips accepted, first at byte {accepted[0] // 8}"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"lr": 0.001', b'"lr": 0.009'),
        (b'"name": [', b'"nbme": ['),  # an object renamed
        (b"1000", b"9000"),
    ],
)
def test_load_and_verify_refuse_a_changed_manifest(tmp_path, old, new):
    root = _saved(tmp_path)
    path = root / MANIFEST_KEY
    data = path.read_bytes()
    if old not in data:  # indentation differs: find the value by its text alone
        old, new = old.replace(b": ", b":"), new.replace(b": ", b":")
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    with pytest.raises(bcp.CorruptCheckpointError, match=r"manifest\.json.*CRC32C"):
        bcp.load(_state(), str(root))
    with pytest.raises(bcp.CorruptCheckpointError, match=r"manifest\.json"):
        bcp.open(str(root))
    with pytest.raises(bcp.CorruptCheckpointError, match=r"manifest\.json"):
        verify_checkpoint(str(root))
    assert bcp.cli.main(["verify", str(root)]) == 1


def test_a_manifest_failing_its_checksum_is_a_corrupt_checkpoint(tmp_path):
    root = _saved(tmp_path)
    path = root / MANIFEST_KEY
    path.write_bytes(path.read_bytes().replace(b"1000", b"9000", 1))
    with pytest.raises(bcp.CorruptCheckpointError, match=r"manifest\.json"):
        bcp.open(str(root))


def test_the_checksum_is_required_from_version_2(tmp_path):
    doc = _doc(_saved(tmp_path))
    del doc[FIELD]
    with pytest.raises(FormatError, match="no manifest_crc32c"):
        _parse(json.dumps(doc).encode())


def test_a_version_turned_into_1_still_checks_the_field(tmp_path):
    data = (_saved(tmp_path) / MANIFEST_KEY).read_bytes()
    assert b'"version": 2' in data
    with pytest.raises(FormatError, match="CRC32C"):
        _parse(data.replace(b'"version": 2', b'"version": 1'))


def test_a_version_1_manifest_with_a_damaged_field_name_is_refused(tmp_path):
    data = (_saved(tmp_path) / MANIFEST_KEY).read_bytes()
    data = data.replace(b'"version": 2', b'"version": 1').replace(b'"manifest_crc32c"', b'"manifest_crc32b"')
    with pytest.raises(FormatError, match="manifest_crc32b"):
        _parse(data)


def test_a_sealed_field_that_is_not_last_is_refused(tmp_path):
    doc = _doc(_saved(tmp_path))
    data = _seal(doc)
    moved = json.loads(data)
    crc = moved.pop(FIELD)
    data = json.dumps({FIELD: crc, **moved}, indent=1).encode()
    with pytest.raises(FormatError, match="last member"):
        _parse(data)


def test_an_escaped_key_cannot_pose_as_the_field():
    """A key that ends in the field's name inside a string, not the top-level member."""
    doc = json.loads(GOLDEN_MANIFEST.read_bytes())
    body = json.dumps(doc, indent=1)[:-2]
    data = (body + ',\n "x\\"manifest_crc32c": "00000000"\n}').encode()
    m = _TRAILER.search(data)
    assert m is not None
    data = data[: m.start(1)] + f"{crc32c.crc32c(data):08x}".encode() + data[m.end(1) :]
    with pytest.raises(FormatError, match="manifest_crc32c"):
        _parse(data)


def test_golden_v1_still_parses_without_the_field():
    m = _parse(GOLDEN_MANIFEST.read_bytes())
    assert m.version == 1 and m.world_size == 1


# -- field types and ranges -------------------------------------------------------------


def _set(path: str, value):
    def mutate(doc: dict) -> None:
        *parents, last = path.split("/")
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is _DELETE:
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()
_DEEP: list = []
for _ in range(300):  # deeper than readers accept (200), shallow enough for json.dumps
    _DEEP = [_DEEP]

_MUTATIONS = {
    "version true": _set("version", True),
    "version 0": _set("version", 0),
    "version 4": _set("version", 4),
    "version text": _set("version", "2"),
    "world_size 0": _set("world_size", 0),
    "world_size -1": _set("world_size", -1),
    "world_size text": _set("world_size", "1"),
    "world_size float": _set("world_size", 1.5),
    "world_size bool": _set("world_size", True),
    "world_size 2**63": _set("world_size", 2**63),
    "block 0": _set("checksum/block_bytes", 0),
    "block -1": _set("checksum/block_bytes", -1),
    "block text": _set("checksum/block_bytes", "65536"),
    "block 2**40": _set("checksum/block_bytes", 2**40),
    "block float": _set("checksum/block_bytes", 65536.0),
    "algorithm": _set("checksum/algorithm", "md5"),
    "checksum list": _set("checksum", [1]),
    "save_id empty": _set("save_id", ""),
    "save_id upper": _set("save_id", "ABC"),
    "save_id int": _set("save_id", 5),
    "created int": _set("created", 5),
    "catalog path int": _set("catalog/path", 5),
    "catalog path escapes": _set("catalog/path", "../../etc/passwd"),
    "catalog path absolute": _set("catalog/path", "/etc/passwd"),
    "catalog other generation": _set("catalog/path", "gen-0123/fragments.arrow"),
    "catalog nbytes -1": _set("catalog/nbytes", -1),
    "catalog nbytes text": _set("catalog/nbytes", "5"),
    "catalog nbytes 2**64": _set("catalog/nbytes", 2**64),
    "catalog crc -1": _set("catalog/crc32c", -1),
    "catalog crc 2**32": _set("catalog/crc32c", 2**32),
    "catalog missing": _set("catalog", _DELETE),
    "data_files dict": _set("data_files", {"a": 1}),
    "data file path escapes": _set("data_files/0/path", "gen-x/../../../secret"),
    "data file path elsewhere": _set("data_files/0/path", "other/rank00000-0.bin"),
    "data file nbytes float": _set("data_files/0/nbytes", 1.0),
    "data file entry list": _set("data_files/0", [1, 2, 3]),
    "objects list": _set("objects", []),
    "object entries dict": _set("objects/name", {"a": 1}),
    "object entries empty": _set("objects/name", []),
    "object entry no key_path": _set("objects/name/0/key_path", _DELETE),
    "object entry no value": _set("objects/name/0/value", _DELETE),
    "object key_path text": _set("objects/name/0/key_path", "name"),
    "object key_path bad kind": _set("objects/name/0/key_path", [["x", "name"]]),
    "object key_path other fqn": _set("objects/name/0/key_path", [["d", "other"]]),
    "object key_path empty": _set("objects/name/0/key_path", []),
    "object rank text": _set("objects/name/0/rank", "0"),
    "object rank out of world": _set("objects/name/0/rank", 1),
    "object rank negative": _set("objects/name/0/rank", -1),
    "user_metadata list": _set("user_metadata", [1]),
    "stats list": _set("stats", [1]),
    "byte order": _set("byte_order", "big"),
    "deep user_metadata": _set("user_metadata", {"a": _DEEP}),
    "deep object value": _set("objects/name/0/value", _DEEP),
}


@pytest.mark.parametrize("name", list(_MUTATIONS))
def test_a_malformed_field_is_a_format_error(tmp_path_factory, name):
    doc = _doc(_saved(tmp_path_factory.mktemp("m")))
    _MUTATIONS[name](doc)
    with pytest.raises(FormatError, match=r"x/manifest\.json"):
        _parse(_seal(doc))


_DEEP_TEXT = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"purpose":', '"a": NaN, "purpose":'),
        ('"purpose":', '"a": Infinity, "purpose":'),
        ('"purpose":', '"a": 1e999, "purpose":'),
        ('"purpose":', '"a": ' + "9" * 5000 + ', "purpose":'),
        ('"world_size": 1,', '"world_size": 2, "world_size": 1,'),
        ('"purpose":', '"a": ' + _DEEP_TEXT + ', "purpose":'),
        ('"purpose":', '"a": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + ', "purpose":'),
        ('"world_size": 1,', '"world_size": 1, ' + "[" * 100_000),
    ],
    ids=["nan", "infinity", "overflowing float", "5000 digits", "duplicate key", "deep lists", "deep dicts", "open"],
)
def test_json_that_is_not_plain_json_is_a_format_error(old, new):
    """Each a change to the golden v1 manifest, which has no checksum of its own."""
    text = GOLDEN_MANIFEST.read_text()
    assert old in text
    with pytest.raises(FormatError, match=r"x/manifest\.json"):
        _parse(text.replace(old, new, 1).encode())


def test_a_block_size_of_zero_fails_at_open_not_at_read(tmp_path):
    root = _saved(tmp_path)
    doc = _doc(root)
    doc["checksum"]["block_bytes"] = 0
    (root / MANIFEST_KEY).write_bytes(_seal(doc))
    with pytest.raises(bcp.FormatError, match="block_bytes"):
        bcp.open(str(root)).read("w")


# -- objects --------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


_BAD_OBJECTS = {
    "bytes not text": {"$bcp": "bytes", "v": 5},
    "bytearray bad base64": {"$bcp": "bytearray", "v": "!!"},
    "tuple of text": {"$bcp": "tuple", "v": "abc"},
    "set of text": {"$bcp": "set", "v": "abc"},
    "dict pairs of text": {"$bcp": "dict", "v": ["ab"]},
    "dict triple": {"$bcp": "odict", "v": [["a", 1, 2]]},
    "dict unhashable key": {"$bcp": "dict", "v": [[[1], 1]]},
    "device bad": {"$bcp": "device", "v": "nonsense:7"},
    "device int": {"$bcp": "device", "v": 0},
    "size text": {"$bcp": "size", "v": ["3"]},
    "size bool": {"$bcp": "size", "v": [True]},
    "size negative": {"$bcp": "size", "v": [-1]},
    "size huge": {"$bcp": "size", "v": [2**70]},
    "complex ints": {"$bcp": "complex", "v": [1, 2]},
    "complex one": {"$bcp": "complex", "v": ["1.0"]},
    "float bad": {"$bcp": "float", "v": "1.5"},
    "dtype unknown": {"$bcp": "dtype", "v": "float99"},
    "dtype list": {"$bcp": "dtype", "v": ["float32"]},
    "tensor inferred dims": {"$bcp": "tensor", "dtype": "float32", "shape": [-1, -1], "v": _b64(bytes(4))},
    "tensor one inferred dim": {"$bcp": "tensor", "dtype": "float32", "shape": [-1], "v": _b64(bytes(4))},
    "tensor huge shape": {"$bcp": "tensor", "dtype": "float32", "shape": [2**62, 2**62], "v": ""},
    "tensor shape text": {"$bcp": "tensor", "dtype": "float32", "shape": "ab", "v": ""},
    "tensor dtype list": {"$bcp": "tensor", "dtype": ["float32"], "shape": [], "v": _b64(bytes(4))},
    "tensor no dtype": {"$bcp": "tensor", "shape": [], "v": _b64(bytes(4))},
    "tensor bytes short": {"$bcp": "tensor", "dtype": "float32", "shape": [2], "v": _b64(bytes(4))},
    "ndarray inferred dim": {"$bcp": "ndarray", "dtype": "<f4", "shape": [-1], "v": _b64(bytes(8))},
    "ndarray object dtype": {"$bcp": "ndarray", "dtype": "|O", "shape": [1], "v": _b64(bytes(8))},
    "ndarray dtype list": {"$bcp": "ndarray", "dtype": [["a", "<i4"]], "shape": [1], "v": _b64(bytes(4))},
    "ndarray zero itemsize": {"$bcp": "ndarray", "dtype": "<U0", "shape": [2**62, 2**62], "v": ""},
    "ndarray S0 elements": {"$bcp": "ndarray", "dtype": "|S0", "shape": [4096], "v": ""},
    "ndarray code point": {"$bcp": "ndarray", "dtype": "<U1", "shape": [1], "v": _b64(b"\xff" * 4)},
    "ndarray code point big-endian": {"$bcp": "ndarray", "dtype": ">U1", "shape": [1], "v": _b64(b"\0\x11\0\0")},
    "datetime without unit": {"$bcp": "ndarray", "dtype": "<M8", "shape": [1], "v": _b64(b"\1" + bytes(7))},
    "timedelta without unit": {"$bcp": "npscalar", "dtype": "<m8", "shape": [], "v": _b64(b"\1" + bytes(7))},
    "ndarray shape text": {"$bcp": "ndarray", "dtype": "<i4", "shape": "1", "v": _b64(bytes(4))},
    "npscalar with shape": {"$bcp": "npscalar", "dtype": "<i4", "shape": [2], "v": _b64(bytes(8))},
    "unknown tag": {"$bcp": "module", "v": "os"},
    "tag list": {"$bcp": ["tuple"], "v": []},
    "pickle not allowed": {"$bcp": "pickle", "v": _b64(b"cos\nsystem\n.")},
    "deep tuples": None,  # built below
}
_deep: object = 1
for _ in range(5000):
    _deep = {"$bcp": "tuple", "v": [_deep]}
_BAD_OBJECTS["deep tuples"] = _deep


@pytest.mark.parametrize("name", list(_BAD_OBJECTS))
def test_a_malformed_object_is_a_format_error_naming_the_key(name):
    with pytest.raises((FormatError, bcp.PickleNotAllowedError), match=r"'optim\.step'"):
        objcodec.decode(_BAD_OBJECTS[name], fqn="optim.step")


def test_numpy_values_at_the_edges_of_those_refusals_round_trip(tmp_path):
    """The largest code point (both byte orders), empty strings and a unitless NaT (what
    ``np.datetime64("NaT")`` is) are values, not hostile bytes: they load as saved."""
    values = {
        "u": np.array(["\U0010ffff", ""]),
        "be": np.array(["\U0010ffff"], ">U1"),
        "nat": np.array([np.datetime64("NaT")]),
        "nat1": np.datetime64("NaT"),
        "day": np.array(["2026-11-29"], "datetime64[D]"),
        "empty": np.zeros((0, 3), "<U1"),
        # failed before: the code point check's view of a 0-d array (a str scalar, what
        # iterating a numpy str array gives) raised, so such a checkpoint never loaded
        "scalar": np.str_("adam"),
        "zero_d": np.array("\U0010ffff"),
        "unique": list(np.unique(np.array(["b", "ab", "b"])))[1],
    }
    bcp.save({**values, "w": torch.zeros(1)}, str(tmp_path / "ck"))
    r = bcp.open(str(tmp_path / "ck"))
    for key, want in values.items():
        got = r.read(key)
        assert type(got) is type(want), key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert np.array_equal(got, want, equal_nan=key.startswith("nat")), key


def test_a_broken_pickle_is_a_format_error_when_pickles_are_allowed():
    with pytest.raises(FormatError, match="'k'"):
        objcodec.decode({"$bcp": "pickle", "v": _b64(b"\x80\x05garbage")}, fqn="k", allow_pickle=True)


def test_an_object_nested_deeper_than_readers_accept_is_refused_at_save(tmp_path):
    value: object = 1
    for _ in range(300):
        value = [value]
    with pytest.raises(bcp.UnsupportedStateError, match="'deep'"):
        bcp.save({"deep": value, "w": torch.zeros(2)}, str(tmp_path / "ck"))


def test_objects_that_readers_accept_round_trip(tmp_path):
    value: object = 1
    for _ in range(98):  # two JSON levels each: 196, the most an object may nest
        value = (value,)
    state = {"deep": value, "w": torch.zeros(2), "c": complex(1.5, -2), "s": torch.Size([2, 3])}
    bcp.save(state, str(tmp_path / "ck"))
    r = bcp.open(str(tmp_path / "ck"))
    assert r.read("deep") == value and r.read("c") == state["c"] and r.read("s") == state["s"]


@pytest.mark.parametrize(
    "doc",
    [{}, {"dx": 1}, "dx", [], [["d", "other"]], [["d", "optim"]], [["l", "state"]], [["l", -1]], [["d", True]]],
    ids=["empty dict", "dict", "text", "empty", "other key", "prefix", "list with text key", "negative", "bool"],
)
def test_a_key_path_that_would_put_the_value_elsewhere_is_refused(doc):
    from bcp.state import path_from_json

    with pytest.raises(FormatError, match=r"x/fragments\.arrow: malformed key path for 'optim\.state'"):
        path_from_json(doc, fqn="optim.state", where="x/fragments.arrow")
