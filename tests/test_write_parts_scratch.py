"""The per-tensor costs of a sync save's batched requests (issue 37): the file writer
copies what cannot go out from the tensors' own memory into one scratch mapping kept
from request to request and save to save, at each byte's own position, touching
only the views that span a page; the pipeline reads dense host tensors as arrays."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import bcp.backends.file_writes as fw
from bcp.backends.file import FileBackend
from bcp.io_scheduler import write_pipeline
from helpers import examples

PAGE = 4096


@settings(max_examples=examples(60), deadline=None)
@given(
    parts=st.lists(st.tuples(st.integers(0, 2 * PAGE), st.integers(0, 3 * PAGE + 100)), min_size=1, max_size=10),
    dirty=st.booleans(),
)
def test_whole_pages_are_the_bytes_in_aligned_pages(parts, dirty) -> None:
    """Any views, at any alignment: the output is their bytes, in aligned whole pages;
    a scratch holding an earlier request's bytes leaks none of them; only views that
    span a page boundary have their address taken (the rest are copied as they are)."""
    arena = mmap.mmap(-1, 6 * PAGE)
    arena.write(bytes(range(256)) * (6 * PAGE // 256))
    views = [memoryview(arena)[skip : skip + n] for skip, n in parts]
    data = b"".join(bytes(v) for v in views)
    pad = (-len(data)) % PAGE
    views.append(memoryview(bytearray(pad)))
    nbytes = len(data) + pad
    scratch = memoryview(mmap.mmap(-1, max(nbytes, PAGE)))
    if dirty:
        scratch[:] = b"\xaa" * len(scratch)
    asked: list[int] = []
    address = fw.buffer_address
    original = fw.buffer_address
    fw.buffer_address = lambda v: asked.append(len(v)) or address(v)  # type: ignore[assignment]
    try:
        out = fw.whole_pages(views, nbytes, scratch)
    finally:
        fw.buffer_address = original
    assert b"".join(bytes(o) for o in out) == data + bytes(pad)
    for o in out:
        assert len(o) % PAGE == 0 and fw.buffer_address(o) % PAGE == 0  # type: ignore[operator]
    spanning, at = 0, 0
    for v in views:
        spanning += (at + len(v)) // PAGE > -(-at // PAGE)
        at += len(v)
    assert len(asked) == spanning


def test_one_scratch_mapping_serves_every_request_and_writer(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers, several unaligned requests each: one mapping is made (its pages are
    faulted in once), and each file holds exactly its own bytes."""
    fw.take_scratch(fw.SCRATCH_BYTES)  # the spare of an earlier test, if any, taken away
    made: list[int] = []
    real = mmap.mmap
    monkeypatch.setattr(fw.mmap, "mmap", lambda *a, **k: made.append(a[1]) or real(*a, **k))
    fb = FileBackend(str(tmp_path))
    src = memoryview(bytearray(bytes(range(251)) * 200))  # not page-aligned: every byte copied
    for key, shift in (("a", 1), ("b", 7)):
        chunks = [src[shift + i * 3 : shift + i * 3 + 5000] for i in range(3)]
        writer = fb.open_writer(key, size=3 * 3 * 4096)
        expected = b""
        for r, part in enumerate(chunks):
            body = bytes(part[:4096]) * 3  # three whole pages a request
            writer.write_parts(r * 3 * 4096, [memoryview(body)[:5000], memoryview(body)[5000:]])  # type: ignore[attr-defined]
            expected += body
        writer.commit()
        with open(tmp_path / key, "rb") as f:
            assert f.read() == expected
    assert made == [fw.SCRATCH_BYTES]


@pytest.mark.parametrize("block", [256, 4096])
def test_batched_save_reads_dense_tensors_without_flat_byte_tensors(tmp_path, block, monkeypatch) -> None:
    """A sync save of dense host tensors takes no flat uint8 tensor per tensor (numpy
    arrays of their memory); a non-dense one still does; every block sum is right (the
    load verifies each), for tensors below, at and above one checksum block."""
    flat: list[int] = []
    original = write_pipeline.WritePipeline._flat_source
    monkeypatch.setattr(
        write_pipeline.WritePipeline, "_flat_source", lambda self, i: flat.append(i) or original(self, i)
    )
    g = torch.Generator().manual_seed(0)
    state = {f"t{n}": torch.randn(n, generator=g) for n in (0, 1, 63, 64, 65, 1000, 3000)}
    state["odd"] = torch.randn(40, 30, generator=g).t()  # not contiguous
    state["half"] = torch.randn(999, generator=g).to(torch.bfloat16)  # no numpy twin
    bcp.save(state, str(tmp_path / "c"), checksum_block_bytes=block)
    assert len(flat) == 1  # the transposed one
    got = bcp.load({k: torch.empty_like(v) for k, v in state.items()}, str(tmp_path / "c"))
    for k, v in state.items():
        assert torch.equal(got[k], v), k


@settings(max_examples=examples(60), deadline=None)
@given(lengths=st.lists(st.integers(0, 50), max_size=8), data=st.data())
def test_cut_end_splits_as_cut_does(lengths, data) -> None:
    """Cutting the last n bytes off gives the bytes :func:`cut` gives at total - n;
    ``byte_views`` keeps flat byte views and flattens the others, dropping empty ones."""
    src = bytes(range(256)) * 2
    views, at = [], 0
    for n in lengths:
        views.append(memoryview(src)[at : at + n])
        at += n
    total = sum(lengths)
    n = data.draw(st.integers(0, total))
    head, tail = fw.cut_end(views, n)
    ref_head, ref_tail = fw.cut(views, total - n)
    assert b"".join(map(bytes, head)) == b"".join(map(bytes, ref_head)) == src[: total - n]
    assert b"".join(map(bytes, tail)) == b"".join(map(bytes, ref_tail)) == src[total - n : total]
    assert len(tail) <= len(views)
    grid = memoryview(bytearray(src[:24])).cast("B", (4, 6))
    flat = fw.byte_views([*views, grid, memoryview(b"")])
    assert b"".join(map(bytes, flat)) == src[:total] + src[:24]
    assert all(v.ndim == 1 and v.format == "B" and len(v) for v in flat)


def test_a_forked_child_and_its_parent_share_no_scratch_memory() -> None:
    """The spare scratch mapping survives a fork in both processes: it must be private
    to each (copy-on-write), or a child's save and its parent's, both taking the spare,
    copy into the same pages and each writes the other's bytes into its file."""
    fw.give_scratch(fw.take_scratch(fw.SCRATCH_BYTES))  # a spare, as a sync save leaves one
    spare = fw.take_scratch(PAGE)
    spare[:PAGE] = b"\x11" * PAGE
    fw.give_scratch(spare)
    pid = os.fork()
    if pid == 0:  # the child: a save of its own copies into the spare
        try:
            mine = fw.take_scratch(PAGE)
            mine[:PAGE] = b"\x22" * PAGE
            fw.give_scratch(mine)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    ours = fw.take_scratch(PAGE)
    assert bytes(ours[:PAGE]) == b"\x11" * PAGE  # the parent's pages hold the parent's bytes
    fw.give_scratch(ours)
    made = fw.whole_pages([memoryview(bytearray(b"\x33" * PAGE))[1:], memoryview(b"\x44")], PAGE)
    pid = os.fork()
    if pid == 0:
        try:
            made[0][:1] = b"\x55"  # a child writing into a mapping whole_pages made
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert bytes(made[0][:1]) == b"\x33"
