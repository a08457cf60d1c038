"""The bulk path for shards wanted at their saved layout (issue 37, per-shard costs): a
wanted box that is exactly one stored fragment row, no other row meeting it, into a
dense CPU tensor of its dtype and shape, is read as a WholeRead (shard_reads.split_exact)
without a planner call; every other request (a resharded box, replicas, a cast, a
strided destination) is planned as before. Values equal the planner's on random layouts;
a flipped byte names the tensor, the file and the offset of its own row; a catalog whose
rows do not tile the tensor is refused as the planner's entry check refuses it."""

from __future__ import annotations

import itertools
import math
import uuid
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp import reader as reader_module
from bcp.backends import backend_for
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_plan, shard_reads
from bcp.metadata import (
    FileEntry,
    FormatError,
    Fragment,
    block_checksums,
    digest_of_checksums,
)
from bcp.metadata.keys import data_file_key, generation_name
from helpers import commit_hand_made, examples
from recording_backend import Recording as Resident

Layout = list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]]


def values(shape: tuple[int, ...], t: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + 1000 * t).to(dtype)


def cut(part: torch.Tensor, off, ln) -> torch.Tensor:
    return part[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))]


def write(layout: Layout, *, writers: int, block: int, dtype: torch.dtype = torch.float32) -> str:
    """A committed checkpoint of ``layout`` (per tensor: shape and stored boxes, which may
    repeat: replicas) as ``writers`` simulated ranks would save it, boxes dealt round-robin."""
    uri = f"memory://exact-{uuid.uuid4().hex[:8]}/ck"
    backend = backend_for(uri)
    gen = generation_name("0" * 24)
    files: dict[int, bytearray] = {w: bytearray() for w in range(writers)}
    frags = []
    deal = itertools.count()
    name = str(dtype).removeprefix("torch.")
    for t, (shape, boxes) in enumerate(layout):
        full = values(shape, t, dtype)
        for off, ln in boxes:
            w = next(deal) % writers
            part = cut(full, off, ln) if full.dim() else full.reshape(1)
            data = part.contiguous().view(torch.uint8).numpy().tobytes()
            key = data_file_key(gen, w)
            checksums = tuple(block_checksums(data, block))
            args = (name, shape, off, ln, key, len(files[w]), len(data), checksums, w)
            frags.append(Fragment(f"t{t}", f'[["d", "t{t}"]]', *args))
            files[w] += data
            files[w] += bytes(-len(files[w]) % 64)  # aligned as the writer aligns
    entries = []
    for w, data in files.items():
        if data:
            backend.write(data_file_key(gen, w), bytes(data))
            entries.append(
                FileEntry(data_file_key(gen, w), len(data), digest_of_checksums(block_checksums(bytes(data), block)))
            )
    commit_hand_made(backend, gen, frags, entries, writers=writers, block=block)
    return uri


@st.composite
def layouts(draw) -> Layout:
    """Tensors of 0-3 dimensions, each stored as a grid along one dimension (uneven
    cuts, empty parts), some with every box stored twice (replicas)."""
    out: Layout = []
    for _ in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
        if not shape:
            out.append((shape, [((), ())]))
            continue
        k = draw(st.integers(0, len(shape) - 1))
        inner = sorted(draw(st.lists(st.integers(0, shape[k]), max_size=3)))
        c = [0, *inner, shape[k]]
        boxes = []
        for a, b in itertools.pairwise(c):
            off = tuple(a if i == k else 0 for i in range(len(shape)))
            boxes.append((off, tuple(b - a if i == k else s for i, s in enumerate(shape))))
        boxes = [b for b in boxes if math.prod(b[1])]
        if draw(st.integers(0, 4)) == 0:
            boxes = boxes + boxes  # replicas: the planner chooses among them
        out.append((shape, boxes))
    return out


def planned_only(monkeypatch) -> None:
    """The old path: no request read as an exact shard."""
    monkeypatch.setattr(shard_reads, "split_exact", lambda catalog, block, requests, *a: ([], requests))


