"""The chunked write pipeline: chunk planning, round trips with tiny slabs and
several streams, padding hygiene, and the memory bound."""

from __future__ import annotations

import ctypes
import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends.wrappers import ForwardingBackend
from bcp.io_scheduler.chunk_plan import plan_chunks
from bcp.io_scheduler.staging import StagingPool
from helpers import tensor_bytes_equal

SLAB = 64 << 10
BLOCK = 4 << 10


@given(st.lists(st.integers(0, 5 * SLAB), max_size=12), st.sampled_from([SLAB, 2 * SLAB]))
def test_chunks_tile_every_item_within_the_chunk_size(sizes, chunk):
    spans, offset = [], 0
    for i, n in enumerate(sizes):
        offset = -(-offset // 64) * 64
        spans.append((i, offset, n))
        offset += n
    chunks = plan_chunks(spans, chunk)
    covered = {i: [] for i in range(len(sizes))}
    for c in chunks:
        assert 0 < c.nbytes <= chunk
        for seg in c.segments:
            assert seg.start % chunk == 0, "a split must fall on a multiple of the chunk size"
            assert c.offset + seg.at == spans[seg.item][1] + seg.start, "segment placed at the wrong file offset"
            covered[seg.item].append((seg.start, seg.nbytes))
    for i, n in enumerate(sizes):
        assert sum(k for _s, k in covered[i]) == n, f"item {i} not covered exactly"


@given(
    sizes=st.lists(st.integers(0, 3 * SLAB // 4), min_size=1, max_size=10),
    streams=st.integers(1, 4),
    use_async=st.booleans(),
    slabs=st.integers(2, 6),
)
def test_round_trip_with_tiny_slabs_and_many_streams(uri_factory, sizes, streams, use_async, slabs):
    g = torch.Generator().manual_seed(len(sizes))
    state = {
        f"t{i}": torch.randint(-(2**31), 2**31 - 1, (n // 4,), generator=g, dtype=torch.int32)
        for i, n in enumerate(sizes)
    }
    state["big"] = torch.randn(3 * SLAB // 4 + 17, generator=g)  # split over several chunks
    pool = StagingPool(slabs * SLAB, SLAB)
    uri = uri_factory()
    if use_async:
        bcp.async_save(state, uri, pool=pool, streams=streams, checksum_block_bytes=BLOCK).wait()
    else:
        bcp.save(state, uri, pool=pool, streams=streams, checksum_block_bytes=BLOCK)
    assert pool.allocated_bytes <= pool.capacity
    reader = bcp.open(uri)
    for k, v in state.items():
        assert tensor_bytes_equal(reader.read(k), v), k


def test_padding_never_leaks_bytes_of_an_earlier_save(tmp_path):
    pool = StagingPool(4 * SLAB, SLAB)
    secret = {"s": torch.full((SLAB // 4 - 3,), 0x5EC12E7, dtype=torch.int32)}
    bcp.save(secret, str(tmp_path / "a"), pool=pool, checksum_block_bytes=BLOCK)
    small = {f"x{i}": torch.ones(3, dtype=torch.int8) for i in range(5)}  # packed, with padding between
    bcp.save(small, str(tmp_path / "b"), pool=pool, checksum_block_bytes=BLOCK)
    data_dir = tmp_path / "b"
    (data,) = [os.path.join(d, f) for d, _s, fs in os.walk(data_dir) for f in fs if f.endswith(".bin")]
    with open(data, "rb") as f:
        raw = f.read()
    assert raw.replace(b"\x01", b"").strip(b"\x00") == b"", "padding holds stale bytes"


def test_in_flight_memory_stays_within_the_pool(tmp_path):
    """A state eight times the pool still saves, asynchronously too, never above it."""
    pool = StagingPool(4 * SLAB, SLAB)
    state = {f"t{i}": torch.randn(SLAB // 4) for i in range(32)}
    peak = 0
    real_acquire = pool.acquire

    def watch():
        nonlocal peak
        slab = real_acquire()
        peak = max(peak, pool.allocated_bytes)
        return slab

    pool.acquire = watch
    bcp.async_save(state, str(tmp_path / "ck"), pool=pool, checksum_block_bytes=BLOCK).wait()
    assert 0 < peak <= pool.capacity == 4 * SLAB
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in state.items())


def test_direct_and_buffered_file_writes_agree(tmp_path):
    state = {"a": torch.randn(1 << 18), "b": torch.randn(100), "c": torch.arange(1 << 20, dtype=torch.int16)}
    for direct in ("true", "false"):
        uri = f"file://{tmp_path}/{direct}?direct={direct}"
        bcp.save(state, uri)
        r = bcp.open(str(tmp_path / direct))
        assert all(torch.equal(r.read(k), v) for k, v in state.items())


# -- object-store mode: whole contiguous parts ------------------------------------------------


def _piece_items(sizes):
    """Piece-like uint8 tensors for layout()."""
    from types import SimpleNamespace

    return [SimpleNamespace(tensor=torch.zeros(n, dtype=torch.uint8)) for n in sizes]


@given(st.lists(st.integers(0, 3 * SLAB), max_size=14), st.sampled_from([SLAB, 2 * SLAB, 4 * SLAB]))
def test_parts_tile_the_file_and_cut_fragments_between_checksum_blocks(sizes, part):
    from bcp.io_scheduler.chunk_plan import layout, plan_part_chunks

    placed = layout(_piece_items(sizes), part_size=part, block=BLOCK)
    offsets, unique, size = placed.offsets, placed.unique, placed.size
    spans = [(i, offsets[i], sizes[i]) for i in unique]
    chunks = plan_part_chunks(spans, part, size)
    assert [c.offset for c in chunks] == list(range(0, size, part)), "parts must start at multiples of part_size"
    assert all(c.nbytes == part for c in chunks[:-1]) and sum(c.nbytes for c in chunks) == size
    covered = dict.fromkeys(unique, 0)
    for c in chunks:
        ends = sorted((seg.at, seg.at + seg.nbytes) for seg in c.segments)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends)), "segments overlap inside a part"
        for seg in c.segments:
            assert c.offset + seg.at == offsets[seg.item] + seg.start, "segment at the wrong file offset"
            assert seg.start % BLOCK == 0, "a part boundary cuts a fragment inside a checksum block"
            covered[seg.item] += seg.nbytes
    assert all(covered[i] == sizes[i] for i in unique), "a fragment is not covered exactly once"


@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=8), st.integers(0, 2**31 - 1))
def test_round_trip_through_a_part_sized_streaming_store(sizes, seed):
    """Real saves through a backend that demands whole parts (the fsspec backend)."""
    import uuid

    g = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate(sizes)}
    uri = f"fsspec+memory://pp-{uuid.uuid4().hex}/ck?part_size=64KiB"
    bcp.save(state, uri)
    out = bcp.load({k: torch.empty_like(v) for k, v in state.items()}, uri)
    for k, v in state.items():
        assert torch.equal(out[k], v), f"{k} ({v.numel()} bytes) differs after a part-sized save"


def test_a_data_file_that_cannot_be_opened_reports_its_own_error(tmp_path):
    """finish() used to call abort() on the writer that never opened (AttributeError)."""

    class NoDataFiles(ForwardingBackend):
        def open_writer(self, key, *, size=None):
            if key.endswith(".bin"):
                raise PermissionError(f"cannot open {key}")
            return super().open_writer(key, size=size)

    backend = NoDataFiles(backend_for(str(tmp_path / "ck")))
    with pytest.raises(PermissionError, match="cannot open"):
        bcp.save({"w": torch.ones(10)}, backend)


@given(st.lists(st.integers(0, 3 * SLAB), max_size=14))
def test_the_file_ends_at_its_last_byte(sizes):
    """An empty item (the state's last tensor may be one) takes no place, so the
    declared file size is the end of the last byte written: a store that keeps only
    written bytes (the sqlite example) holds exactly that size."""
    from bcp.io_scheduler.chunk_plan import layout

    placed = layout(_piece_items(sizes))
    ends = [placed.offsets[i] + sizes[i] for i in placed.unique if sizes[i]]
    assert placed.size == max(ends, default=0)


# -- asynchronous saves: packed slabs ---------------------------------------------------------


@given(
    st.lists(st.integers(0, 5 * SLAB), max_size=14),
    st.sampled_from([SLAB, 2 * SLAB]),
    st.sampled_from([BLOCK, 4 * BLOCK]),
)
def test_packed_chunks_fill_their_slabs_and_split_items_between_checksum_blocks(sizes, chunk, block):
    from bcp.io_scheduler.chunk_plan import layout, plan_packed_chunks

    placed = layout(_piece_items(sizes))
    spans = [(i, placed.offsets[i], sizes[i]) for i in placed.unique]
    chunks = plan_packed_chunks(spans, chunk, block)
    covered = dict.fromkeys(placed.unique, 0)
    for c in chunks:
        assert 0 < c.nbytes <= chunk
        ends = sorted((seg.at, seg.at + seg.nbytes) for seg in c.segments)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends)), "segments overlap inside a chunk"
        assert ends[-1][1] == c.nbytes, "a chunk ends with padding"
        for seg in c.segments:
            assert c.offset + seg.at == placed.offsets[seg.item] + seg.start, "segment at the wrong file offset"
            assert seg.start % block == 0, "an item is split inside a checksum block"
            covered[seg.item] += seg.nbytes
    assert all(covered[i] == sizes[i] for i in placed.unique), "an item is not covered exactly once"
    for c, nxt in itertools.pairwise(chunks):
        # the next chunk starts where this one could not take a whole block more (or an
        # alignment gap that would not fit): every chunk but the last is nearly full
        assert c.nbytes > chunk - block - 4096 or nxt.offset >= c.offset + chunk - 4096, "a slab left mostly empty"


class _HeldWrites(ForwardingBackend):
    """Data-file writes wait until ``release`` is set (the disk is busy)."""

    def __init__(self, inner, release):
        super().__init__(inner)
        self.release = release

    def open_writer(self, key, *, size=None):
        from bcp.backends.wrappers import ForwardingWriter

        release = self.release

        class Held(ForwardingWriter):
            def _write_at(self, offset, data):
                assert release.wait(timeout=60), "writes held too long"
                super()._write_at(offset, data)

        writer = super().open_writer(key, size=size)
        return Held(writer) if key.endswith(".bin") else writer


def test_async_save_of_mid_sized_tensors_needs_only_their_bytes_of_staging(tmp_path):
    """Tensors a little over a slab each used to take two slabs each: a pool holding the
    state's bytes ran out, and the caller waited for the disk to free slabs."""
    import threading

    state = {f"w{i}": torch.randn(9 * SLAB // 32) for i in range(8)}  # 1.125 slabs each
    expected = {k: v.clone() for k, v in state.items()}
    pool = StagingPool(11 * SLAB, SLAB)  # the state is 9 slabs of bytes
    release = threading.Event()
    backend = _HeldWrites(backend_for(str(tmp_path / "ck")), release)
    returned: list = []
    caller = threading.Thread(
        target=lambda: returned.append(bcp.async_save(state, backend, pool=pool, checksum_block_bytes=BLOCK))
    )
    caller.start()
    caller.join(timeout=20)
    finished_while_held = bool(returned)
    release.set()
    caller.join()
    returned[0].wait()
    assert finished_while_held, "async_save waited for the disk: its chunks did not fit the pool"
    assert pool.allocated_bytes <= 10 * SLAB
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in expected.items())


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The share of ``tensor``'s pages in memory now (mincore). The process's RSS is not
    used: a collected pool of an earlier test freeing a slab of the same size at the
    same moment left it unchanged across a reservation (seen once in CI)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // page)
    flags = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, end - start, flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(f & 1 for f in flags) / pages


def test_a_slab_made_for_a_save_is_touched_by_its_copy_not_zeroed_first():
    """The first save of a process pays for its staging memory once (the copy is the
    first touch), not a zeroing pass followed by the copy."""
    slab_bytes = 64 << 20
    pool = StagingPool(2 * slab_bytes, slab_bytes, pinned=False)
    slab = pool.acquire()
    assert slab.capacity >= slab_bytes
    touched = _resident_fraction(slab.tensor)
    assert touched < 0.25, f"acquire touched {touched:.0%} of a new slab before any copy"
    reserved = StagingPool(2 * slab_bytes, slab_bytes, pinned=False)
    reserved.reserve(slab_bytes)
    ready = reserved.acquire()
    assert _resident_fraction(ready.tensor) > 0.99, "a reservation must touch its slabs ahead of the save"
    reserved.release(ready)
    pool.release(slab)


@given(st.lists(st.tuples(st.integers(0, 3 * SLAB // 2), st.integers(0, 9)), min_size=1, max_size=8))
def test_async_save_stages_views_of_any_length_and_offset_exactly(tmp_path_factory, views):
    """Sources at odd storage offsets and of odd lengths, packed and split across slabs."""
    g = torch.Generator().manual_seed(len(views))
    state = {}
    for i, (n, at) in enumerate(views):
        base = torch.randint(0, 256, (n + at,), dtype=torch.uint8, generator=g)
        state[f"v{i}"] = base[at:]
    uri = str(tmp_path_factory.mktemp("views") / "ck")
    bcp.async_save(state, uri, pool=StagingPool(4 * SLAB, SLAB), checksum_block_bytes=BLOCK).wait()
    r = bcp.open(uri)
    assert all(torch.equal(r.read(k), v) for k, v in state.items())


def test_staging_copies_are_not_split_over_torchs_threads(tmp_path, monkeypatch):
    """A 64 KiB float32 tensor copied as 65,536 bytes crossed torch's 32,768-element
    threshold for splitting a copy over its threads: every tensor's copy became an
    OpenMP parallel region (13-25 s for 10,000 such copies on a loaded machine, 0.2 s
    as one memmove each). Host bytes are staged without Tensor.copy_."""
    state = {f"t{i}": torch.randn(16384) for i in range(6)}  # 64 KiB each, packed into one slab
    seen: list[tuple[torch.dtype, int]] = []
    real_copy = torch.Tensor.copy_

    def recording_copy(self, src, *args, **kwargs):
        seen.append((self.dtype, self.numel()))
        return real_copy(self, src, *args, **kwargs)

    pool = StagingPool(8 * SLAB, SLAB)
    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    handle = bcp.async_save(state, str(tmp_path / "ck"), pool=pool, checksum_block_bytes=BLOCK)
    monkeypatch.undo()
    handle.wait()
    assert not [n for _dtype, n in seen if n >= 32768], seen
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in state.items())


def test_a_sync_save_of_many_tensors_writes_in_few_large_requests(tmp_path, monkeypatch):
    """A sync save of host tensors to the file backend writes batches of up to
    BATCH_BYTES, each one request from the tensors' memory, not a request (and two
    partial-page writes) per tensor; every byte and checksum still reads back."""
    from bcp.io_scheduler import write_pipeline

    monkeypatch.setattr(write_pipeline, "BATCH_BYTES", 4 << 20, raising=False)
    gen = torch.Generator().manual_seed(3)
    sizes = [5, 300_001, 100, 300_003, 70_000, 3] + [300_001 + 2 * i for i in range(8)] + [17, 1_000, 64, 2]
    state = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}  # 11.8 MiB in all
    writes: list[str] = []
    pwrite, pwritev = os.pwrite, os.pwritev

    def note(fd: int) -> None:
        writes.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: note(fd) or pwrite(fd, data, at))
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, at: note(fd) or pwritev(fd, bufs, at))
    bcp.save(state, str(tmp_path / "ck"))
    monkeypatch.undo()
    data_requests = [path for path in writes if "/data/" in path]
    assert 3 <= len(data_requests) <= 3 * 3  # 3 batches of 4 MiB, at most 3 requests each
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in state.items())


# -- a sync save's batches: one writer, checksums taken ahead in the calling thread ------------


def _data_writes(monkeypatch, record):
    """Route the data file's pwrite/pwritev calls through ``record(fd, nbytes, offset)``."""
    pwrite, pwritev = os.pwrite, os.pwritev

    def data(fd: int) -> bool:
        return "/data/" in os.readlink(f"/proc/self/fd/{fd}")

    def counted_pwrite(fd, buf, at):
        if data(fd):
            record(fd, len(memoryview(buf).cast("B")), at)
        return pwrite(fd, buf, at)

    def counted_pwritev(fd, bufs, at):
        if data(fd):
            record(fd, sum(len(memoryview(b).cast("B")) for b in bufs), at)
        return pwritev(fd, bufs, at)

    monkeypatch.setattr(os, "pwrite", counted_pwrite)
    monkeypatch.setattr(os, "pwritev", counted_pwritev)


def test_a_sync_save_checksums_each_batch_in_the_calling_thread_before_one_writer_writes_it(tmp_path, monkeypatch):
    """The batches go out from one writer thread (one sequential stream on the disk)
    while the calling thread checksums the next ones: no byte reaches the data file
    before its checksum is taken, and every checksum is taken in the calling thread."""
    import threading

    from bcp.io_scheduler import write_pipeline

    monkeypatch.setattr(write_pipeline, "BATCH_BYTES", 1 << 20)
    gen = torch.Generator().manual_seed(5)
    # tensors lie in the file in the phase of their memory: under a page of padding before each
    state = {
        f"t{i}": torch.randint(0, 255, (n << 12,), generator=gen, dtype=torch.uint8)
        for i, n in enumerate([700, 300, 513, 1100])
    }
    padding = 4096 * len(state)  # far below a batch: a request ahead of its checksum shows
    lock = threading.Lock()
    summed, summers, writers, early = [0], set(), set(), []
    real_sums = write_pipeline.block_checksums

    def summing(data, block):
        out = real_sums(data, block)
        with lock:
            summed[0] += len(memoryview(data).cast("B"))
            summers.add(threading.get_ident())
        return out

    def record(fd, nbytes, at):
        with lock:
            writers.add(threading.get_ident())
            if at + nbytes > summed[0] + padding:
                early.append((at, nbytes, summed[0]))

    monkeypatch.setattr(write_pipeline, "block_checksums", summing)
    _data_writes(monkeypatch, record)
    bcp.save(state, str(tmp_path / "ck"), checksum_block_bytes=BLOCK)
    monkeypatch.undo()
    assert summed[0] == sum(t.numel() for t in state.values())
    assert summers == {threading.get_ident()}, "checksums taken outside the calling thread"
    assert len(writers) == 1 and threading.get_ident() not in writers, "not one writer thread"
    assert not early, f"bytes written before their checksum was taken: {early}"
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in state.items())


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=7),
    shifts=st.lists(st.integers(0, 4095), min_size=7, max_size=7),
    batch=st.sampled_from([16 << 10, 64 << 10, 1 << 20]),
)
def test_checksums_taken_ahead_are_of_exactly_the_bytes_written(tmp_path_factory, sizes, shifts, batch):
    """Odd-sized tensors at unaligned addresses, cut into batches anywhere: the
    checksums taken ahead in the calling thread match the bytes on disk block by block
    (bcp verify reads every block back), and every tensor reads back exactly."""
    from bcp.io_scheduler import write_pipeline
    from bcp.verify import verify_checkpoint

    gen = torch.Generator().manual_seed(sum(sizes) + batch)
    state = {}
    for i, (n, shift) in enumerate(zip(sizes, shifts, strict=False)):
        base = torch.randint(0, 255, (n + shift,), generator=gen, dtype=torch.uint8)
        state[f"t{i}"] = base[shift:]  # a view at any byte address
    uri = str(tmp_path_factory.mktemp("ck") / "ck")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(write_pipeline, "BATCH_BYTES", batch)
        bcp.save(state, uri, checksum_block_bytes=BLOCK)
    report = verify_checkpoint(uri)
    assert report["ok"], report["problems"]
    r = bcp.open(uri)
    assert all(torch.equal(r.read(k), v) for k, v in state.items())


