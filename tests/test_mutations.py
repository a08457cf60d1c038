"""Hostile and damaged checkpoints: every mutant loads the identical state or raises a
documented error naming a file of the checkpoint, within the memory its files justify.

One small checkpoint is saved once (module cache); each example writes a mutated
copy of its files to a fresh directory and loads it three ways: into a template of
the same structure, strictly into a template whose optimizer state is empty (a fresh
optimizer: containers take the stored subtree), and with ``bcp.open(uri).state()``
(every key through ``read``). Mutations: bit flips and truncations of manifest.json,
the catalog and the data file; field values of the manifest (re-sealed with a valid
``manifest_crc32c``, so they reach the checks behind the checksum); and values of
catalog columns (the Arrow table rewritten, its size and CRC put into the manifest,
the manifest re-sealed).

Every outcome is counted in ``OUTCOMES`` (printed with ``-s``; a report only: each test
asserts on what its own ``judge`` call returns, so the order of tests does not matter).
"""

from __future__ import annotations

import collections
import functools
import io
import json
import math
import pathlib
import shutil
import tempfile
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.ipc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
from bcp.metadata import DTYPE_ITEMSIZE, MANIFEST_KEY, crc32c
from bcp.metadata.catalog import sections
from bcp.metadata.catalog.head import decode_head
from bcp.metadata.manifest import reseal
from helpers import assert_same, examples

Files = dict[str, bytes]
#: (mutation family, outcome: "identical" or an error type name) -> count
OUTCOMES: collections.Counter[tuple[str, str]] = collections.Counter()
_SETTINGS = settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 8, generator=g)
    return {
        "model": {
            "w": w,
            "b16": torch.randn(33, generator=g).to(torch.bfloat16),
            "i64": torch.arange(5, dtype=torch.int64) * 10**12,
            "half": torch.randn(3, 3, generator=g).half(),
            "mask": torch.rand(7, generator=g) > 0.5,
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        },
        "optim": {
            "state": {
                0: {"exp_avg": torch.randn(16, 8, generator=g), "step": torch.tensor(1000.0)},
                1: {"exp_avg": torch.randn(33, generator=g), "step": torch.tensor(1000.0)},
            },
            "param_groups": [
                {"lr": 0.001, "betas": (0.9, 0.95), "eps": 1e-8, "params": [0, 1], "name": "main", "foreach": None}
            ],
        },
        "step": 1000,
        "note": "hello, checkpoint",
        "extra": {"nested": {"a": [1, 2, {"b": "c"}], "bytes": b"\x00\xff", "set": {3, 4}}, "flag": True},
    }


