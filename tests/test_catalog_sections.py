"""Catalog v2: sections per run of writers, a head with a span index, and ranks that
read only the sections their boxes need.

The property that matters: a catalog read in part, after ``require(boxes)``, holds
every fragment row of the whole catalog that meets one of the boxes (so a load from
it reads exactly what a load from the whole catalog reads), on random layouts:
uneven and empty shards, replicas, dim-1 and 2-D sharding, 0-d and 1-d tensors.
Then hostile heads and sections: every lie is a FormatError or, for a span index that
hides a section, a load that fails naming the tensor instead of filling garbage.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
import bcp.reader
from bcp.backends import backend_for
from bcp.errors import CorruptCheckpointError
from bcp.metadata import Catalog, FileEntry, FormatError, Fragment, block_checksums, crc32c
from bcp.metadata.catalog import sections
from bcp.metadata.catalog.head import decode_head
from bcp.metadata.keys import MANIFEST_KEY, data_file_key, generation_name
from bcp.shards import TensorShard
from helpers import commit_hand_made, examples

BLOCK = 64
DTYPE = torch.float32
ITEM = 4


# -- layouts ---------------------------------------------------------------------------------


def _cuts(draw, n: int, parts: int) -> list[int]:
    inner = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    return [0, *inner, n]


@st.composite
def layouts(draw) -> list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """Tensors, each with the boxes its fragments hold: a grid over 0-2 cut
    dimensions (uneven, possibly empty cells), with some boxes replicated."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        dims = draw(st.lists(st.integers(0, max(len(shape) - 1, 0)), max_size=2, unique=True)) if shape else []
        cells: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
        for d, size in enumerate(shape):
            c = _cuts(draw, size, draw(st.integers(1, 4))) if d in dims else [0, size]
            cells = [((*o, c[i]), (*n, c[i + 1] - c[i])) for o, n in cells for i in range(len(c) - 1)]
        boxes = [b for b in cells for _ in range(draw(st.integers(1, 2)))]  # replicas
        out.append((shape, boxes))
    return out


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=DTYPE).reshape(shape) + 1000 * seed


def _fragments(layout, writers: int, seed: int = 0) -> tuple[list[Fragment], dict[str, bytes]]:
    """Fragment rows and data files for ``layout`` written by ``writers`` simulated
    ranks (boxes dealt round-robin; each writer's file in save order)."""
    files: dict[int, bytearray] = {w: bytearray() for w in range(writers)}
    frags = []
    deal = itertools.count()
    for t, (shape, boxes) in enumerate(layout):
        full = _values(shape, t + seed)
        for off, ln in boxes:
            w = next(deal) % writers
            part = full[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))].contiguous()
            data = part.numpy().tobytes()
            name = f"gen-x/data/rank{w:05d}-0.bin"
            frags.append(
                Fragment(
                    f"t{t}",
                    json.dumps([["d", f"t{t}"]]),
                    "float32",
                    shape,
                    off,
                    ln,
                    name,
                    len(files[w]),
                    len(data),
                    tuple(block_checksums(data, BLOCK)),
                    w,
                )
            )
            files[w] += data
    used = {f.writer_rank for f in frags}
    return frags, {f"gen-x/data/rank{w:05d}-0.bin": bytes(b) for w, b in files.items() if w in used}


def _boxes_meet(a_off, a_len, b_off, b_len) -> bool:
    return all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a_off, a_len, b_off, b_len, strict=True))


def _partial(data: bytes, tail_bytes: int | None = None) -> tuple[Catalog, list[tuple[int, int]]]:
    fetched: list[tuple[int, int]] = []

    def fetch(offset: int, length: int) -> bytes:
        fetched.append((offset, length))
        return data[offset : offset + length]

    need = tail_bytes or Catalog.tail_bytes(len(data), data[-sections.TRAILER.size :])
    cat = Catalog.from_head(
        data[len(data) - need :], file_size=len(data), fetch=fetch, where="cat", checksum_block_bytes=BLOCK
    )
    return cat, fetched


@pytest.fixture
def small_sections(monkeypatch):
    """Sections of a few rows, so that small test catalogs have many."""
    monkeypatch.setattr(sections, "MIN_SECTION_ROWS", 1)


# -- the format ------------------------------------------------------------------------------


def test_section_count_rule():
    assert sections.section_count(100, 64) == 1  # a small save: one section
    assert sections.section_count(2_048_000, 1024) == 45  # ~ sqrt(2 x writers)
    assert sections.section_count(5_000, 1024) == 1  # at least MIN_SECTION_ROWS rows each
    assert sections.section_count(65_536_000, 16_384) == 181
    assert sections.section_count(10**6, 1) == 1


