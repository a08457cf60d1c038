"""Hostile catalogs (issue 14): every reader refuses them with bcp's documented
errors, before allocating what they declare.

* fragments that do not tile their tensor (overlap + hole, sizes adding up) are
  refused by load, load_with_info, open().read(), read of a slice, convert, verify;
* a decompression bomb is refused before it is decompressed (peak memory small);
* a catalog declaring more bytes than the data files hold, in the manifest or in
  storage, fails before anything is allocated;
* malformed rows (int64 overflow, zero block size, bad JSON) raise FormatError.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
import bcp.metadata.catalog as catalog_mod
import bcp.metadata.geometry as geometry
from bcp.backends import backend_for
from bcp.errors import CorruptCheckpointError
from bcp.metadata import MANIFEST_KEY, Catalog, FileEntry, FormatError, Fragment, Manifest, block_checksums, crc32c
from bcp.verify import verify_checkpoint
from helpers import examples, fsdp_catalog_rows

BLOCK = 64 << 10


# -- helpers ------------------------------------------------------------------------------


def _manifest(uri: str) -> Manifest:
    return Manifest.from_json(backend_for(uri).read(MANIFEST_KEY), where="test")


def _replace_catalog(uri: str, data: bytes, **manifest_changes) -> None:
    """Write ``data`` as the catalog, and a manifest whose catalog entry (size, CRC) matches it."""
    backend = backend_for(uri)
    m = _manifest(uri)
    backend.write(m.catalog.path, data)
    m = dataclasses.replace(m, catalog=FileEntry(m.catalog.path, len(data), crc32c(data)), **manifest_changes)
    backend.write(MANIFEST_KEY, m.to_json())


def _saved(tmp_path, nested: bool = False) -> tuple[str, Fragment, bytes]:
    """A checkpoint holding one tensor 'w' (or 'state.w'); its fragment and data file bytes."""
    uri = str(tmp_path / "ck")
    w = torch.arange(8, dtype=torch.float32)
    bcp.save({"state": {"w": w}} if nested else {"w": w}, uri)
    (frag,) = bcp.open(uri).meta("state.w" if nested else "w").fragments
    return uri, frag, backend_for(uri).read(frag.file)


def _frag(base: Fragment, data: bytes, off: tuple[int, ...], lens: tuple[int, ...], byte_offset: int) -> Fragment:
    """A fragment of 'w' over ``data``'s bytes, with correct checksums."""
    nbytes = math.prod(lens) * 4
    sums = tuple(block_checksums(data[byte_offset : byte_offset + nbytes], BLOCK))
    return dataclasses.replace(base, offsets=off, lengths=lens, byte_offset=byte_offset, nbytes=nbytes, checksums=sums)


@pytest.fixture
def overlapping(tmp_path) -> str:
    """'w' [8] stored as [0, 4) and [2, 6): 8 elements in all, [2, 4) twice, [6, 8) nowhere
    (in separate bytes: rows sharing bytes are refused at open)."""
    uri, frag, data = _saved(tmp_path)
    frags = [_frag(frag, data, (0,), (4,), 0), _frag(frag, data, (2,), (4,), 16)]
    _replace_catalog(uri, Catalog(frags).to_arrow())
    return uri


# -- 3: fragments must tile -----------------------------------------------------------------

TILING = r"fragments\.arrow: tensor 'w': its fragments overlap and leave a hole"


@pytest.mark.parametrize(
    "how",
    ["open.read", "open.read_slice", "open.read_into", "open.meta", "open.state", "load", "load_with_info"],
)
def test_fragments_that_overlap_and_leave_a_hole_are_refused(overlapping, how):
    """Before: read() returned uninitialised memory for [6, 8); load kept the template's -1s."""
    r = bcp.open(overlapping)
    call = {
        "open.read": lambda: r.read("w"),
        "open.read_slice": lambda: r.read("w", box=((5,), (3,))),
        "open.read_into": lambda: r.read_into("w", torch.empty(8)),
        "open.meta": lambda: r.meta("w"),
        "open.state": lambda: r.state(),
        "load": lambda: bcp.load({"w": torch.full((8,), -1.0)}, overlapping),
        "load_with_info": lambda: bcp.load_with_info({"w": torch.full((8,), -1.0)}, overlapping, strict=False),
    }[how]
    with pytest.raises(FormatError, match=TILING):
        call()