def test_a_checksum_error_fails_the_save_naming_the_data_file(tmp_path, monkeypatch):
    """An error while the calling thread checksums a batch fails the save with that
    error, naming the data file; nothing is committed and no partial file is left."""
    from bcp.io_scheduler import write_pipeline

    monkeypatch.setattr(write_pipeline, "BATCH_BYTES", 1 << 20)
    state = {f"t{i}": torch.randn(300_001) for i in range(6)}
    calls = [0]
    real_sums = write_pipeline.block_checksums

    def failing(data, block):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("checksum unit failed")
        return real_sums(data, block)

    monkeypatch.setattr(write_pipeline, "block_checksums", failing)
    with pytest.raises(ValueError, match="checksum unit failed") as info:
        bcp.save(state, str(tmp_path / "ck"))
    monkeypatch.undo()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "rank00000" in notes and ".bin" in notes, f"the data file is not named: {notes!r}"
    with pytest.raises(bcp.CheckpointNotFoundError):
        bcp.open(str(tmp_path / "ck"))
    assert not [f for _d, _s, fs in os.walk(tmp_path) for f in fs], "files left behind"


def test_the_checksums_taken_ahead_stay_within_a_bound(tmp_path, monkeypatch):
    """While the disk holds the first requests, the calling thread checksums at most
    BATCH_AHEAD queued batches beyond those the writers hold (and the one it is on):
    bounded work ahead of the disk."""
    import threading
    import time

    from bcp.io_scheduler import write_pipeline

    batch = 1 << 20
    monkeypatch.setattr(write_pipeline, "BATCH_BYTES", batch)
    state = {f"t{i}": torch.randn(1 << 18) for i in range(16)}  # 16 MiB, 16 batches
    summed, seen = [0], []
    real_sums = write_pipeline.block_checksums
    first, gate = threading.Event(), threading.Event()

    def summing(data, block):
        summed[0] += len(memoryview(data).cast("B"))
        return real_sums(data, block)

    def record(fd, nbytes, at):
        if not first.is_set():
            first.set()
            time.sleep(0.3)  # the first request "on the disk": the producer runs ahead meanwhile
            seen.append(summed[0])
            gate.set()
        gate.wait()  # every other writer's request waits behind it

    monkeypatch.setattr(write_pipeline, "block_checksums", summing)
    _data_writes(monkeypatch, record)
    bcp.save(state, str(tmp_path / "ck"), checksum_block_bytes=BLOCK)
    monkeypatch.undo()
    ahead = write_pipeline.BATCH_STREAMS + write_pipeline.BATCH_AHEAD + 1
    assert seen and seen[0] <= ahead * batch, (seen, ahead)
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in state.items())