def test_layout_sections_head_and_trailer(small_sections):
    layout = [((64, 8), [((i * 4, 0), (4, 8)) for i in range(16)]), ((), [((), ())] * 16)]
    frags, _files = _fragments(layout, 16)
    data = Catalog(frags).to_arrow()
    head_offset, crc = sections.read_trailer(data, len(data), "cat")
    head = decode_head(data[head_offset : -sections.TRAILER.size], head_offset, crc, where="c", budget=1 << 30)
    assert head.sections == sections.section_count(len(frags), 16) == round(math.sqrt(32))
    # sections fill the file up to the head, in order; each is an Arrow IPC file of its writers' rows
    assert head.sec_offset[0] == 0 and head.sec_offset[-1] + head.sec_length[-1] == head_offset
    assert head.sec_rows.sum() == len(frags)
    assert (head.sec_last_writer[:-1] < head.sec_first_writer[1:]).all()
    for k in range(head.sections):
        sec = data[head.sec_offset[k] : head.sec_offset[k] + head.sec_length[k]]
        assert sec[:6] == b"ARROW1" and sec[-6:] == b"ARROW1" and crc32c(sec) == head.sec_crc[k]
        t, lo, hi = head.spans_of(k)
        writers = range(head.sec_first_writer[k], head.sec_last_writer[k] + 1)
        assert t.tolist() == [0, 1]  # both tensors have rows of every writer run
        rows = [f for f in frags if f.writer_rank in writers and f.fqn == "t0"]
        assert lo[0] == min(f.offsets[0] for f in rows) * 8
        assert hi[0] == max(f.offsets[0] + 3 for f in rows) * 8 + 7
        assert (lo[1], hi[1]) == (0, 0)  # a 0-d tensor: element 0
    assert head.tensors.names == ["t0", "t1"] and head.tensors.shapes == [(64, 8), ()]
    assert Catalog(frags).to_arrow() == data, "encoding is deterministic"


def test_a_writer_given_malformed_rows_still_encodes_them_for_readers_to_refuse():
    good = _fsdp(2)[0]
    bad = dataclasses.replace(good, offsets=(0,), lengths=(4,))  # 1 dimension of a 2-d tensor
    data = Catalog([good, bad]).to_arrow()
    with pytest.raises(FormatError, match="dims"):
        Catalog.from_arrow(data, where="cat", checksum_block_bytes=BLOCK)


def test_v1_catalogs_keep_loading_and_v2_is_what_is_written():
    frags, _files = _fragments([((8, 2), [((0, 0), (4, 2)), ((4, 0), (4, 2))])], 2)
    v1, v2 = Catalog(frags).to_arrow_v1(), Catalog(frags).to_arrow()
    assert v1[-6:] == b"ARROW1" and v2[-8:] == sections.MAGIC
    for data in (v1, v2):
        cat = Catalog.from_arrow(data, where="cat", checksum_block_bytes=BLOCK)
        assert cat.fragments == frags and cat.is_whole


# -- partial reads agree with whole reads ---------------------------------------------------


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(1, 9), st.data())
def test_a_partial_catalog_holds_every_row_a_box_meets(small, writers, data):
    sections.MIN_SECTION_ROWS, saved = 1, sections.MIN_SECTION_ROWS
    try:
        frags, _files = _fragments(small, writers)
        raw = Catalog(frags).to_arrow()
    finally:
        sections.MIN_SECTION_ROWS = saved
    whole = Catalog.from_arrow(raw, where="cat", checksum_block_bytes=BLOCK)
    part, fetched = _partial(raw)
    assert len(part) == 0 and not fetched
    # wanted boxes: a random grid of one tensor (a resharded rank), plus random boxes
    wanted = []
    for t, (shape, _boxes) in enumerate(small):
        if not data.draw(st.booleans()):
            continue
        off = tuple(data.draw(st.integers(0, s)) for s in shape)
        ln = tuple(data.draw(st.integers(0, s - o)) for s, o in zip(shape, off, strict=True))
        wanted.append((f"t{t}", (off, ln)))
    part.require(wanted)
    held, total = part.sections_held
    assert held <= total and len(fetched) <= held
    for fqn, (off, ln) in wanted:
        if math.prod(ln) == 0:
            continue
        need = {f for f in whole.tensors[fqn].fragments if _boxes_meet(off, ln, f.offsets, f.lengths)}
        got = set(part.tensors[fqn].fragments)
        assert need <= got <= set(whole.tensors[fqn].fragments)
    part.require_all()
    assert part.is_whole and sorted(part.fragments, key=repr) == sorted(whole.fragments, key=repr)
    for fqn in whole.tensors:
        a, b = part.tensors[fqn], whole.tensors[fqn]
        assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.byte_offsets, b.byte_offsets)


