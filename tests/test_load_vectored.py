"""Vectored reads of tensors back to back in a data file (issue 37, per-tensor costs):
a bulk load from memory reads adjacent small tensors with one ``preadv`` per group
(``read_into_many`` on the file backend's reader; one read per buffer for any other
backend), still verifying every tensor and naming the tensor a truncation or a
corrupt byte hits."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp import reader as reader_module
from bcp.backends import backend_for, file_reads, read_into_many
from bcp.backends.wrappers import ForwardingBackend
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import whole_reads
from helpers import examples


def counting_preadv(monkeypatch, most: int | None = None) -> list[int]:
    """The number of buffers of every os.preadv call (``most``: return at most that many
    bytes a call, a short read each time)."""
    calls: list[int] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        buffers = list(buffers)
        calls.append(len(buffers))
        if most is not None and not flags:
            scratch = bytearray(most)
            n = real(fd, [scratch], offset)
            done = 0
            for b in buffers:
                view = memoryview(b).cast("B")
                take = min(len(view), n - done)
                view[:take] = scratch[done : done + take]
                done += take
            return n
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def resident_file_backend(root: str):
    """The file backend, every range said to be in memory (the vectored path's case)."""
    backend = backend_for(root)
    backend.in_memory = lambda key, offset, nbytes: True  # type: ignore[method-assign]
    return backend


def saved(root: str, state: dict[str, torch.Tensor], block: int = 1024) -> None:
    bcp.save(state, root, checksum_block_bytes=block)


def data_file(root: str, fqn: str):
    frag = bcp.open(root).catalog.tensors[fqn].fragment(0)
    return Path(root) / frag.file, frag


@settings(max_examples=examples(40), deadline=None)
@given(
    sizes=st.lists(st.integers(1, 900), min_size=1, max_size=80),
    block=st.sampled_from([64, 1024, 1 << 16]),
    seed=st.integers(0, 2**16),
)
def test_vectored_bulk_load_gives_the_saved_values(sizes, block, seed):
    """Random counts and sizes of tensors back to back: the vectored load gives exactly
    what a load one read per tensor (the default reader) gives, the saved values."""
    g = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    with tempfile.TemporaryDirectory() as root:
        saved(root, state, block)
        mp = pytest.MonkeyPatch()
        try:
            calls = counting_preadv(mp)
            vectored = {k: torch.zeros_like(v) for k, v in state.items()}
            bcp.load(vectored, resident_file_backend(root))
        finally:
            mp.undo()
        planned = {k: torch.zeros_like(v) for k, v in state.items()}
        bcp.load(planned, ForwardingBackend(resident_file_backend(root)))
    for k, v in state.items():
        assert torch.equal(vectored[k], v), k
        assert torch.equal(planned[k], v), k
    if len(sizes) > 1:
        assert max(calls) > 1  # some preadv filled several tensors


def test_a_load_of_many_adjacent_tensors_makes_few_preadv_calls(tmp_path, monkeypatch):
    """600 small tensors back to back, in memory: far fewer preadv calls than tensors."""
    state = {f"t{i:03d}": torch.full((5 + i % 7,), float(i)) for i in range(600)}
    saved(str(tmp_path), state)
    calls = counting_preadv(monkeypatch)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(dest, resident_file_backend(str(tmp_path)))
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert sum(calls) >= 600 and len(calls) < 60, (len(calls), sum(calls))


def test_a_truncated_file_names_the_tensor_it_cuts(tmp_path, monkeypatch):
    """The data file ends inside one tensor of a vectored run (cut after the load
    checked its size): the load fails naming that tensor, not the first of the run."""
    state = {f"t{i:02d}": torch.randn(10) for i in range(40)}
    root = str(tmp_path)
    saved(root, state)
    path, frag = data_file(root, "t23")
    real = whole_reads.execute_whole_reads

    def cut_then_read(*a, **k):
        os.truncate(path, frag.byte_offset + 12)
        return real(*a, **k)

    monkeypatch.setattr(reader_module, "execute_whole_reads", cut_then_read)
    calls = counting_preadv(monkeypatch)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError, match=r"'t23'.*truncated") as info:
        bcp.load(dest, resident_file_backend(root))
    assert info.value.fqn == "t23" and info.value.offset == frag.byte_offset
    assert max(calls) > 1  # the vectored read ran, and failed


def test_a_flipped_byte_names_its_tensor_after_a_vectored_read(tmp_path, monkeypatch):
    state = {f"t{i:02d}": torch.randn(10) for i in range(40)}
    root = str(tmp_path)
    saved(root, state)
    path, frag = data_file(root, "t31")
    data = bytearray(path.read_bytes())
    data[frag.byte_offset + 5] ^= 0x5A
    path.write_bytes(bytes(data))
    calls = counting_preadv(monkeypatch)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError, match=r"'t31'") as info:
        bcp.load(dest, resident_file_backend(root))
    assert info.value.fqn == "t31" and info.value.offset == frag.byte_offset
    assert max(calls) > 1


