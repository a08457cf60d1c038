"""fragments.arrow: round trips and row validation."""

from __future__ import annotations

import gc
import math
import weakref

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bcp.metadata import CATALOG_SCHEMA, Catalog, FormatError, Fragment, itemsize
from helpers import fsdp_catalog_rows

BLOCK = 1024


@st.composite
def fragments(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
    offs = tuple(draw(st.integers(0, s)) for s in shape)
    lens = tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, offs, strict=True))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int8", "complex128", "bool"]))
    nbytes = math.prod(lens) * itemsize(dtype)
    sums = tuple(draw(st.integers(0, 2**32 - 1)) for _ in range(-(-nbytes // BLOCK)))
    return Fragment(
        fqn=draw(st.text(min_size=1, max_size=6)),
        key_path='[["d","x"]]',
        dtype=dtype,
        global_shape=shape,
        offsets=offs,
        lengths=lens,
        file=draw(st.sampled_from(["a.bin", "gen-1/data/ränk.bin"])),
        byte_offset=draw(st.integers(0, 2**40)),
        nbytes=nbytes,
        checksums=sums,
        writer_rank=draw(st.integers(0, 4095)),
    )


@given(st.lists(fragments(), max_size=12))
def test_catalog_round_trip(frags):
    # one dtype/shape per fqn, as the writer guarantees
    first = {}
    frags = [f for f in frags if first.setdefault(f.fqn, (f.dtype, f.global_shape)) == (f.dtype, f.global_shape)]
    back = Catalog.from_arrow(Catalog(frags).to_arrow(), where="t", checksum_block_bytes=BLOCK)
    # tensors in order of first appearance; each tensor's rows by writer (sections are
    # runs of writers), in the given order within a writer
    rank = {}
    for f in frags:
        rank.setdefault(f.fqn, len(rank))
    assert back.fragments == sorted(frags, key=lambda f: (rank[f.fqn], f.writer_rank))
    v1 = Catalog.from_arrow(Catalog(frags).to_arrow_v1(), where="t", checksum_block_bytes=BLOCK)
    assert v1.fragments == sorted(frags, key=lambda f: rank[f.fqn])
    assert list(back.tensors) == list(rank)
    for fqn, entry in Catalog(frags).tensors.items():  # random rows need not tile: no decoded entries here
        mine = [f for f in frags if f.fqn == fqn]
        assert entry.fragments == tuple(mine)
        assert [entry.fragment(i) for i in range(entry.num_fragments)] == mine
        assert entry.offsets.shape == entry.lengths.shape == (len(mine), len(mine[0].global_shape))
        assert entry.offsets.tolist() == [list(f.offsets) for f in mine]
        assert entry.sizes.tolist() == [f.nbytes for f in mine]
        assert [entry.file_names[c] for c in entry.files.tolist()] == [f.file for f in mine]
        assert entry.writer_ranks.tolist() == [f.writer_rank for f in mine]


@given(st.lists(fragments(), max_size=6), st.booleans())
def test_a_catalog_is_freed_without_the_collector(frags, v1):
    """No reference cycle: a catalog (and its rows, one shape tuple a tensor) goes as
    soon as its last user lets go, its ``tensors`` view included. Failed before: the
    catalog held the view, which held the catalog's bound method."""
    first = {}
    frags = [f for f in frags if first.setdefault(f.fqn, (f.dtype, f.global_shape)) == (f.dtype, f.global_shape)]
    data = Catalog(frags).to_arrow_v1() if v1 else Catalog(frags).to_arrow()
    gc.disable()
    try:
        catalog = Catalog.from_arrow(data, where="t", checksum_block_bytes=BLOCK)
        view = catalog.tensors
        assert list(view) == list(first)
        gone = weakref.ref(catalog)
        del catalog
        assert gone() is not None  # the view in hand keeps it
        del view
        assert gone() is None
    finally:
        gc.enable()


def _one(**changes) -> bytes:
    good = {
        "fqn": "w",
        "key_path": '[["d","w"]]',
        "dtype": "float32",
        "global_shape": (4, 4),
        "offsets": (0, 0),
        "lengths": (2, 4),
        "file": "f.bin",
        "byte_offset": 0,
        "nbytes": 32,
        "checksums": (1,),
        "writer_rank": 0,
    }
    good.update(changes)
    cols = {k: [list(v) if isinstance(v, tuple) else v] for k, v in good.items()}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, CATALOG_SCHEMA) as w:
        w.write_table(pa.table(cols, schema=CATALOG_SCHEMA))
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"offsets": (3, 0)}, r"dim 0 box \[3, 5\) is outside size 4"),
        ({"lengths": (2,)}, "box has 2/1 dims, tensor has 2"),
        ({"nbytes": 31}, "nbytes 31 does not match box"),
        ({"checksums": (1, 2)}, "2 checksums for 1 blocks"),
        ({"dtype": "float12"}, "unknown dtype 'float12'"),
        ({"byte_offset": -5}, "negative byte offset"),
    ],
)
def test_bad_rows_are_rejected_naming_the_row(changes, message):
    with pytest.raises(FormatError, match=r"cat row 0 \('w'\).*" + message):
        Catalog.from_arrow(_one(**changes), where="cat", checksum_block_bytes=BLOCK)


def test_missing_column_and_garbage_are_format_errors():
    table = pa.ipc.open_file(pa.BufferReader(_one())).read_all().drop_columns(["checksums"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(FormatError, match="missing column"):
        Catalog.from_arrow(sink.getvalue().to_pybytes(), where="cat", checksum_block_bytes=BLOCK)
    with pytest.raises(FormatError, match="not a readable Arrow IPC file"):
        Catalog.from_arrow(b"nonsense", where="cat", checksum_block_bytes=BLOCK)


def test_catalog_is_compact():
    frags = fsdp_catalog_rows()
    size = len(Catalog(frags).to_arrow())
    assert size / len(frags) < 40, f"{size / len(frags):.1f} bytes per fragment"