def test_verify_reports_the_tensor_that_does_not_tile(overlapping):
    from bcp.verify import verify_checkpoint

    report = verify_checkpoint(overlapping)
    assert not report["ok"]
    assert any("'w'" in p and "overlap and leave a hole" in p for p in report["problems"]), report["problems"]


def test_convert_refuses_the_tensor_that_does_not_tile(overlapping, tmp_path):
    from bcp.convert import to_torch

    with pytest.raises(FormatError, match=TILING):
        to_torch(overlapping, str(tmp_path / "out.pt"))


def test_a_hole_alone_is_refused_naming_the_counts(tmp_path):
    uri, frag, data = _saved(tmp_path)
    _replace_catalog(uri, Catalog([_frag(frag, data, (0,), (6,), 0)]).to_arrow())
    with pytest.raises(FormatError, match=r"tensor 'w': its fragments hold 6 elements of its 8 .*missing"):
        bcp.open(uri).read("w")


def test_tiling_along_dim_1_is_accepted_and_cheap():
    """Tensors sharded on dim 1 (every box spans dim 0): the check stays linear."""
    from bcp.metadata.geometry import tiling_problem

    n = 200_000
    offs = np.stack([np.zeros(n, np.int64), np.arange(n, dtype=np.int64)], axis=1)
    lens = np.stack([np.full(n, 7, np.int64), np.ones(n, np.int64)], axis=1)
    perm = np.random.default_rng(0).permutation(n)
    started = time.perf_counter()
    assert tiling_problem((7, n), offs[perm], lens[perm]) is None
    assert time.perf_counter() - started < 2.0
    lens[0, 1] = 2  # column 0's box also covers column 1 ...
    lens[n - 1, 1] = 0  # ... and the last column is empty: the element count still matches
    assert "overlap and leave a hole" in tiling_problem((7, n), offs[perm], lens[perm])


