"""Where an incremental save takes its digests (``bcp.pieces.StreamDigests``,
``bcp.incremental.find_candidates``): a piece whose first block checksum differs from
every candidate row of the base is written without a digest taken first; the writers
digest the bytes they write, so every written row's digest is of its stored bytes and
an asynchronous save's digests are of the staged copy (the bytes at the call)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import bcp.pieces
import bcp.saver
from bcp.io_scheduler.staging import StagingPool
from bcp.metadata.keys import split_parent
from bcp.pieces import StreamDigests
from bcp.target import resolve_backend

PIECE = 256  # bytes: float32 rows of 16 values are 64 bytes, so a piece is 4 rows


def stored_digests(uri: str) -> list[tuple[str, bytes, bytes]]:
    """(fqn, the row's recorded digest, XXH3-128 of its stored bytes) for every catalog row."""
    reader = bcp.open(uri)
    owner = {f.path: f.checkpoint for f in reader.manifest.data_files}
    backend, parent = resolve_backend(uri), resolve_backend(split_parent(uri)[0])
    reader.catalog.require_all()
    out = []
    for f in reader.catalog.fragments:
        ck = owner[f.file]
        data = (
            backend.read(f.file, f.byte_offset, f.nbytes)
            if ck is None
            else parent.read(f"{ck}/{f.file}", f.byte_offset, f.nbytes)
        )
        out.append((f.fqn, f.digest, xxhash.xxh3_128_digest(bytes(data))))
    reader.close()
    return out


def count_digests(monkeypatch) -> list[int]:
    """Counts the digests taken before the data file is laid out (``piece_digest``)."""
    calls = [0]
    real = bcp.pieces.piece_digest

    def counted(t):
        calls[0] += 1
        return real(t)

    monkeypatch.setattr(bcp.pieces, "piece_digest", counted)
    return calls


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_digests_equal_the_whole_items_digest_in_any_order(data):
    sizes = data.draw(st.lists(st.integers(0, 300), min_size=1, max_size=4))
    blobs = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes() for i, n in enumerate(sizes)]
    parts = []
    for item, blob in enumerate(blobs):
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(blob) - 1)), max_size=4)))) if blob else []
        bounds = [0, *[c for c in cuts if c < len(blob)], len(blob)]
        parts += [(item, a, blob[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
    order = data.draw(st.permutations(parts))
    wanted = data.draw(st.sets(st.sampled_from(range(len(blobs))), min_size=1))
    stream = StreamDigests(sorted(wanted), sizes)
    for item, start, part in order:
        stream.feed(item, start, memoryview(part))
    for item in wanted:
        assert stream.result(item) == xxhash.xxh3_128_digest(blobs[item])
    assert set(stream.done) <= wanted  # items not asked for are not digested


def test_a_dense_save_takes_no_digest_before_writing_and_records_the_written_bytes(tmp_path, monkeypatch):
    state = {"w": torch.randn(64, 16), "v": torch.randn(40, 16), "s": torch.tensor(2.0)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    for t in state.values():
        t.add_(1.0)  # every byte changes
    calls = count_digests(monkeypatch)
    info = bcp.save(state, b, base=a, piece_bytes=PIECE)
    assert calls[0] == 0  # every first block differs: nothing to prove equal
    assert info.bytes_written >= sum(t.numel() * 4 for t in state.values())
    rows = stored_digests(b)
    assert len(rows) == 16 + 10 + 1
    assert all(recorded == actual for _fqn, recorded, actual in rows)


def test_a_piece_with_its_first_block_unchanged_is_digested_then_written_or_reused(tmp_path, monkeypatch):
    state = {"w": torch.zeros(16, 16)}  # four pieces of four rows; the block is 64 bytes: one row
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE, checksum_block_bytes=64)
    state["w"][3] = 1.0  # piece 0's last row: its first block is unchanged
    state["w"][4] = 1.0  # piece 1's first row
    calls = count_digests(monkeypatch)
    info = bcp.save(state, b, base=a, piece_bytes=PIECE, checksum_block_bytes=64)
    assert calls[0] == 3  # pieces 0, 2, 3: only their digest can tell
    assert info.bytes_written == 2 * PIECE  # pieces 0 and 1
    assert all(recorded == actual for _fqn, recorded, actual in stored_digests(b))
    assert torch.equal(bcp.open(b).state()["w"], state["w"])


def test_a_piece_changed_after_the_decision_is_recorded_with_the_written_bytes_digest(tmp_path, monkeypatch):
    """The digest a written row records is of the bytes written, not of those the
    reuse decision saw (here the tensor changes between the two)."""
    state = {"w": torch.zeros(16, 16)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE, checksum_block_bytes=64)
    state["w"][3] = 1.0  # piece 0: digested up front (first block unchanged), then written
    state["w"][4] = 1.0  # piece 1: written without a digest first
    real = bcp.saver.open_pipeline

    def change_then_open(*args, **kwargs):
        state["w"][0:8] += 5.0  # after the decision, before any byte is staged
        return real(*args, **kwargs)

    monkeypatch.setattr(bcp.saver, "open_pipeline", change_then_open)
    bcp.save(state, b, base=a, piece_bytes=PIECE, checksum_block_bytes=64)
    rows = stored_digests(b)
    assert all(recorded == actual for _fqn, recorded, actual in rows)


def test_an_async_save_digests_the_bytes_at_the_call_without_blocking_for_them(uri_factory, monkeypatch):
    state = {"w": torch.randn(64, 16), "v": torch.randn(32, 16)}
    a, b = uri_factory("a"), uri_factory("b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    for t in state.values():
        t.add_(1.0)
    at_call = {k: v.clone() for k, v in state.items()}
    calls = count_digests(monkeypatch)
    handle = bcp.async_save(state, b, base=a, piece_bytes=PIECE)
    assert calls[0] == 0  # no digest before async_save returns
    for t in state.values():
        t.fill_(7.0)  # right after the call: not in the checkpoint
    handle.wait()
    rows = stored_digests(b)
    assert all(recorded == actual for _fqn, recorded, actual in rows)
    expect = {
        (k, bytes(p))
        for k, t in at_call.items()
        for p in [xxhash.xxh3_128_digest(t[i : i + 4].numpy().tobytes()) for i in range(0, len(t), 4)]
    }
    assert {(fqn, recorded) for fqn, recorded, _ in rows} == expect
    assert all(torch.equal(v, at_call[k]) for k, v in bcp.open(b).state().items())


def test_items_split_over_small_slabs_are_digested_in_order(tmp_path):
    """An asynchronous save packs items into slabs and splits those that do not fit:
    each split item's parts are hashed in order whichever writer holds them."""
    state = {f"w{i}": torch.randn(250 + i, 16) for i in range(6)}  # 16,000+ bytes each, 4 KiB slabs
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save(state, a, incremental=True)
    for t in state.values():
        t.add_(1.0)
    pool = StagingPool(64 << 10, slab_bytes=4 << 10)
    bcp.async_save(state, b, base=a, pool=pool, checksum_block_bytes=1 << 10, streams=3).wait()
    rows = stored_digests(b)
    assert len(rows) == 6
    assert all(recorded == actual for _fqn, recorded, actual in rows)


def strided_tensors() -> st.SearchStrategy[torch.Tensor]:
    """Tensors of 0-4 dims in every layout: permuted, stepped, offset, conjugated."""

    @st.composite
    def build(draw) -> torch.Tensor:
        dims = draw(st.integers(0, 4))
        shape = draw(st.lists(st.integers(0, 6), min_size=dims, max_size=dims))
        dtype = draw(st.sampled_from([torch.float32, torch.int8, torch.bfloat16, torch.complex64, torch.float64]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
        big = [n * 2 + 1 for n in shape]
        t = torch.randn(big, generator=g).to(dtype) if dtype != torch.int8 else torch.randint(-9, 9, big, dtype=dtype)
        if dims:
            t = t[tuple(slice(draw(st.integers(0, 1)), None, draw(st.integers(1, 2))) for _ in range(dims))]
            t = t[tuple(slice(0, n) for n in shape)]
            t = t.permute(draw(st.permutations(range(dims))))
        if dtype == torch.complex64 and draw(st.booleans()):
            t = t.conj()
        return t

    return build()


@settings(max_examples=200, deadline=None)
@given(t=strided_tensors(), block=st.integers(1, 300))
def test_first_block_crc_reads_only_the_first_rows_and_equals_the_whole_copy(t, block):
    from bcp.incremental import first_block_crc
    from bcp.metadata import crc32c
    from bcp.tensor_io import flat_bytes, host_contiguous

    whole = flat_bytes(host_contiguous(t)).numpy()[:block]
    assert first_block_crc(t, block) == crc32c(memoryview(whole))


def test_first_block_crc_of_a_transposed_matrix_copies_only_its_first_rows(monkeypatch):
    import bcp.incremental

    t = torch.randn(512, 256).t()
    copied = []
    real = bcp.incremental.host_contiguous
    monkeypatch.setattr(bcp.incremental, "host_contiguous", lambda x: copied.append(x.numel()) or real(x))
    bcp.incremental.first_block_crc(t, 4096)
    assert copied == [2 * 512]  # two rows of 512 float32 cover the first 4 KiB


def reader_of(payload: bytes, most: int):
    """A backend's ``read_into`` over ``payload`` that returns at most ``most`` bytes a call."""

    def read_into(offset: int, buffer: memoryview) -> int:
        got = payload[offset : offset + min(len(buffer), most)]
        buffer[: len(got)] = got
        return len(got)

    return read_into


@settings(max_examples=150, deadline=None)
@given(data=st.data(), sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=3), cap=st.integers(0, 4000))
def test_stream_digests_keep_at_most_the_cap_and_digest_every_item_exactly(data, sizes, cap):
    """Parts of several items in any order (reverse included): the parts kept ahead of
    their turn never pass the cap, and each item's digest (streamed, or of its stored
    bytes once spilled) equals the one-shot digest."""
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    payloads = [rng.bytes(n) for n in sizes]
    parts = []
    for i, n in enumerate(sizes):
        cuts = sorted({*data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=8)), 0, n})
        parts += [(i, a, b) for a, b in itertools.pairwise(cuts) if a < b]
    order = data.draw(st.one_of(st.just(parts[::-1]), st.permutations(parts)))
    digests = bcp.pieces.StreamDigests(range(len(sizes)), sizes, early_cap=cap)
    for i, a, b in order:
        digests.feed(i, a, memoryview(payloads[i])[a:b])
        assert digests.held <= cap
    assert digests.peak_held <= cap and digests.held == 0
    for i, payload in enumerate(payloads):
        if i in digests.spilled:
            got = bcp.pieces.digest_stored(reader_of(b"xx" + payload, 700), 2, len(payload), 512)
        else:
            got = digests.result(i)
        assert got == xxhash.xxh3_128_digest(payload)


def test_stream_digests_spill_an_item_whose_reversed_parts_pass_the_cap():
    payload = bytes(range(200)) * 4
    parts = [(a, a + 100) for a in range(0, 800, 100)][::-1]
    for cap, spilled in ((250, {0}), (700, set())):
        digests = bcp.pieces.StreamDigests([0], [800], early_cap=cap)
        for a, b in parts:
            digests.feed(0, a, memoryview(payload)[a:b])
        assert digests.spilled == spilled and digests.peak_held <= cap
    assert digests.result(0) == xxhash.xxh3_128_digest(payload)


class Spilling(bcp.pieces.StreamDigests):
    """Every item left to a digest of its stored bytes: none is hashed while written."""

    def __init__(self, wanted, nbytes) -> None:
        super().__init__(wanted, nbytes, early_cap=0)
        self.spilled = set(self.nbytes)


def save_spilled(a: str, b: str, monkeypatch, **small_slabs) -> None:
    state = {f"w{i}": torch.randn(250 + i, 16) for i in range(4)}
    bcp.save(state, a, incremental=True)
    for t in state.values():
        t.add_(1.0)
    monkeypatch.setattr(bcp.saver, "StreamDigests", Spilling)
    bcp.async_save(state, b, base=a, streams=3, **small_slabs).wait()
    rows = stored_digests(b)
    assert len(rows) == 4
    assert all(recorded == actual for _fqn, recorded, actual in rows)
    assert all(torch.equal(v, state[k]) for k, v in bcp.open(b).state().items())


def test_spilled_items_are_digested_from_the_data_file(uri_factory, monkeypatch):
    """Items whose parts could not be kept get the digest of their bytes as stored."""
    pool = StagingPool(64 << 10, slab_bytes=4 << 10)  # items split over slabs
    save_spilled(uri_factory("a"), uri_factory("b"), monkeypatch, pool=pool, checksum_block_bytes=1 << 10)


def test_spilled_items_are_digested_from_the_data_file_on_s3(moto_server, monkeypatch):
    from conftest import new_bucket, store_uri

    bucket = new_bucket(moto_server)  # (parts of at least 5 MiB: the default slabs)
    save_spilled(*(store_uri("moto", moto_server, bucket, f"run/{n}") for n in ("a", "b")), monkeypatch)


def test_stream_digests_fed_by_several_threads_stay_exact_under_a_small_cap():
    """Writers racing (a spill while another writer hashes the item): each digest is the
    one-shot one, streamed or of the stored bytes; the cap holds throughout."""
    import random
    import threading

    rng = np.random.default_rng(3)
    payloads = [rng.bytes(n) for n in (5000, 7000, 3000, 9000)]
    parts = [(i, a, min(a + 500, len(p))) for i, p in enumerate(payloads) for a in range(0, len(p), 500)]
    random.Random(4).shuffle(parts)
    digests = bcp.pieces.StreamDigests(range(4), [len(p) for p in payloads], early_cap=1500)
    over = []

    def writer(share) -> None:
        for i, a, b in share:
            digests.feed(i, a, memoryview(payloads[i])[a:b])
            if digests.held > 1500:
                over.append(digests.held)

    threads = [threading.Thread(target=writer, args=(parts[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over and digests.peak_held <= 1500
    for i, payload in enumerate(payloads):
        got = (
            bcp.pieces.digest_stored(reader_of(payload, 1 << 20), 0, len(payload), 4096)
            if i in digests.spilled
            else digests.result(i)
        )
        assert got == xxhash.xxh3_128_digest(payload)