@functools.cache
def _original() -> tuple[Files, int]:
    """The saved checkpoint's files (relative path -> bytes) and their total size."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="bcp-mutations-"))
    try:
        bcp.save(_state(), str(root / "ck"), checksum_block_bytes=256)
        files = {
            p.relative_to(root / "ck").as_posix(): p.read_bytes()
            for p in sorted((root / "ck").rglob("*"))
            if p.is_file()
        }
    finally:
        shutil.rmtree(root)
    return files, sum(len(b) for b in files.values())


def _names() -> dict[str, str]:
    files, _ = _original()
    catalog = next(k for k in files if k.endswith("fragments.arrow"))
    data = next(k for k in files if k.endswith(".bin"))
    return {"manifest": MANIFEST_KEY, "catalog": catalog, "data": data}


def _template(*, fresh_optimizer: bool) -> dict:
    s = _state()
    t: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "optim": {
            "state": {i: {k: torch.zeros_like(v) for k, v in p.items()} for i, p in s["optim"]["state"].items()},
            "param_groups": None,
        },
        "step": 0,
        "note": None,
        "extra": None,
    }
    if fresh_optimizer:
        t["optim"]["state"] = {}
    return t


# -- the oracle ------------------------------------------------------------------------


class _Allocations:
    """Fails the example when torch is asked for a tensor larger than the checkpoint's
    files (the only memory a load can justify), whatever the library does with the
    error it gets."""

    def __init__(self, budget: int) -> None:
        self.budget, self.over = budget, []

    def wrap(self, fn: Callable) -> Callable:
        def guarded(*args, **kwargs):
            shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if shape and all(isinstance(n, int) for n in shape):
                dtype = kwargs.get("dtype") or torch.get_default_dtype()
                nbytes = math.prod(shape) * dtype.itemsize
                if nbytes > self.budget:
                    self.over.append((fn.__name__, tuple(shape), dtype))
                    raise MemoryError(f"test: {fn.__name__}{tuple(shape)} {dtype} exceeds {self.budget} bytes")
            return fn(*args, **kwargs)

        return guarded


def _documented(e: BaseException) -> bool:
    return isinstance(e, (bcp.CheckpointError, bcp.StorageError))


def _names_a_file(e: BaseException) -> bool:
    text = " ".join([str(e), str(getattr(e, "file", "") or ""), str(getattr(e, "key", "") or "")])
    return any(name in text for name in (*_names().values(), "fragments.arrow", ".bin"))


def _outcomes(uri: str) -> Iterator[tuple[str, Callable[[], Any], Any]]:
    full = _state()
    yield "template", lambda: bcp.load(_template(fresh_optimizer=False), uri), full
    yield "fresh optimizer", lambda: bcp.load(_template(fresh_optimizer=True), uri, strict=True), full
    yield "open", lambda: bcp.open(uri).state(), full


def _check(family: str, files: Files, tmp_root: pathlib.Path, alloc: _Allocations) -> collections.Counter[str]:
    """Write ``files`` as a checkpoint, load it every way, and judge each outcome; the
    outcomes of this call ("identical" or an error type name -> count)."""
    outcomes: collections.Counter[str] = collections.Counter()
    root = tmp_root / uuid.uuid4().hex[:12]
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    try:
        for how, load, expected in _outcomes(str(root)):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                got = load()
            except BaseException as e:  # the oracle judges every exception
                if not _documented(e):
                    raise AssertionError(f"{family}/{how}: undocumented {type(e).__name__}: {e}") from e
                if not isinstance(e, bcp.StateMismatchError) and not _names_a_file(e):
                    raise AssertionError(f"{family}/{how}: {type(e).__name__} names no file: {e}") from e
                outcomes[type(e).__name__] += 1
            else:
                assert_same(expected, got, f"{family}/{how}", ordered=False)
                outcomes["identical"] += 1
            peak = tracemalloc.get_traced_memory()[1] - base
            assert peak <= alloc.budget + (4 << 20), f"{family}/{how}: {peak} bytes of Python memory"
            assert not alloc.over, f"{family}/{how}: oversized torch allocations {alloc.over}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
        OUTCOMES.update({(family, outcome): n for outcome, n in outcomes.items()})
    return outcomes


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> Iterator[Callable[[str, Files], collections.Counter[str]]]:
    _, total = _original()
    alloc = _Allocations(budget=2 * total + 4096)
    tmp_root = tmp_path_factory.mktemp("mutants")
    mp = pytest.MonkeyPatch()
    for name in ("empty", "zeros"):
        mp.setattr(torch, name, alloc.wrap(getattr(torch, name)))
    tracemalloc.start()
    try:
        yield lambda family, mutant: _check(family, mutant, tmp_root, alloc)
    finally:
        tracemalloc.stop()
        mp.undo()
        print("\nmutation outcomes:", dict(sorted(OUTCOMES.items())))


def test_the_unmutated_checkpoint_loads_identically(judge):
    assert judge("original", dict(_original()[0])) == {"identical": 3}


# -- byte-level mutations ------------------------------------------------------------------


def _flips(data: bytes, bits: list[int]) -> bytes:
    out = bytearray(data)
    for bit in bits:
        out[(bit // 8) % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


_FILE = st.sampled_from(["manifest", "catalog", "data"])


@_SETTINGS
@given(which=_FILE, bits=st.lists(st.integers(min_value=0, max_value=10**7), min_size=1, max_size=4))
def test_bit_flips(judge, which, bits):
    files, _ = _original()
    name = _names()[which]
    judge(f"flip {which}", {**files, name: _flips(files[name], bits)})


@_SETTINGS
@given(which=_FILE, keep=st.floats(min_value=0, max_value=1, exclude_max=True))
def test_truncations(judge, which, keep):
    files, _ = _original()
    name = _names()[which]
    judge(f"truncate {which}", {**files, name: files[name][: int(len(files[name]) * keep)]})


# -- manifest field values ----------------------------------------------------------------

_DEEP: Any = 1
for _ in range(300):
    _DEEP = [_DEEP]

_VALUES = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 255, 256, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63), 10**30]),
    st.sampled_from([0.5, 1.0, -0.0, 1e300]),
    st.sampled_from(["", "x", "0", "../../etc/passwd", "/etc/passwd", "gen-0/fragments.arrow", "00000000"]),
    st.sampled_from([None, True, False, [], {}, [1], {"a": 1}, [[]], _DEEP, {"a": _DEEP}]),
    st.just("<delete>"),
)

#: Where a value may be anything without changing the loaded state (informative fields),
#: or must be refused: every structural field. Object values are left out: changing
#: one is a valid checkpoint with a different state, which no check can tell apart.
_OBJECT_VALUE = ("objects", "*", "*", "value")


def _paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every place in the manifest a mutation can hit: members, items, and inside
    tagged object encodings (their fields only: any value there of another type is
    malformed)."""
    if prefix and prefix[0] == "manifest_crc32c":
        return
    if len(prefix) >= 4 and prefix[0] == "objects" and prefix[3] == "value":
        if isinstance(doc, dict) and "$bcp" in doc:
            for k in doc:
                yield (*prefix, k)
        if isinstance(doc, (dict, list)):
            for k, v in doc.items() if isinstance(doc, dict) else enumerate(doc):
                yield from _paths(v, (*prefix, k))
        return
    if prefix:
        yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _retyped(old: Any, new: Any) -> bool:
    """Inside an object's value only a change of JSON type is surely malformed."""
    return type(old) is not type(new) and not (isinstance(old, bool) or isinstance(new, bool))


