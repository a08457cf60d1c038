"""A read's whole checksum blocks are verified with one CRC32C call over all of them,
compared with their block checksums combined (``combine_blocks``), and block by block
only on a mismatch, so the error still names the block. The combination must equal
CRC32C of the same bytes for any block size and count; a flipped byte anywhere in a
fragment, read whole or as a box, from a file on disk or in memory, is still reported
naming the tensor, the file and the block's byte range; and a load from memory opens
each data file once per read, not once per piece."""

from __future__ import annotations

import importlib
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends import file as file_backend
from bcp.backends.storage_errors import ObjectNotFoundError
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec, whole_reads
from bcp.metadata import checksum
from helpers import examples


@given(
    data=st.binary(min_size=0, max_size=4096),
    block=st.integers(1, 300),
)
def test_combined_block_checksums_equal_the_crc_of_the_blocks(data, block):
    """CRC32C of every whole block, combined, is CRC32C of those blocks' bytes."""
    whole = len(data) // block * block
    sums = checksum.block_checksums(data[:whole], block)
    assert checksum.combine_blocks(sums, block) == checksum.crc32c(data[:whole])
    assert checksum.combine_blocks(np.array(sums, np.uint32), block) == checksum.crc32c(data[:whole])


@settings(max_examples=examples(25))
@given(blocks=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
def test_combination_of_many_groups_of_blocks(blocks, seed):
    """Counts across several groups of checksum.GROUP blocks (fold of the groups), 1 KiB blocks."""
    data = np.random.default_rng(seed).integers(0, 256, blocks * 1024, dtype=np.uint8).tobytes()
    assert checksum.combine_blocks(checksum.block_checksums(data, 1024), 1024) == checksum.crc32c(data)


@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_crc32c_combine_of_two_pieces(a, b):
    assert checksum.crc32c_combine(checksum.crc32c(a), checksum.crc32c(b), len(b)) == checksum.crc32c(a + b)


def test_the_implementations_agree():
    """crc32c_rs (where installed) gives the crc32c package's values, continued too."""
    rs = pytest.importorskip("crc32c_rs")
    pkg = importlib.import_module("crc32c")
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 13, dtype=np.uint8).tobytes()
    for n in (0, 1, 7, 4096, 65536, len(data)):
        assert rs.crc32c(data[:n]) == pkg.crc32c(data[:n])
        assert rs.crc32c(data[n:], rs.crc32c(data[:n])) == pkg.crc32c(data)
    assert checksum.IMPLEMENTATION == "crc32c_rs"


def test_one_crc_call_per_piece_read_from_memory(tmp_path, monkeypatch):
    """A fragment of 40 blocks read from memory in pieces of 8 blocks: one CRC call per
    piece (and one for the short last block), not one per block."""
    block = 256
    t = torch.arange(40 * block // 4 + 3, dtype=torch.float32)  # 40 whole blocks and 12 bytes
    uri = str(tmp_path / "ck")
    bcp.save({"t": t}, uri, checksum_block_bytes=block)
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 8 * block)
    monkeypatch.setattr(file_backend.FileBackend, "in_memory", lambda self, key, offset, nbytes: True)
    calls: list[int] = []
    real = read_exec.crc32c_c

    def counting(view, value=0):
        calls.append(len(view))
        return real(view, value)

    monkeypatch.setattr(read_exec, "crc32c_c", counting)
    monkeypatch.setattr(whole_reads, "crc32c_c", counting)  # a tensor stored whole: the bulk path
    out = torch.empty_like(t)
    bcp.load({"t": out}, uri)
    assert torch.equal(out, t)
    assert sorted(calls) == [12] + [8 * block] * 5


