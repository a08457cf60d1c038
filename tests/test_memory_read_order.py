"""Reads from memory on several streams go largest first (read_exec.execute_reads): each
stream takes the next read when done, so the last to start are the smallest and no core
copies a large piece alone at the end. From storage they stay in file order. Every byte is
still verified: a flipped byte in any piece of any tensor is named by tensor and block."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec, whole_reads
from test_memory_reads import Resident, corrupt, with_streams

BLOCK = 256


def _setup(mp: pytest.MonkeyPatch, piece: int) -> list[tuple[str, int, int]]:
    """Big reads cut into ``piece`` bytes, none coalesced, none on the bulk path; 2 streams.
    Returns the (file, offset, bytes) of each request in the order the streams start them."""
    mp.setattr(read_exec, "READ_PIECE_BYTES", piece)
    mp.setattr(read_exec, "IN_MEMORY_CHUNK", 2 * BLOCK)
    mp.setattr(whole_reads, "BULK_LARGEST", 0)  # every tensor planned (none on the bulk path) ...
    real_coalesce = read_exec.coalesce
    mp.setattr(read_exec, "coalesce", lambda parts, **k: real_coalesce(parts, **k, below=0))  # ... one request a part
    mp.setattr(read_exec, "usable_cpus", lambda: 2)
    with_streams(mp, 2)
    started: list[tuple[str, int, int]] = []
    lock = threading.Lock()
    real = read_exec._fetch

    def fetch(backend, request, name, block):
        with lock:
            started.append((request.file, request.offset, request.nbytes))
        return real(backend, request, name, block)

    mp.setattr(read_exec, "_fetch", fetch)
    return started


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=2, max_size=6),
    piece_blocks=st.integers(1, 8),
    resident=st.booleans(),
)
def test_reads_from_memory_start_largest_first_and_from_storage_in_file_order(sizes, piece_blocks, resident):
    mp = pytest.MonkeyPatch()
    try:
        started = _setup(mp, piece_blocks * BLOCK)
        g = torch.Generator().manual_seed(len(sizes))
        state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
        uri = f"memory://mem-order-{uuid.uuid4().hex[:8]}/ck"
        bcp.save(state, uri, checksum_block_bytes=BLOCK)
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        bcp.load(dst, Resident(backend_for(uri), resident))
        assert all(torch.equal(dst[k], v) for k, v in state.items())
        assert sum(n for _f, _o, n in started) == sum(4 * n for n in sizes)
        if resident:
            assert [n for _f, _o, n in started] == sorted((n for _f, _o, n in started), reverse=True)
        else:
            assert started == sorted(started)
    finally:
        mp.undo()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(64, 3000), min_size=1, max_size=4),
    piece_blocks=st.integers(1, 6),
    which=st.integers(0, 3),
    where=st.floats(0, 1, exclude_max=True),
)
def test_a_flipped_byte_in_any_piece_from_memory_is_named(sizes, piece_blocks, which, where):
    """Whichever piece (first, middle, last, short last block) holds the flipped byte,
    the load fails naming the tensor and the block's byte range in the file."""
    mp = pytest.MonkeyPatch()
    try:
        _setup(mp, piece_blocks * BLOCK)
        g = torch.Generator().manual_seed(len(sizes) + which)
        state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
        uri = f"memory://mem-order-bad-{uuid.uuid4().hex[:8]}/ck"
        bcp.save(state, uri, checksum_block_bytes=BLOCK)
        fqn = f"t{which % len(sizes)}"
        frag = bcp.open(uri).catalog.tensors[fqn].fragments[0]
        at = int(where * frag.nbytes)
        corrupt(uri, frag.file, frag.byte_offset + at)
        lo = frag.byte_offset + at // BLOCK * BLOCK
        hi = min(lo + BLOCK, frag.byte_offset + frag.nbytes)
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        with pytest.raises(CorruptCheckpointError, match=rf"'{fqn}'.*\[{lo}, {hi}\)") as err:
            bcp.load(dst, Resident(backend_for(uri), True))
        assert err.value.fqn == fqn and err.value.file == frag.file and err.value.offset == lo
    finally:
        mp.undo()