@pytest.mark.parametrize("where", ["memory", "wrapped file"])
def test_a_reader_without_read_into_many_reads_one_buffer_at_a_time(where, tmp_path):
    data = bytes(range(256)) * 3
    if where == "memory":
        backend = backend_for("memory://vectored-default/x")
    else:
        backend = ForwardingBackend(backend_for(str(tmp_path)))
    backend.write("obj", data)
    bufs = [memoryview(bytearray(n)) for n in (1, 0, 30, 200, 7)]
    with backend.reading("obj") as read:
        assert not hasattr(read, "read_into_many")
        read_into_many(read, 100, bufs)
        assert b"".join(bytes(b) for b in bufs) == data[100:338]
        with pytest.raises(EOFError, match=r"'obj' .* ended at byte 768"):
            read_into_many(read, 700, bufs)


def test_the_file_reader_makes_one_preadv_per_iov_max_buffers(tmp_path, monkeypatch):
    backend = backend_for(str(tmp_path))
    data = os.urandom(5000)
    backend.write("obj", data)
    bufs = [memoryview(bytearray(2)) for _ in range(2 * file_reads.IOV_MAX + 5)]
    calls = counting_preadv(monkeypatch)
    with backend.reading("obj") as read:
        read_into_many(read, 7, bufs)
    assert calls == [file_reads.IOV_MAX, file_reads.IOV_MAX, 5]
    assert b"".join(bytes(b) for b in bufs) == data[7 : 7 + 2 * len(bufs)]


def test_the_file_reader_loops_on_short_reads_and_reports_the_end(tmp_path, monkeypatch):
    backend = backend_for(str(tmp_path))
    data = os.urandom(1000)
    backend.write("obj", data)
    calls = counting_preadv(monkeypatch, most=37)
    bufs = [memoryview(bytearray(n)) for n in (50, 3, 0, 100, 1, 90)]
    with backend.reading("obj") as read:
        read.read_into_many(10, bufs)
        assert b"".join(bytes(b) for b in bufs) == data[10:254]
        assert len(calls) == -(-244 // 37)
        with pytest.raises(EOFError, match=r"'obj' .* ended at byte 1000; expected 244 bytes from offset 900"):
            read.read_into_many(900, bufs)


def test_the_file_reader_passes_flat_byte_views_to_preadv_as_they_are(tmp_path, monkeypatch):
    """A flat byte view (the bulk load's) goes to ``preadv`` as it is, not cast again
    (that cast was half the call's cost per tensor); any other buffer is cast."""
    backend = backend_for(str(tmp_path))
    backend.write("obj", os.urandom(64))
    flat = [memoryview(bytearray(8)) for _ in range(3)]
    floats = memoryview(bytearray(8)).cast("f")
    seen: list[list] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off, *f: seen.append(list(bufs)) or real(fd, bufs, off, *f))
    with backend.reading("obj") as read:
        read.read_into_many(0, [*flat, floats])
    assert all(a is b for a, b in zip(seen[0][:3], flat, strict=True))
    assert seen[0][3] is not floats and seen[0][3].format == "B"


@settings(max_examples=examples(40), deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["bytearray", "flat", "floats", "matrix", "slice"]), min_size=1, max_size=8),
    most=st.sampled_from([None, 5, 64]),
    offset=st.integers(0, 40),
)
def test_read_into_many_fills_every_kind_of_buffer_with_short_reads(kinds, most, offset):
    """Every kind of writable buffer (a bytearray, a flat byte view, a float view, a 2-D
    byte matrix, a slice of a larger view) gets exactly its bytes, reads short or not."""
    import numpy as np

    with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as mp:
        backend = backend_for(root)
        data = os.urandom(400)
        backend.write("obj", data)
        counting_preadv(mp, most)
        bufs: list = []
        for kind in kinds:
            if kind == "bytearray":
                bufs.append(bytearray(7))
            elif kind == "flat":
                bufs.append(memoryview(bytearray(9)))
            elif kind == "floats":
                bufs.append(memoryview(bytearray(12)).cast("f"))
            elif kind == "matrix":
                bufs.append(memoryview(np.zeros((3, 4), np.uint8)))
            else:
                bufs.append(memoryview(bytearray(20))[5:11])
        with backend.reading("obj") as read:
            read.read_into_many(offset, bufs)
        got = b"".join(memoryview(b).cast("B").tobytes() if not isinstance(b, bytearray) else bytes(b) for b in bufs)
        assert got == data[offset : offset + len(got)]