@functools.cache
def _manifest_paths() -> list[tuple]:
    return list(_paths(json.loads(_original()[0][MANIFEST_KEY])))


@_SETTINGS
@given(data=st.data())
def test_manifest_field_values(judge, data):
    files, _ = _original()
    doc = json.loads(files[MANIFEST_KEY])
    path = data.draw(st.sampled_from(_manifest_paths()), label="path")
    value = data.draw(_VALUES, label="value")
    *parents, last = path
    node = doc
    for p in parents:
        node = node[p]
    in_object = len(path) > 4 and path[0] == "objects"
    if in_object and (value == "<delete>" or not _retyped(node[last], value)):
        value = _DEEP if not isinstance(node[last], list) else "not an array"
    if value == "<delete>" and path[0] == "objects" and len(path) == 2:
        return  # a checkpoint without that object: valid, and a different state
    if path == ("objects",) and value == {}:
        return  # a checkpoint without objects: valid, and a different state
    if path[0] == "objects" and last == "rank" and type(value) is int and value == 0:
        return  # the one saving rank's per-rank value (open() gives RankValues): valid, a different state
    if value == "<delete>":
        del node[last]
    else:
        node[last] = value
    judge("manifest field", {**files, MANIFEST_KEY: reseal(doc)})


# -- catalog column values ------------------------------------------------------------------

_INTS = st.sampled_from([-1, 0, 1, 3, 255, 4096, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)])
_COLUMN_VALUES: dict[str, st.SearchStrategy] = {
    # another tensor's name; names that no key path matches: test_a_malformed_catalog_key_path...
    "fqn": st.sampled_from(["model.w", "model.b16", "model.scalar", "step"]),
    "dtype": st.sampled_from(["", "float99", "int16", "float64", "uint8", "complex128", "object"]),
    "global_shape": st.lists(_INTS, max_size=3),
    "offsets": st.lists(_INTS, max_size=3),
    "lengths": st.lists(_INTS, max_size=3),
    "file": st.sampled_from(["", "../../etc/passwd", "/etc/passwd", "gen-0/data/rank00000-0.bin", MANIFEST_KEY]),
    "byte_offset": _INTS,
    "nbytes": _INTS,
    "checksums": st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=3),
    "writer_rank": st.integers(min_value=-(2**31), max_value=2**31 - 1),
}


def _catalog_rows() -> tuple[pa.Schema, list[dict]]:
    files, _ = _original()
    table = section_rows(files[_names()["catalog"]])
    return table.schema, table.to_pylist()


def section_rows(data: bytes) -> pa.Table:
    """The rows of a catalog as one table (a v2 catalog: its sections' tables, in order);
    mutants are written back as a v1 catalog, which readers validate the same way."""
    if not sections.is_v2(data):
        return pa.ipc.open_file(pa.BufferReader(data)).read_all()
    start, crc = sections.read_trailer(data, len(data), "t")
    head = decode_head(data[start : -sections.TRAILER.size], start, crc, where="t", budget=1 << 30)
    tables = [
        pa.ipc.open_file(pa.BufferReader(data[o : o + n])).read_all()
        for o, n in zip(head.sec_offset.tolist(), head.sec_length.tolist(), strict=True)
    ]
    return pa.concat_tables(tables)


def _with_catalog(files: Files, schema: pa.Schema, rows: list[dict]) -> Files | None:
    """The files with the catalog rewritten from ``rows`` and the manifest re-sealed
    around its new size and CRC; None when Arrow cannot hold the values."""
    try:
        table = pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return None
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    doc = json.loads(files[MANIFEST_KEY])
    doc["catalog"]["nbytes"], doc["catalog"]["crc32c"] = len(data), crc32c(data)
    return {**files, _names()["catalog"]: data, MANIFEST_KEY: reseal(doc)}