def _cells(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Brute-force oracle: every element covered by exactly one distinct box."""
    count = np.zeros(shape, dtype=np.int64)
    for off, lens in set(boxes):
        count[tuple(slice(o, o + n) for o, n in zip(off, lens, strict=True))] += 1
    return bool((count == 1).all())


@st.composite
def box_sets(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))

    def box():
        off = tuple(draw(st.integers(0, s)) for s in shape)
        return off, tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, off, strict=True))

    if draw(st.booleans()):  # a real tiling: a grid of cuts, maybe perturbed
        cells = [((), ())]
        for s in shape:
            cuts = sorted({0, s, *draw(st.lists(st.integers(0, s), max_size=3))})
            cells = [((*o, a), (*n, b - a)) for o, n in cells for a, b in itertools.pairwise(cuts)]
        boxes = cells + draw(st.lists(st.sampled_from(cells), max_size=2)) if cells else []
        if boxes and draw(st.booleans()):
            i = draw(st.integers(0, len(boxes) - 1))
            boxes[i] = box()
    else:
        boxes = [box() for _ in range(draw(st.integers(1, 6)))]
    return shape, boxes or [box()]


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(box_sets(), st.booleans())
def test_tiling_check_agrees_with_cell_counting(case, sweep):
    from bcp.metadata.geometry import tiling_problem

    shape, boxes = case
    ndim = len(shape)
    offs = np.array([o for o, _n in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    lens = np.array([n for _o, n in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    limit = geometry.MAX_CORNERS
    geometry.MAX_CORNERS = 0 if sweep else limit  # force the sweep fallback
    try:
        got = tiling_problem(shape, offs, lens) is None
    finally:
        geometry.MAX_CORNERS = limit
    assert got == _cells(shape, boxes), (shape, boxes)


# -- 8: decompression bombs ---------------------------------------------------------------

_BOMB = textwrap.dedent(
    """
    import resource, sys
    import bcp
    from bcp.errors import CheckpointError
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    try:
        bcp.open(sys.argv[1]).meta("w")
    except CheckpointError as e:
        print("ERROR", type(e).__name__, e)
    except MemoryError as e:
        print("MEMORY", e)
    else:
        print("OK")
    print("GROWTH", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """
)


def _open_in_subprocess(uri: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _BOMB, uri],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    return lines[0], int(lines[1].split()[1])


def _ipc(table: pa.Table, compression: str | None = "zstd") -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _catalog_table(frags: list[Fragment]) -> pa.Table:
    """The rows as one Arrow table (a v1 catalog's file: v1 catalogs keep loading, and
    each section of a v2 catalog is decoded by the same checks)."""
    return pa.ipc.open_file(pa.BufferReader(Catalog(frags).to_arrow_v1())).read_all()


def test_a_compressed_bomb_is_refused_before_decompressing(tmp_path):
    """One extra column (readers ignore unknown columns) of 256 MiB of zeros
    compresses to a few KiB with zstd; the catalog's CRC in the manifest is right.
    (LZ4 frames expand at most about 255x, which the budget already allows.)"""
    uri, frag, _data = _saved(tmp_path)
    table = _catalog_table([frag])
    junk = pa.array([np.zeros(256 << 20, np.uint8).tobytes()], type=pa.large_binary())
    data = _ipc(table.append_column("junk", junk), "zstd")
    del junk
    assert len(data) < 2 << 20
    _replace_catalog(uri, data)
    result, growth = _open_in_subprocess(uri)
    assert result.startswith("ERROR FormatError") and "fragments.arrow" in result, result
    assert "decode to more than" in result, result
    assert growth < 64 << 20, growth


def test_a_dictionary_bomb_is_refused_before_expanding(tmp_path):
    """One 1 MiB key path, repeated by 4,096 rows through a dictionary: 4 GiB once
    decoded to one string per row (what casting to the catalog's types did)."""
    uri, frag, data = _saved(tmp_path)
    table = _catalog_table([frag] * 4096)
    long = pa.array(['[["d","w"]]' + " " * (1 << 20)])
    key_path = pa.DictionaryArray.from_arrays(pa.array(np.zeros(4096, np.int32)), long)
    table = table.set_column(table.schema.get_field_index("key_path"), "key_path", key_path)
    data = _ipc(table)
    assert len(data) < 1 << 20
    _replace_catalog(uri, data)
    result, growth = _open_in_subprocess(uri)
    assert result.startswith("ERROR FormatError") and "fragments.arrow" in result, result
    assert "expand to more than" in result, result
    assert growth < 64 << 20, growth


def test_an_ordinary_catalog_is_far_below_the_budget():
    frags = fsdp_catalog_rows()
    data = Catalog(frags).to_arrow_v1()
    assert catalog_mod.check_ipc_budget(data, where="t", budget=catalog_mod.DECODE_RATIO * len(data) // 8) > 0
    assert len(Catalog.from_arrow(data, where="t", checksum_block_bytes=BLOCK)) == len(frags)
    data = Catalog(frags).to_arrow()  # v2: every section is far below its budget too
    assert len(Catalog.from_arrow(data, where="t", checksum_block_bytes=BLOCK)) == len(frags)


# -- 9: declared sizes are checked before allocation ----------------------------------------


def test_a_fragment_outside_its_declared_file_is_refused_at_open(tmp_path):
    uri, frag, _data = _saved(tmp_path)
    _replace_catalog(uri, Catalog([dataclasses.replace(frag, byte_offset=frag.byte_offset + 4096)]).to_arrow())
    with pytest.raises(FormatError, match=r"row 0 \('w'\): bytes \[4096, 4128\) lie outside data file .*holds 32"):
        bcp.open(uri)


def test_a_fragment_in_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    uri, frag, _data = _saved(tmp_path)
    _replace_catalog(uri, Catalog([dataclasses.replace(frag, file="elsewhere.bin")]).to_arrow())
    with pytest.raises(FormatError, match=r"'elsewhere.bin' is not among the manifest's data files"):
        bcp.open(uri)


def test_a_small_checkpoint_declaring_2_gib_allocates_nothing(tmp_path, monkeypatch):
    """The 12 KiB checkpoint of the issue: manifest and catalog declare 2 GiB of data in
    a file that holds 32 bytes; a load into a fresh optimizer state (no tensors in the
    template) must fail before allocating or reading, naming the file."""
    uri, frag, _data = _saved(tmp_path, nested=True)
    big = 1 << 29  # float32 elements: 2 GiB
    m = _manifest(uri)
    declared = tuple(dataclasses.replace(f, nbytes=big * 4) if f.path == frag.file else f for f in m.data_files)
    huge = dataclasses.replace(
        frag, global_shape=(big,), lengths=(big,), nbytes=big * 4, checksums=(0,) * (big * 4 // BLOCK)
    )
    _replace_catalog(uri, Catalog([huge]).to_arrow(), data_files=declared)
    allocated: list[tuple] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        shape = args[0] if len(args) == 1 else args
        if isinstance(shape, (tuple, list, torch.Size)) and math.prod(shape) >= big:
            allocated.append(tuple(shape))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(CorruptCheckpointError, match=r"holds 32 bytes; the manifest says 2147483648") as e:
        bcp.load({"state": {}}, uri)  # a fresh optimizer's empty state: the stored subtree is allocated
    assert e.value.file == frag.file
    assert allocated == []
    with pytest.raises(CorruptCheckpointError, match="holds 32 bytes"):
        bcp.open(uri).read("state.w")
    assert allocated == []


def test_storage_sizes_are_checked_once_per_file(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save({"a": torch.ones(4), "b": torch.zeros(3)}, uri)
    r = bcp.open(uri)
    calls: list[str] = []
    real = r.backend.size
    r.backend.size = lambda key: calls.append(key) or real(key)  # type: ignore[method-assign]
    r.read("a"), r.read("b"), r.read("a", box=((1,), (2,)))
    assert len(calls) == len(set(calls)) == 1


# -- 13: malformed rows raise FormatError ---------------------------------------------------


def _row(**changes) -> Fragment:
    good = Fragment("w", '[["d","w"]]', "float32", (4, 4), (0, 0), (4, 4), "f.bin", 0, 64, (1,))
    return dataclasses.replace(good, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # 2**32 * 2**32 elements wrap to 0 in int64: nbytes 0 and no checksums looked right
        ({"global_shape": (1 << 32, 1 << 32), "lengths": (1 << 32, 1 << 32), "nbytes": 0, "checksums": ()}, "larger"),
        # offset + length wraps negative, which is below the size
        ({"global_shape": (1 << 62, 4), "offsets": ((1 << 63) - 2, 0), "lengths": (4, 4)}, "outside size"),
        ({"global_shape": (1 << 61, 4), "lengths": (1 << 61, 4), "nbytes": 0, "checksums": ()}, "larger"),
        # no element, so every size looked small, but torch's strides overflow (a raw RuntimeError)
        (
            {
                "global_shape": (0, 1 << 62, 1 << 62),
                "offsets": (0,) * 3,
                "lengths": (0,) * 3,
                "nbytes": 0,
                "checksums": (),
            },
            "larger",
        ),
    ],
)
def test_int64_overflow_in_rows_is_refused(changes, message):
    data = Catalog([_row(**changes)]).to_arrow_v1()
    with pytest.raises(FormatError, match=message):
        Catalog.from_arrow(data, where="cat", checksum_block_bytes=BLOCK)
    # v2: the head's tensor table or the section's rows refuse it
    with pytest.raises(FormatError, match=f"{message}|larger than"):
        Catalog.from_arrow(Catalog([_row(**changes)]).to_arrow(), where="cat", checksum_block_bytes=BLOCK)


@pytest.mark.parametrize("block", [0, -1])
def test_a_zero_or_negative_block_size_is_a_format_error(block):
    with pytest.raises(FormatError, match="block size"):
        Catalog.from_arrow(Catalog([_row()]).to_arrow(), where="cat", checksum_block_bytes=block)


@pytest.mark.parametrize("key_path", ["not json", "[" * 100_000 + "]" * 100_000])
def test_a_bad_key_path_is_a_format_error(tmp_path, key_path):
    uri, frag, _data = _saved(tmp_path)
    _replace_catalog(uri, Catalog([dataclasses.replace(frag, key_path=key_path)]).to_arrow())
    with pytest.raises(FormatError, match=r"fragments\.arrow: key path of 'w'"):
        bcp.open(uri).key_path("w")


@settings(max_examples=examples(300), deadline=None)
@given(st.data())
def test_damaged_catalog_bytes_raise_only_format_errors(data):
    """Any byte of a catalog (plain or compressed) changed: decoding either succeeds or
    raises FormatError, never an Arrow, arithmetic or lookup error."""
    frags = [_row(offsets=(i, 0), lengths=(1, 4), nbytes=16) for i in range(4)]
    compression = data.draw(st.sampled_from([None, "zstd", "lz4"]))
    raw = bytearray(_ipc(_catalog_table(frags), compression))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        cat = Catalog.from_arrow(bytes(raw), where="cat", checksum_block_bytes=BLOCK)
        for fqn in list(cat.tensors):
            cat.tensors[fqn]
    except FormatError:
        pass


@pytest.mark.parametrize("column", ["global_shape", "offsets", "lengths", "checksums"])
def test_a_null_inside_a_rows_list_is_refused_by_load_and_verify(tmp_path, column):
    """A null element inside a row's list (the row itself not null) read as NaN in numpy,
    which every range check let through: ``bcp verify`` passed a checkpoint a load then
    refused, and a null dimension reached the loader as -2**63. All refuse it at open."""
    uri, frag, _data = _saved(tmp_path)
    table = _catalog_table([frag])
    rows = table.column(column).to_pylist()
    rows[0][0] = None
    index = table.schema.get_field_index(column)
    table = table.set_column(index, table.schema.field(index), pa.array(rows, table.schema.field(index).type))
    _replace_catalog(uri, _ipc(table, None))
    for read in (lambda: bcp.load({"w": torch.zeros(8)}, uri), lambda: verify_checkpoint(uri), lambda: bcp.open(uri)):
        with pytest.raises(FormatError, match=r"fragments\.arrow: null values in the catalog"):
            read()


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.none() | st.lists(st.none() | st.integers(0, 9), max_size=3), max_size=6),
    st.integers(0, 6),
    st.integers(0, 6),
)
def test_has_nulls_sees_a_null_at_any_depth_of_a_slice(rows, start, stop):
    """A list column sliced as a hostile file's offsets may be (not from 0): a null row
    or a null element inside a row of the slice, and only of the slice, is found."""
    array = pa.array(rows, pa.list_(pa.int64()))[start:stop]
    kept = rows[start:stop]
    want = any(r is None or None in r for r in kept)
    assert catalog_mod.arrow.has_nulls(array) is want
    assert catalog_mod.arrow.has_nulls(pa.chunked_array([array, array], array.type)) is want


@pytest.mark.parametrize(("dtype", "shape"), [("float64", ()), ("float32", (4,))])
def test_a_tensor_the_head_lists_without_rows_fails_verify_and_load(tmp_path, dtype, shape):
    """A v2 head naming a tensor no section holds a row of: a 0-d one passed verify (the
    tiling check skipped 0-d tensors) while every read of it failed."""
    from bcp.metadata.catalog.sections import encode

    uri, _frag_w, _data = _saved(tmp_path)
    cat = Catalog(list(bcp.open(uri).catalog.fragments))
    cat._table_of_tensors.add("z", '[["d","z"]]', dtype, shape)
    _replace_catalog(uri, encode(cat._table_of_tensors, cat._file_names, cat._rows))
    report = verify_checkpoint(uri)
    assert not report["ok"] and "'z'" in str(report["problems"]), report
    with pytest.raises(FormatError, match=r"'z'.*(no row holds its one element|hold 0 elements of its 4)"):
        bcp.load({"w": torch.zeros(8), "z": torch.zeros(shape, dtype=getattr(torch, dtype))}, uri)


def test_verify_reports_a_data_file_replaced_by_a_link_instead_of_raising(tmp_path):
    """verify_checkpoint raises only when the manifest or catalog cannot be opened: a
    linked data file (refused by the backend with a StorageError) is one problem line."""
    uri, frag, data = _saved(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data)
    path = tmp_path / "ck" / frag.file
    path.unlink()
    path.symlink_to(outside)
    report = verify_checkpoint(uri)
    assert not report["ok"], report
    assert any(frag.file in p and "symbolic link" in p for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("order", [1, -1])
def test_key_paths_that_disagree_on_a_containers_kind_are_a_format_error_either_way(tmp_path, order):
    """'x.0' a list item of x, 'x.1' a dict key of x: a raw TypeError from sorting mixed
    keys in one order, a dict made silently in the other."""
    uri = str(tmp_path / "ck")
    bcp.save({"x": {"a": torch.ones(2), "b": torch.zeros(3)}}, uri)
    a, b = bcp.open(uri).catalog.fragments
    rows = [
        dataclasses.replace(a, fqn="x.0", key_path='[["d","x"],["l",0]]'),
        dataclasses.replace(b, fqn="x.1", key_path='[["d","x"],["d","1"]]'),
    ][::order]
    _replace_catalog(uri, Catalog(rows).to_arrow())
    with pytest.raises(FormatError, match=r"key paths disagree on the container at 'x': a (list|dict) in one, a"):
        bcp.open(uri).state()


def test_a_gap_in_a_list_names_the_list(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save({"x": {"a": torch.ones(2)}}, uri)
    (a,) = bcp.open(uri).catalog.fragments
    _replace_catalog(uri, Catalog([dataclasses.replace(a, fqn="x.5", key_path='[["d","x"],["l",5]]')]).to_arrow())
    with pytest.raises(FormatError, match=r"'x': list entries with indices 5 are not contiguous from 0"):
        bcp.open(uri).state()


def test_rows_of_one_tensor_aliasing_one_block_are_refused_before_allocating(tmp_path):
    """Every row of a [4, 8] tensor over the same 32 bytes (checksums right, each row in
    its file): a read allocated the whole declared tensor (8 GiB from a 1 MiB file at 8,192
    rows). Refused at open, naming both rows; tied tensors (other keys) may share bytes."""
    uri, frag, data = _saved(tmp_path)
    rows = [dataclasses.replace(_frag(frag, data, (i, 0), (1, 8), 0), global_shape=(4, 8), fqn="w") for i in range(4)]
    tied = dataclasses.replace(frag, fqn="v", key_path='[["d","v"]]')
    _replace_catalog(uri, Catalog([*rows, tied]).to_arrow())
    with pytest.raises(FormatError, match=r"rows \d and \d \('w'\): two boxes of one tensor stored in the same bytes"):
        bcp.open(uri).read("w")
    _replace_catalog(uri, Catalog([frag, tied]).to_arrow())
    assert torch.equal(bcp.open(uri).read("v"), bcp.open(uri).read("w")), "tied keys sharing bytes still load"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 40), st.integers(0, 9), st.integers(0, 1)),
        max_size=12,
    )
)
def test_the_disjoint_rows_check_agrees_with_comparing_every_pair(rows):
    """(tensor, file, offset, nbytes, box) rows: refused exactly when two non-empty rows of
    one tensor in one file overlap, unless they are the same row again (a replica of one
    box at the same bytes)."""
    from bcp.metadata.catalog.validate import _check_rows_disjoint

    cols = [np.array(c, np.int64) for c in zip(*rows, strict=True)] if rows else [np.zeros(0, np.int64)] * 5
    fake = type(
        "R",
        (),
        {
            "tensor": cols[0],
            "file": cols[1],
            "byte_offset": cols[2],
            "nbytes": cols[3],
            "coord_starts": np.arange(len(rows) + 1, dtype=np.int64),
            "offsets": cols[4],
            "lengths": np.ones(len(rows), np.int64),
        },
    )()
    names = type("T", (), {"names": ["a", "b", "c"]})()

    def clash(a, b):
        same = a[2:] == b[2:]
        return a[:2] == b[:2] and a[3] and b[3] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3] and not same

    expect = any(clash(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :])
    try:
        _check_rows_disjoint(fake, names, ["f0", "f1"], where="cat")  # type: ignore[arg-type]
        refused = False
    except FormatError:
        refused = True
    assert refused == expect