def test_a_rank_reads_only_the_sections_of_its_boxes(small_sections):
    """FSDP-like: 64 writers each hold rows 4w..4w+3 of every tensor; a rank wanting
    one writer's rows reads one section, and the catalog bytes it reads are a small
    part of the file."""
    layout = [((256, 16), [((w * 4, 0), (4, 16)) for w in range(64)]) for _ in range(8)]
    frags, _files = _fragments(layout, 64)
    raw = Catalog(frags).to_arrow()
    part, fetched = _partial(raw)
    part.require([(f"t{t}", ((40, 0), (4, 16))) for t in range(8)])
    assert part.sections_held == (1, sections.section_count(len(frags), 64))
    assert sum(n for _o, n in fetched) < len(raw) / 5
    # resharded to 48 ranks: a box across two writers' rows reads at most two sections
    part2, _ = _partial(raw)
    part2.require([(f"t{t}", ((5 * 256 // 48, 0), (256 // 48, 16))) for t in range(8)])
    assert part2.sections_held[0] <= 2


# -- loads through the partial path ------------------------------------------------------


def _write_checkpoint(root: pathlib.Path, layout, writers: int) -> str:
    """A committed checkpoint of ``layout`` written by ``writers`` simulated ranks."""
    uri = str(root)
    backend = backend_for(uri)
    frags, files = _fragments(layout, writers)
    gen = generation_name("0" * 24)
    frags = [_in_gen(f, gen) for f in frags]
    entries = []
    for name, data in files.items():
        key = data_file_key(gen, int(name.rsplit("rank", 1)[1][:5]))  # the writer's rank
        backend.write(key, data)
        entries.append(FileEntry(key, len(data), _digest(data)))
    commit_hand_made(backend, gen, frags, entries, writers=writers, block=BLOCK)
    return uri


def _in_gen(f: Fragment, gen: str) -> Fragment:
    return dataclasses.replace(f, file=data_file_key(gen, f.writer_rank))


def _digest(data: bytes) -> int:
    from bcp.metadata import digest_of_checksums

    return digest_of_checksums(block_checksums(data, BLOCK))


def _shard_state(layout, box_of) -> dict:
    """A template holding, for each tensor, the box ``box_of(shape)`` as a TensorShard."""
    state = {}
    for t, (shape, _boxes) in enumerate(layout):
        off, ln = box_of(shape)
        state[f"t{t}"] = TensorShard(torch.full(ln, -1.0, dtype=DTYPE), shape, off)
    return state


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts(), st.integers(1, 6), st.integers(1, 5), st.data())
def test_partial_fetch_loads_exactly_what_a_whole_fetch_loads(
    tmp_path_factory, monkeypatch, small, writers, ranks, data
):
    """A checkpoint of a random layout, loaded by ``ranks`` resharded ranks (each a
    grid cell along a random dimension), through the partial path and the whole path."""
    monkeypatch.setattr(sections, "MIN_SECTION_ROWS", 1)
    uri = _write_checkpoint(tmp_path_factory.mktemp("ck"), small, writers)
    d = data.draw(st.integers(0, 2))
    for rank in range(ranks):

        def box_of(shape, rank=rank):
            if not shape:
                return (), ()
            k = d % len(shape)
            c = [shape[k] * i // ranks for i in range(ranks + 1)]
            off = tuple(c[rank] if i == k else 0 for i in range(len(shape)))
            ln = tuple(c[rank + 1] - c[rank] if i == k else s for i, s in enumerate(shape))
            return off, ln

        loaded = {}
        for limit in (0, 1 << 30):  # partial, whole
            monkeypatch.setattr(bcp.reader, "WHOLE_CATALOG_BYTES", limit)
            state = _shard_state(small, box_of)
            bcp.load(state, uri)
            loaded[limit] = {k: v.local.clone() for k, v in state.items()}
        for t, (shape, _boxes) in enumerate(small):
            off, ln = box_of(shape)
            want = _values(shape, t)[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))]
            assert torch.equal(loaded[0][f"t{t}"], want) and torch.equal(loaded[1 << 30][f"t{t}"], want)


def test_the_coordinator_shares_only_the_head_of_a_large_catalog(tmp_path, monkeypatch, small_sections):
    layout = [((256, 4), [((w * 4, 0), (4, 4)) for w in range(64)]) for _ in range(4)]
    uri = _write_checkpoint(tmp_path, layout, 64)
    monkeypatch.setattr(bcp.reader, "WHOLE_CATALOG_BYTES", 0)
    monkeypatch.setattr(bcp.reader, "TAIL_GUESS_BYTES", 64)  # the head takes a second read
    metadata = bcp.reader.fetch_metadata(backend_for(uri), allow_head_only=True)
    size = json.loads(metadata.manifest)["catalog"]["nbytes"]
    tail = metadata.catalog
    assert metadata.head_only and len(tail) < size and tail[-8:] == sections.MAGIC
    whole = bcp.reader.fetch_metadata(backend_for(uri))  # bcp.open's: the whole catalog
    assert not whole.head_only and len(whole.catalog) == size and whole.catalog.endswith(tail)
    reader = bcp.reader.open_reader(backend_for(uri), metadata)
    assert reader.catalog.sections_held[0] == 0 and len(reader.catalog) == 0
    state = {f"t{t}": TensorShard(torch.zeros(4, 4), (256, 4), (100, 0)) for t in range(4)}
    info = bcp.load_with_info(state, uri)
    assert all(torch.equal(v.local, _values((256, 4), t)[100:104]) for t, v in enumerate(info.state.values()))


# -- hostile heads and sections ---------------------------------------------------------------


def _parts(data: bytes):
    head_offset, crc = sections.read_trailer(data, len(data), "c")
    head = decode_head(data[head_offset : -sections.TRAILER.size], head_offset, crc, where="c", budget=1 << 30)
    return head_offset, head


def _with_head(data: bytes, head, **changes) -> bytes:
    """The catalog with its head rebuilt from ``head`` (fields replaced by ``changes``)
    and re-sealed: a head that lies but passes its CRC32C."""
    fields = {**vars(head), **changes}
    table = list(
        zip(*[fields[k].tolist() for k in ("sec_offset", "sec_length", "sec_crc", "sec_rows", "sec_first_writer",
                                            "sec_last_writer")], strict=True)
    )  # fmt: skip
    spans = [(fields["span_section"], fields["span_tensor"], fields["span_first"], fields["span_last"])]
    new_head = sections.encode_head(head.tensors, table, spans)
    body = data[: head.head_offset]
    return body + new_head + sections.TRAILER.pack(len(new_head), crc32c(new_head), 0, sections.MAGIC)


def _fsdp(writers: int = 16):
    layout = [((writers * 4, 4), [((w * 4, 0), (4, 4)) for w in range(writers)]) for _ in range(3)]
    frags, _ = _fragments(layout, writers)
    return frags


def test_a_corrupt_section_is_refused(small_sections):
    data = bytearray(Catalog(_fsdp()).to_arrow())
    _off, head = _parts(bytes(data))
    data[int(head.sec_offset[1]) + 40] ^= 0xFF
    part, _ = _partial(bytes(data))
    part.require([("t0", ((0, 0), (4, 4)))])  # section 0: fine
    with pytest.raises(FormatError, match=r"section 1\).*CRC32C"):
        part.require([("t0", ((int(head.sec_first_writer[1]) * 4, 0), (4, 4)))])
    with pytest.raises(FormatError, match="CRC32C"):
        Catalog.from_arrow(bytes(data), where="cat", checksum_block_bytes=BLOCK)


def test_a_span_index_that_disagrees_with_its_section_is_refused_when_read(small_sections):
    data = Catalog(_fsdp()).to_arrow()
    _off, head = _parts(data)
    first = head.span_first.copy()
    first[0] += 4  # section 0, tensor 0: claims to start later than its rows do
    lying = _with_head(data, head, span_first=first)
    part, _ = _partial(lying)
    with pytest.raises(FormatError, match="span index does not match"):
        part.require([("t0", ((0, 0), (64, 4)))])
    with pytest.raises(FormatError, match="span index does not match"):
        Catalog.from_arrow(lying, where="cat", checksum_block_bytes=BLOCK)


def test_a_span_index_hiding_a_section_fails_the_load_instead_of_filling_garbage(tmp_path, monkeypatch):
    """The span index says section 1 holds nothing of t0 near rows 16..19; a rank
    wanting those rows skips it, and its load must fail naming the tensor."""
    monkeypatch.setattr(sections, "MIN_SECTION_ROWS", 1)
    layout = [((64, 4), [((w * 4, 0), (4, 4)) for w in range(16)])]
    uri = _write_checkpoint(tmp_path, layout, 16)
    path = next(pathlib.Path(uri).glob("gen-*/fragments.arrow"))
    data = path.read_bytes()
    _off, head = _parts(data)
    k = int(np.flatnonzero((head.sec_first_writer <= 4) & (head.sec_last_writer >= 4))[0])
    first, last = head.span_first.copy(), head.span_last.copy()
    first[k], last[k] = 0, 0  # claims to hold only element 0
    lying = _with_head(data, head, span_first=first, span_last=last)
    path.write_bytes(lying)
    doc = json.loads((pathlib.Path(uri) / MANIFEST_KEY).read_bytes())
    doc["catalog"]["nbytes"], doc["catalog"]["crc32c"] = len(lying), crc32c(lying)
    from bcp.metadata.manifest import reseal

    (pathlib.Path(uri) / MANIFEST_KEY).write_bytes(reseal(doc))
    monkeypatch.setattr(bcp.reader, "WHOLE_CATALOG_BYTES", 0)
    state = {"t0": TensorShard(torch.zeros(4, 4), (64, 4), (16, 0))}
    with pytest.raises((CorruptCheckpointError, FormatError), match="t0"):
        bcp.load(state, uri)
    monkeypatch.setattr(bcp.reader, "WHOLE_CATALOG_BYTES", 1 << 30)
    with pytest.raises(FormatError, match="span index does not match"):
        bcp.load(state, uri)  # read whole, every section is checked against the index


@pytest.mark.parametrize(
    "damage",
    [
        "truncated head",
        "short file",
        "bad magic",
        "head crc",
        "head length too long",
        "sections overlap",
        "section outside",
        "unknown tensor in spans",
        "spans out of order",
        "span outside tensor",
        "writers out of order",
        "rows miscounted",
    ],
)
def test_a_damaged_head_is_a_format_error(damage, small_sections):
    data = Catalog(_fsdp()).to_arrow()
    head_offset, head = _parts(data)
    trailer = data[-sections.TRAILER.size :]
    if damage == "truncated head":
        bad = data[: head_offset + 10] + trailer
    elif damage == "short file":
        bad = data[-10:]
    elif damage == "bad magic":
        bad = data[:-1] + b"X"
    elif damage == "head crc":
        bad = data[: head_offset + 30] + bytes([data[head_offset + 30] ^ 1]) + data[head_offset + 31 :]
    elif damage == "head length too long":
        bad = data[: -sections.TRAILER.size] + sections.TRAILER.pack(len(data), 0, 0, sections.MAGIC)
    elif damage == "sections overlap":
        off = head.sec_offset.copy()
        off[1] -= 1
        bad = _with_head(data, head, sec_offset=off)
    elif damage == "section outside":
        ln = head.sec_length.copy()
        ln[-1] += 1000
        bad = _with_head(data, head, sec_length=ln)
    elif damage == "unknown tensor in spans":
        t = head.span_tensor.copy()
        t[-1] = 99
        bad = _with_head(data, head, span_tensor=t)
    elif damage == "spans out of order":
        bad = _with_head(data, head, span_tensor=head.span_tensor[::-1].copy(), span_section=head.span_section)
    elif damage == "span outside tensor":
        last = head.span_last.copy()
        last[0] = 10**9
        bad = _with_head(data, head, span_last=last)
    elif damage == "writers out of order":
        w = head.sec_first_writer.copy()
        w[1] = 0
        bad = _with_head(data, head, sec_first_writer=w)
    else:
        rows = head.sec_rows.copy()
        rows[0] += 1
        bad = _with_head(data, head, sec_rows=rows)
    with pytest.raises(FormatError):
        Catalog.from_arrow(bad, where="cat", checksum_block_bytes=BLOCK)
    if len(bad) >= sections.TRAILER.size:
        with pytest.raises(FormatError):
            _read_all_in_part(bad, min(len(bad), len(data) - head_offset))


def _read_all_in_part(data: bytes, tail_bytes: int) -> None:
    part, _ = _partial(data, tail_bytes=tail_bytes)
    part.require_all()


def test_a_section_whose_rows_disagree_with_the_tensor_table_is_refused(small_sections):
    frags = _fsdp(4)
    good = Catalog(frags).to_arrow()
    _off, head = _parts(good)
    # the same rows with t0 declared bfloat16 in the head's tensor table
    head.tensors.dtypes[0] = "bfloat16"
    bad = _with_head(good, head)
    with pytest.raises(FormatError, match="disagree on dtype/shape/path"):
        Catalog.from_arrow(bad, where="cat", checksum_block_bytes=BLOCK)