@_SETTINGS
@given(data=st.data())
def test_catalog_column_values(judge, data):
    files, _ = _original()
    schema, rows = _catalog_rows()
    row = data.draw(st.integers(min_value=0, max_value=len(rows) - 1), label="row")
    column = data.draw(st.sampled_from(sorted(_COLUMN_VALUES)), label="column")
    value = data.draw(_COLUMN_VALUES[column], label="value")
    old = rows[row][column]
    if column == "fqn" and value in json.loads(files[MANIFEST_KEY])["objects"]:
        return  # a tensor named like an object: test_a_tensor_named_like_an_object_is_refused
    if value == old or (column == "dtype" and DTYPE_ITEMSIZE.get(value) == DTYPE_ITEMSIZE.get(old)):
        return  # the same, or another dtype of the same size: a valid checkpoint of another state
    rows[row][column] = value
    mutant = _with_catalog(files, schema, rows)
    if mutant is not None:
        judge(f"catalog {column}", mutant)


def test_a_rewritten_catalog_with_no_change_loads_identically(judge):
    files, _ = _original()
    schema, rows = _catalog_rows()
    mutant = _with_catalog(files, schema, rows)
    assert mutant is not None
    assert judge("catalog unchanged", mutant) == {"identical": 3}


@pytest.mark.parametrize(
    ("column", "value"),
    [
        *[("key_path", v) for v in ["", "[", "{}", '{"dx": 1}', '[["d", 1]]', '[["d", "model"], ["d", "v"]]']],
        ("key_path", json.dumps(_DEEP)),
        ("fqn", ""),
        ("fqn", "x" * 300),
        ("fqn", "model.v"),
    ],
)
def test_a_malformed_catalog_key_path_is_refused_naming_the_catalog(judge, column, value):
    """Also a renamed FQN: its key path no longer matches it."""
    files, _ = _original()
    schema, rows = _catalog_rows()
    row = next(i for i, r in enumerate(rows) if r["fqn"] == "model.w")
    rows[row][column] = value
    mutant = _with_catalog(files, schema, rows)
    assert mutant is not None
    judge("catalog key_path", mutant)


def test_a_tensor_named_like_an_object_is_refused(judge):
    files, _ = _original()
    schema, rows = _catalog_rows()
    row = next(i for i, r in enumerate(rows) if r["fqn"] == "model.w")
    rows[row]["fqn"] = "step"
    mutant = _with_catalog(files, schema, rows)
    assert mutant is not None
    judge("catalog fqn is an object", mutant)
    with pytest.raises(bcp.FormatError, match=r"fragments\.arrow: tensor 'step' has the key of an object"):
        _open_mutant(mutant)


@pytest.mark.parametrize(
    ("fqn", "key_path"),
    [
        ("note.w", [["d", "note"], ["d", "w"]]),  # inside an object
        ("extra.nested.a.9", [["d", "extra"], ["d", "nested"], ["d", "a"], ["l", 9]]),  # inside an object's list
        ("model.b16.x", [["d", "model"], ["d", "b16"], ["d", "x"]]),  # inside another tensor
    ],
)
def test_a_tensor_stored_inside_another_entry_is_refused(judge, fqn, key_path):
    """One value would drop the other (or land inside it) in the rebuilt state."""
    files, _ = _original()
    schema, rows = _catalog_rows()
    row = next(i for i, r in enumerate(rows) if r["fqn"] == "model.w")
    rows[row]["fqn"], rows[row]["key_path"] = fqn, json.dumps(key_path)
    mutant = _with_catalog(files, schema, rows)
    assert mutant is not None
    judge("catalog entry inside another", mutant)
    with pytest.raises(bcp.FormatError, match=rf"fragments\.arrow: '{fqn}' is stored inside"):
        _open_mutant(mutant)


def test_keys_that_only_look_nested_load(tmp_path):
    """``{"a": 1, "a.b": t}``: the FQN ``a.b`` starts with the object's ``a.`` but sits
    beside it, not inside it."""
    state = {"a": 1, "a.b": torch.ones(2), "m": {"x": torch.zeros(1)}, "m.x.y": "flat"}
    bcp.save(state, str(tmp_path / "ck"))
    assert_same(state, bcp.open(str(tmp_path / "ck")).state(), "look nested", ordered=False)


def _open_mutant(files: Files) -> bcp.CheckpointReader:
    root = pathlib.Path(tempfile.mkdtemp(prefix="bcp-mutant-"))
    try:
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        return bcp.open(str(root))
    finally:
        shutil.rmtree(root)