def test_tied_keys_read_without_a_template_come_back_as_one_tensor(tmp_path):
    """A saved tie (two keys, one storage) is stored once and read back as one tensor, as
    torch.load gives it: 10,000 tied keys allocate one tensor, not 10,000."""
    uri = str(tmp_path / "ck")
    w, other = torch.randn(4, 8), torch.randn(3)
    bcp.save({"embed": w, "head": w, "other": other}, uri)
    state = bcp.open(uri).state()
    assert state["embed"] is state["head"] and torch.equal(state["embed"], w)
    assert state["other"] is not state["embed"] and torch.equal(state["other"], other)
    (frag,) = bcp.open(uri).meta("embed").fragments
    many = [dataclasses.replace(frag, fqn=f"k{i}", key_path=f'[["d","k{i}"]]') for i in range(10_000)]
    _replace_catalog(uri, Catalog(many).to_arrow())
    got = bcp.open(uri).read_tensors([f"k{i}" for i in range(10_000)])
    assert len({id(t) for t in got.values()}) == 1 and torch.equal(got["k9999"], w)


@pytest.mark.parametrize(
    "change",
    [
        {"global_shape": (32,), "offsets": (0,), "lengths": (32,)},  # the same bytes as another shape
        {"dtype": "int32"},  # ... as another dtype
        {"byte_offset": 4, "nbytes": 64, "global_shape": (16,), "offsets": (0,), "lengths": (16,)},  # shifted
    ],
)
def test_keys_that_share_bytes_without_being_tied_are_refused_before_allocating(tmp_path, change):
    """Rows of other keys over the same bytes (or over part of them) that are not one tied
    tensor declare more memory than the files hold (10,000 keys over one tensor's bytes,
    each shifted or reshaped): a read without a template refuses them, naming both keys."""
    uri, frag, data = _saved(tmp_path)
    w = torch.randn(4, 8)
    bcp.save({"w": w}, uri, overwrite=True)
    (frag,) = bcp.open(uri).meta("w").fragments
    data = backend_for(uri).read(frag.file)
    other = dataclasses.replace(frag, fqn="v", key_path='[["d","v"]]', **change)
    other = dataclasses.replace(
        other, checksums=tuple(block_checksums(data[other.byte_offset : other.byte_offset + other.nbytes], BLOCK))
    )
    _replace_catalog(uri, Catalog([frag, other]).to_arrow())
    with pytest.raises(FormatError, match=r"'w' and 'v' share bytes of .* without being one tied tensor"):
        bcp.open(uri).state()
    assert torch.equal(bcp.open(uri).read_tensors(["w"])["w"], w), "either alone is still read"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 30), st.integers(0, 8)),
        max_size=10,
    )
)
def test_tied_entries_agree_with_comparing_every_pair(rows):
    """(tensor, file, byte offset, nbytes) rows, box = its byte offset: two tensors are tied
    exactly when their non-empty rows are the same set; refused when two distinct non-empty
    ranges overlap (one tensor's too: refused at open anyway) or untied tensors share one."""
    from bcp.metadata.rows import TensorEntry
    from bcp.metadata.ties import tied_entries

    def entry(t: int) -> TensorEntry:
        mine = [r for r in rows if r[0] == t]
        col = [np.array([r[k] for r in mine], np.int64) for k in range(4)]
        return TensorEntry(
            f"t{t}", f'[["d","t{t}"]]', "uint8", (64,),
            offsets=col[2].reshape(-1, 1), lengths=col[3].reshape(-1, 1), byte_offsets=col[2], sizes=col[3],
            files=col[1].astype(np.int32), file_names=("f0", "f1"), writer_ranks=np.zeros(len(mine), np.int32),
            checksum_starts=np.zeros(len(mine) + 1, np.int64), checksum_values=np.zeros(0, np.uint32),
        )  # fmt: skip

    entries = [entry(t) for t in range(4)]
    held = [{r[1:] for r in rows if r[0] == t and r[3]} for t in range(4)]

    def overlap(x, y):
        return x[0] == y[0] and x[1] < y[1] + y[2] and y[1] < x[1] + x[2]

    ranges = set().union(*held)
    crossing = any(overlap(x, y) for x in ranges for y in ranges if x != y)  # of any rows (one tensor's too)
    untied = any(held[a] & held[b] and held[a] != held[b] for a in range(4) for b in range(a + 1, 4))
    refused = crossing or untied
    try:
        tied = tied_entries(entries)
    except FormatError:
        assert refused
        return
    assert not refused
    for b in range(4):
        first = next((a for a in range(b) if held[a] and held[a] == held[b]), None)
        assert tied.get(b) == first, (b, tied, held)


def test_read_tensors_of_a_key_asked_twice_gives_it_once(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save({"a": torch.arange(4.0), "b": torch.ones(2)}, uri)
    got = bcp.open(uri).read_tensors(["a", "b", "a"])
    assert list(got) == ["a", "b"] and torch.equal(got["a"], torch.arange(4.0))
