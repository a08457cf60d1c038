"""A part read from memory in pieces (read_exec._read_pieces): what each piece's check
expects is computed for all its pieces in one vectorised pass (checksum.combine_block_runs),
and a piece costs one read and its CRC calls, no per-piece wrapper. Every block is still
verified, a flipped byte anywhere is named by tensor, file and block, and the values equal
those of the general per-piece loop."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec, whole_reads
from bcp.metadata import checksum
from test_memory_reads import Resident, corrupt, with_streams


@given(
    data=st.binary(min_size=0, max_size=3000),
    block=st.integers(1, 97),
    runs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=12),
)
def test_combined_runs_equal_the_crc_of_their_blocks(data, block, runs):
    """Each run's combination is CRC32C of its blocks' bytes, whether every run fits one
    group (the vectorised pass) or not (one combine per run); an empty run gives 0."""
    n = len(data) // block
    sums = checksum.block_checksums(data[: n * block], block)
    runs = [(min(a, b, n), min(max(a, b), n)) for a, b in runs]
    want = [checksum.crc32c(data[a * block : b * block]) for a, b in runs]
    assert checksum.combine_block_runs(sums, block, runs) == want
    assert checksum.combine_block_runs(np.array(sums, np.uint32), block, runs) == want
    long_run = [*runs, (0, n)] if n > checksum.GROUP else runs
    assert checksum.combine_block_runs(sums, block, long_run) == [
        checksum.crc32c(data[a * block : b * block]) for a, b in long_run
    ]


def _save(t: torch.Tensor, block: int) -> str:
    uri = f"memory://mem-pieces-{uuid.uuid4().hex[:8]}/ck"
    bcp.save({"t": t}, uri, checksum_block_bytes=block)
    return uri


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 30),
    cols=st.integers(1, 40),
    row_box=st.tuples(st.integers(0, 29), st.integers(1, 30)),
    block=st.sampled_from([4, 16, 64, 256]),
    chunk_blocks=st.integers(1, 6),
    streams=st.sampled_from([1, 2]),
    bad=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
)
def test_pieces_from_memory_verify_every_byte_and_equal_the_general_loop(
    rows, cols, row_box, block, chunk_blocks, streams, bad
):
    """Rows [r0, r0 + nr) of a (rows, cols) tensor (a part starting anywhere in the
    fragment, ending anywhere, its last block short or not): loaded from memory in
    pieces of ``chunk_blocks`` blocks, the values equal the saved ones and those the
    general loop reads; a byte flipped anywhere in the blocks the box touches fails the
    load naming that block, in both paths."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(read_exec, "IN_MEMORY_CHUNK", chunk_blocks * block)
        with_streams(mp, streams)
        t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
        r0 = min(row_box[0], rows - 1)
        nr = min(row_box[1], rows - r0)
        uri = _save(t, block)
        frag = bcp.open(uri).catalog.tensors["t"].fragments[0]
        lo, hi = r0 * cols * 4, (r0 + nr) * cols * 4
        touched = range(lo // block, (hi - 1) // block + 1)
        box = ((r0, 0), (nr, cols))
        if bad is not None:
            b = touched[int(bad * len(touched))]
            b_lo, b_hi = b * block, min((b + 1) * block, frag.nbytes)
            corrupt(uri, frag.file, frag.byte_offset + b_lo + int(bad * 7919) % (b_hi - b_lo))
            span = rf"'t'.*'{frag.file}'.*\[{frag.byte_offset + b_lo}, {frag.byte_offset + b_hi}\)"
        for group in (checksum.GROUP, 0):  # 0: the general per-piece loop
            mp.setattr(read_exec, "GROUP", group)
            out = torch.full((nr, cols), -1.0)
            reader = bcp.open(Resident(backend_for(uri)))
            if bad is None:
                reader.read_into("t", out, box=box)
                assert torch.equal(out, t[r0 : r0 + nr])
            else:
                with pytest.raises(CorruptCheckpointError, match=span) as info:
                    reader.read_into("t", out, box=box)
                assert info.value.fqn == "t" and info.value.file == frag.file
                assert info.value.offset == frag.byte_offset + b_lo
    finally:
        mp.undo()


def test_a_part_read_from_memory_costs_no_wrapper_and_one_combine_per_part(monkeypatch):
    """A 64 KiB tensor read from memory in 16 pieces: no ``_read`` or ``_check_blocks``
    per piece and one combination pass for all of them (the general loop called both
    per piece and combined each piece's checksums on its own)."""
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 4096)
    with_streams(monkeypatch, 1)
    calls: list[str] = []
    for module, fn in [(m, f) for m in (read_exec, whole_reads) for f in ("combine_blocks", "combine_block_runs")] + [
        (read_exec, "_read"),
        (read_exec, "_check_blocks"),
    ]:  # a whole tensor goes through the bulk path (whole_reads), which reads in pieces the same way
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, real=real, fn=fn, **k: calls.append(fn) or real(*a, **k))
    t = torch.randn(64, 256)
    uri = _save(t, 1024)
    backend = Resident(backend_for(uri))
    got = bcp.open(backend).read("t")
    assert torch.equal(got, t)
    assert sorted(n for _k, _o, n in backend.data_reads) == [4096] * 16
    assert calls == ["combine_block_runs"], calls


def test_a_file_cut_short_inside_a_piece_names_the_tensor_and_offset():
    """A read from memory that finds the file ending early fails naming the tensor,
    the file and the piece's offset, never returning bytes that were not read."""
    t = torch.randn(64, 256)
    uri = _save(t, 1024)
    frag = bcp.open(uri).catalog.tensors["t"].fragments[0]
    cut = frag.byte_offset + 5 * 4096

    class EndsAtCut(Resident):
        def read_exact(self, key, offset, buffer):
            if key == frag.file and offset == cut:
                raise EOFError(f"{key!r} ended at byte {offset + 3}")
            super().read_exact(key, offset, buffer)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(read_exec, "IN_MEMORY_CHUNK", 4096)
        with pytest.raises(CorruptCheckpointError, match=r"'t'.*truncated") as info:
            bcp.open(EndsAtCut(backend_for(uri))).read("t")
    finally:
        mp.undo()
    assert info.value.fqn == "t" and info.value.file == frag.file and info.value.offset == cut