@settings(max_examples=examples(40), deadline=None)
@given(
    numel=st.integers(1, 3000),
    block=st.sampled_from([16, 64, 256, 1024]),
    chunk_blocks=st.integers(1, 6),
    where=st.floats(0, 1, exclude_max=True),
    box=st.one_of(st.none(), st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True))),
    in_memory=st.booleans(),
)
def test_a_flipped_byte_anywhere_is_named(tmp_path_factory, numel, block, chunk_blocks, where, box, in_memory):
    """One byte flipped anywhere in a fragment that a load reads (whole, or a range of
    it) fails the load with an error naming the tensor, the file and the byte range of
    the block holding it; the same load of the intact file returns the values."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(read_exec, "IN_MEMORY_CHUNK", chunk_blocks * block)
        mp.setattr(file_backend.FileBackend, "in_memory", lambda self, key, offset, nbytes: in_memory)
        t = torch.arange(numel, dtype=torch.float32)
        uri = str(tmp_path_factory.mktemp("flip") / "ck")
        bcp.save({"w": t}, uri, checksum_block_bytes=block)
        frag = bcp.open(uri).catalog.tensors["w"].fragments[0]
        lo, n = 0, numel
        if box is not None:
            lo = int(box[0] * numel)
            n = max(1, int(box[1] * (numel - lo)))
        out = torch.empty(n)
        bcp.open(uri).read_into("w", out, box=((lo,), (n,)))
        assert torch.equal(out, t[lo : lo + n])
        at = lo * 4 + int(where * n * 4)  # a byte the read covers
        b = at // block
        b_lo, b_hi = b * block, min((b + 1) * block, frag.nbytes)
        path = os.path.join(uri, frag.file)
        with open(path, "r+b") as fh:
            fh.seek(frag.byte_offset + at)
            byte = fh.read(1)
            fh.seek(frag.byte_offset + at)
            fh.write(bytes([byte[0] ^ 0x10]))
        span = re.escape(f"[{frag.byte_offset + b_lo}, {frag.byte_offset + b_hi})")
        with pytest.raises(CorruptCheckpointError, match=rf"tensor 'w': file '{re.escape(frag.file)}' .*bytes {span}"):
            bcp.open(uri).read_into("w", out, box=((lo,), (n,)))
    finally:
        mp.undo()


def test_a_load_from_memory_opens_a_data_file_once_per_read(tmp_path, monkeypatch):
    """Ten 2-block pieces of one fragment from memory: one open of the data file, not ten."""
    block = 1024
    t = torch.arange(20 * block // 4, dtype=torch.float32)
    uri = str(tmp_path / "ck")
    bcp.save({"t": t}, uri, checksum_block_bytes=block)
    frag = bcp.open(uri).catalog.tensors["t"].fragments[0]
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 2 * block)
    monkeypatch.setattr(file_backend.FileBackend, "in_memory", lambda self, key, offset, nbytes: True)
    opened: list[str] = []
    real_open = os.open

    def counting_open(path, *a, **k):
        if str(path).endswith(frag.file):
            opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", counting_open)
    out = torch.empty_like(t)
    bcp.load({"t": out}, uri)
    assert torch.equal(out, t)
    assert len(opened) == 1, opened


def test_file_backend_reading_reports_what_read_exact_reports(tmp_path):
    """Backend.reading on files: the bytes; EOFError naming key and offset past the end;
    a missing key is ObjectNotFoundError; large reads go through read_exact."""
    backend = backend_for(str(tmp_path))
    backend.write("obj", bytes(range(256)) * 4)
    buf = bytearray(10)
    with backend.reading("obj") as read:
        read(250, memoryview(buf))
        assert bytes(buf) == (bytes(range(256)) * 4)[250:260]
        with pytest.raises(EOFError, match=r"'obj' .* ended at byte 1024; expected 10 bytes from offset 1020"):
            read(1020, memoryview(buf))
    with pytest.raises(ObjectNotFoundError), backend.reading("missing"):
        pass


@settings(max_examples=examples(40))
@given(
    runs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=12),
    as_array=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_combined_runs_of_any_length_given_as_pairs_or_an_array(runs, as_array, seed):
    """Each run's blocks combined equal the CRC32C of its bytes, for runs as short as a
    load's (the group narrowed to the longest run) and longer than a group, given as
    pairs or as one (k, 2) array (a load's, no pairs built)."""
    data = np.random.default_rng(seed).integers(0, 256, 80 * 64, dtype=np.uint8).tobytes()
    sums = np.array(checksum.block_checksums(data, 64), np.uint32)
    pairs = [(min(a, b), min(a, b) + abs(a - b)) for a, b in runs]
    given_runs = np.array(pairs, np.int64) if as_array else pairs
    want = [checksum.crc32c(data[a * 64 : b * 64]) if b > a else 0 for a, b in pairs]
    assert checksum.combine_block_runs(sums, 64, given_runs) == want


def test_short_runs_gather_only_their_width(monkeypatch):
    """Runs of at most 3 blocks look up 3 positions a run, not checksum.GROUP (32): the
    checksums of 10,000 small tensors combined in a tenth of the work. Failed before:
    every run padded to GROUP."""
    combiner = checksum._combiner(64)
    seen: list[tuple[int, ...]] = []
    flat = combiner._flat

    class Spy(np.ndarray):
        def __getitem__(self, index):
            seen.append(np.shape(index))
            return np.ndarray.__getitem__(self, index)

    monkeypatch.setattr(combiner, "_flat", flat.view(Spy))
    sums = np.arange(1, 20, dtype=np.uint32)
    got = checksum.combine_block_runs(sums, 64, [(0, 3), (4, 6), (10, 11)])
    monkeypatch.setattr(combiner, "_flat", flat)
    assert got == [checksum.combine_blocks(sums[a:b], 64) for a, b in [(0, 3), (4, 6), (10, 11)]]
    assert seen == [(3, 3, 4)]
