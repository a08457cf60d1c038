"""The local tier's recovery reads as a load from the file root does: the recovery
directory's backends hand out the file backend's own reader (one descriptor, ``preadv``
for many tensors) and still wait for fetched bytes; the fetch plan plans only the tensors
with bytes in files the host does not hold, entries built together."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import bcp.tiers.exchange as exchange
from bcp.backends import backend_for, read_into_many
from bcp.coordination.collectives import Coordinator
from bcp.reader import fetch_metadata
from bcp.tiers.arrival import Arrivals, GatedBackend, HoleyFiles

DATA = bytes(range(256)) * 8  # room for the largest read the tests make: offset 900 + 5 x 40 bytes


def _counted(backend):
    """``backend`` with its ``read_into`` calls counted (an open, checks and a close each)."""
    calls = []
    inner = backend.read_into

    def read_into(key, offset, buffer):
        calls.append((key, offset))
        return inner(key, offset, buffer)

    backend.read_into = read_into
    return backend, calls


@pytest.mark.parametrize("wrapper", ["holey", "gated"])
def test_a_held_file_is_read_through_the_file_backends_own_reader(tmp_path, wrapper):
    (tmp_path / "held").write_bytes(DATA)
    inner, calls = _counted(backend_for(str(tmp_path)))
    backend = HoleyFiles(inner) if wrapper == "holey" else GatedBackend(inner, {"f": 0}, Arrivals())
    bufs = [bytearray(3), bytearray(5), bytearray(100)]
    with backend.reading("held") as read:
        assert hasattr(read, "read_into_many"), "the bulk path's one preadv for many buffers"
        read_into_many(read, 7, [memoryview(b) for b in bufs])
        one = bytearray(10)
        read(500, memoryview(one))
    assert [bytes(b) for b in bufs] == [DATA[7:10], DATA[10:15], DATA[15:115]]
    assert bytes(one) == DATA[500:510]
    assert calls == [], "no open, checks and close per read"


@settings(max_examples=25, deadline=None)
@given(
    offset=st.integers(0, 900),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    split=st.integers(0, 100),
    many=st.booleans(),
)
def test_a_gated_reader_waits_until_every_byte_it_fills_has_landed(tmp_path_factory, offset, sizes, split, many):
    """Reads of a fetched file through ``reading`` (one buffer, or many in one call) wait
    until the whole range they fill has landed, in any pieces, and then read it."""
    root = tmp_path_factory.mktemp("gated")
    (root / "f").write_bytes(DATA)
    arrivals = Arrivals()
    gated = GatedBackend(backend_for(str(root)), {"f": 0}, arrivals)
    total = sum(sizes)
    bufs = [bytearray(n) for n in sizes] if many else [bytearray(total)]
    done = threading.Event()

    def run() -> None:
        with gated.reading("f") as read:
            if many:
                read_into_many(read, offset, [memoryview(b) for b in bufs])
            else:
                read(offset, memoryview(bufs[0]))
        done.set()

    reader = threading.Thread(target=run)
    reader.start()
    cut = offset + min(split, total)
    arrivals.landed(0, 0, cut)  # the first part of the range (or all of an empty one)
    if cut < offset + total:
        assert not done.wait(0.05), "part of the range has not landed: the read waits"
        arrivals.landed(0, cut, offset + total)
    assert done.wait(5)
    reader.join(5)
    assert b"".join(bytes(b) for b in bufs) == DATA[offset : offset + total]


def test_a_gated_reader_is_released_by_a_failed_exchange(tmp_path):
    (tmp_path / "f").write_bytes(DATA)
    arrivals = Arrivals()
    gated = GatedBackend(backend_for(str(tmp_path)), {"f": 0}, arrivals)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with gated.reading("f") as read:
                read_into_many(read, 0, [memoryview(bytearray(4)), memoryview(bytearray(4))])
        except bcp.CorruptCheckpointError as e:
            errors.append(e)

    reader = threading.Thread(target=run)
    reader.start()
    arrivals.end(ConnectionError("peer gone"))
    reader.join(5)
    assert len(errors) == 1 and "exchange failed" in str(errors[0]) and "peer gone" in str(errors[0])


def test_the_fetch_plan_plans_only_tensors_with_bytes_in_files_not_held(tmp_path, monkeypatch):
    """A host holding the one data file wants nothing and plans no tensor's reads; a host
    holding none wants every byte the load reads (each tensor's, widened to its blocks)."""
    state = {f"t{i}": torch.arange(10 * (i + 1), dtype=torch.float32) for i in range(6)}
    ckpt = str(tmp_path / "ckpt")
    bcp.save(state, ckpt)
    metadata = fetch_metadata(backend_for(ckpt))
    reader = bcp.open(ckpt)
    manifest = reader.manifest
    planned: list[str] = []
    plan = exchange.plan_tensor_reads

    def counting(entry, boxes, **kw):
        planned.append(entry.fqn)
        return plan(entry, boxes, **kw)

    monkeypatch.setattr(exchange, "plan_tensor_reads", counting)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    opts = bcp.LoadOptions()
    none = exchange.wanted_ranges(template, ckpt, manifest, metadata, frozenset({0}), Coordinator(), opts)
    assert none.shape == (0, 3) and planned == [], "every tensor in a held file: nothing planned"
    every = exchange.wanted_ranges(template, ckpt, manifest, metadata, frozenset(), Coordinator(), opts)
    assert sorted(planned) == sorted(state), "each tensor planned once"
    covered = np.zeros(manifest.data_files[0].nbytes, bool)
    for file, start, nbytes in every.tolist():
        assert file == 0
        covered[start : start + nbytes] = True
    for fqn in state:
        frag = reader.catalog.tensors[fqn].fragment(0)
        assert covered[frag.byte_offset : frag.byte_offset + frag.nbytes].all(), fqn
    reader.close()


class _Recorded(Arrivals):
    """Arrivals that never wait: each gated read's file range is recorded instead."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[int, int, int]] = []

    def wait(self, file: int, start: int, end: int, what: str) -> None:
        self.waits.append((file, start, end))


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), min_size=2, max_size=10),
    half=st.booleans(),
    block=st.sampled_from([64, 1 << 20]),
)
def test_every_read_of_a_fetched_file_lies_in_the_ranges_the_exchange_fetches(tmp_path_factory, sizes, half, block):
    """A load through the recovery directory's gated backend reads only bytes its rank's
    wanted ranges fetch, so each read goes on as soon as this rank's pieces have landed and
    none waits for the whole exchange: the bulk path's batches and the planned reads'
    coalescing join small tensors across the writer's 64-byte alignment padding, which the
    ranges now span too. ``half``: the last tensor, 2-D, loaded as a shard of its rows (a
    planned, partial read); the rest whole (the bulk path)."""
    root = tmp_path_factory.mktemp("fetched")
    gen = torch.Generator().manual_seed(len(sizes))
    state = {f"t{i}": torch.rand(n, generator=gen) for i, n in enumerate(sizes)}  # 4n bytes: padded to 64
    state["m"] = torch.rand(6, sizes[0], generator=gen)
    ckpt = str(root / "ckpt")
    bcp.save(state, ckpt, checksum_block_bytes=block)
    backend = backend_for(ckpt)
    metadata = fetch_metadata(backend)
    manifest = bcp.open(ckpt).manifest
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    if half:
        template["m"] = bcp.TensorShard(torch.zeros(3, sizes[0]), (6, sizes[0]), (3, 0))
    opts = bcp.LoadOptions()
    wanted = exchange.wanted_ranges(template, ckpt, manifest, metadata, frozenset(), Coordinator(), opts)
    fetched = {f.path: i for i, f in enumerate(manifest.data_files)}
    arrivals = _Recorded()
    gated = GatedBackend(backend, fetched, arrivals)
    loaded = bcp.loader.load_with_metadata(template, gated, metadata, opts).state
    assert all(torch.equal(loaded[k], state[k]) for k in [f"t{i}" for i in range(len(sizes))])
    want_m = state["m"][3:] if half else state["m"]
    got_m = loaded["m"].local if half else loaded["m"]
    assert torch.equal(got_m, want_m)
    assert arrivals.waits, "the load read the fetched file"
    for file, start, end in arrivals.waits:
        rows = wanted[wanted[:, 0] == file]
        inside = (rows[:, 1] <= start) & (start + (end - start) <= rows[:, 1] + rows[:, 2])
        assert inside.any(), f"a read of bytes {start}-{end} spans bytes the exchange does not fetch: {rows.tolist()}"