def counting_planner(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = read_plan.plan_tensor_reads

    def count(entry, *a, **k):
        seen.append(entry.fqn)
        return real(entry, *a, **k)

    monkeypatch.setattr(reader_module, "plan_tensor_reads", count)
    return seen


@settings(max_examples=examples(40), deadline=None)
@given(
    layout=layouts(),
    writers=st.integers(1, 4),
    block=st.sampled_from([64, 1024]),
    resident=st.booleans(),
    data=st.data(),
)
def test_exact_shards_load_what_the_planner_loads(layout, writers, block, resident, data):
    """Each tensor asked for one box: a stored one (same layout) or another (resharded),
    into a dense, strided or cast destination; the values equal the stored ones and
    the planner-only load's; exactly the dense same-layout boxes with one row skip the planner."""
    uri = write(layout, writers=writers, block=block)
    requests = []
    bulk = set()
    for t, (shape, boxes) in enumerate(layout):
        if boxes and data.draw(st.booleans()):
            off, ln = data.draw(st.sampled_from(boxes))
            unique = boxes.count((off, ln)) == 1
        else:
            off = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
            ln = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, off, strict=True))
            unique = (off, ln) in boxes and boxes.count((off, ln)) == 1
        how = data.draw(st.sampled_from(["dense", "dense", "strided", "cast"]))
        dest = torch.full(ln, -1.0)
        if how == "strided" and len(ln) == 2 and min(ln) > 1:
            dest = torch.full(ln[::-1], -1.0).t()
        elif how == "cast":
            dest = dest.double()
        if unique and dest.is_contiguous() and dest.dtype == torch.float32:
            bulk.add(f"t{t}")  # one row is the box (or the whole tensor): no planner call
        requests.append((f"t{t}", (off, ln), dest))
    loaded = {}
    for path in ("bulk", "planned"):
        mp = pytest.MonkeyPatch()
        try:
            if path == "planned":
                planned_only(mp)
            planned = counting_planner(mp)
            todo = [
                (f, b, torch.full_like(d, -1.0) if d.is_contiguous() else d.clone().fill_(-1.0)) for f, b, d in requests
            ]
            with bcp.open(Resident(backend_for(uri), resident)) as reader:
                reader.fill(todo, prefer_rank=data.draw(st.integers(0, 3)))
        finally:
            mp.undo()
        loaded[path] = todo
        if path == "bulk":
            assert sorted(planned) == sorted(f for f, _b, _d in requests if f not in bulk)
    for (fqn, (off, ln), a), (_f, _b, b) in zip(loaded["bulk"], loaded["planned"], strict=True):
        shape = layout[int(fqn[1:])][0]
        want = cut(values(shape, int(fqn[1:]), torch.float32), off, ln).to(a.dtype)
        assert torch.equal(a, want) and torch.equal(b, want), fqn


def row_sharded(tensors: int, ranks: int) -> Layout:
    return [((4 * ranks, 3 + t % 4), [((4 * r, 0), (4, 3 + t % 4)) for r in range(ranks)]) for t in range(tensors)]


def test_a_same_layout_load_of_shards_calls_no_planner(monkeypatch):
    """A rank of a 4-rank row-sharded save loads its own TensorShards (bcp.load): no
    planner call, one bulk read each; every value is its rank's part."""
    layout = row_sharded(50, 4)
    uri = write(layout, writers=4, block=64)
    planned = counting_planner(monkeypatch)
    rank = 2
    state = {
        f"t{t}": bcp.TensorShard(torch.zeros(4, shape[1]), shape, (4 * rank, 0)) for t, (shape, _b) in enumerate(layout)
    }
    bcp.load(state, uri)
    assert planned == []
    for t, (shape, _b) in enumerate(layout):
        assert torch.equal(state[f"t{t}"].local, cut(values(shape, t, torch.float32), (4 * rank, 0), (4, shape[1])))


@pytest.mark.parametrize("resident", [True, False])
def test_a_flipped_byte_in_a_shard_names_its_own_row(resident):
    """The error names the tensor, the shard's file and the offset of the bad block
    within that shard's row (not the tensor's first row)."""
    layout = row_sharded(6, 4)
    uri = write(layout, writers=4, block=64)
    frag = bcp.open(uri).catalog.tensors["t3"].fragment(2)
    backend = backend_for(uri)
    data = bytearray(backend.read(frag.file))
    data[frag.byte_offset + 70] ^= 0x5A
    backend.write(frag.file, bytes(data))
    shape = layout[3][0]
    dest = torch.zeros(4, shape[1])  # kept alive past the load, as callers do
    with bcp.open(Resident(backend_for(uri), resident)) as reader, pytest.raises(CorruptCheckpointError) as info:
        reader.fill([("t3", ((8, 0), (4, shape[1])), dest)])
    assert info.value.fqn == "t3" and info.value.file == frag.file
    assert info.value.offset == frag.byte_offset + 64


def test_rows_that_overlap_elsewhere_are_refused_as_the_planner_refuses_them():
    """The box is exactly one row and no other row meets it, but two other rows overlap:
    the tensor's rows do not tile it, a FormatError on either path."""
    layout: Layout = [((10,), [((0,), (4,)), ((4,), (4,)), ((6,), (4,))])]
    uri = write(layout, writers=3, block=64)
    with pytest.raises(FormatError, match="'t0'"), bcp.open(uri) as reader:
        reader.fill([("t0", ((0,), (4,)), torch.zeros(4))])


def test_destinations_passed_as_temporaries_live_until_the_bulk_reads_land(monkeypatch):
    """fill given its destinations only in the list it is called with (no other
    reference): each must stay alive while the bulk reads write into it through raw
    views; it was freed before the reads (heap corruption) when fill rebound its argument."""
    layout = [((4, 6), [((0, 0), (4, 6))]), *row_sharded(3, 2)]  # a whole tensor and exact shards
    uri = write(layout, writers=2, block=64)
    refs: list[weakref.ref] = []

    def temporary(shape) -> torch.Tensor:
        t = torch.zeros(shape)
        refs.append(weakref.ref(t))
        return t

    alive: list[bool] = []
    real = reader_module.execute_whole_reads

    def bulk(backend, reads, *a, **k):
        alive.extend(r() is not None for r in refs)
        return real(backend, reads, *a, **k)

    monkeypatch.setattr(reader_module, "execute_whole_reads", bulk)
    boxes = [((0, 0), (4, 6)), *[((4, 0), (4, shape[1])) for shape, _b in layout[1:]]]
    with bcp.open(uri) as reader:
        reader.fill([(f"t{t}", box, temporary(box[1])) for t, box in enumerate(boxes)])
    assert alive == [True] * len(boxes)
