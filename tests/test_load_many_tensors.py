"""Loads of many small tensors (issue 37): adjacent fragments of one file cost one
request, a coalesced request never reads past its budget or outside the file, every
byte still lands and is verified, and the per-tensor work stays off the storage path
(one open file per request from memory, no bounce copy for a cold coalesced read)."""

from __future__ import annotations

import uuid
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for, file_reads
from bcp.backends import file as file_backend
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec
from bcp.io_scheduler.read_plan import RunSet
from bcp.metadata import Fragment, crc32c
from helpers import examples
from recording_backend import Recording

layouts = st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 5000)), min_size=1, max_size=12)


@settings(max_examples=examples(60), deadline=None)
@given(
    layout=layouts,
    data=st.data(),
    block=st.sampled_from([64, 256, 1024]),
    below=st.integers(1, 4000),
    limit=st.integers(1, 12000),
    streams=st.sampled_from([1, 3]),
    resident=st.booleans(),
)
def test_coalesced_reads_load_the_saved_bytes_within_budget_and_file(
    layout, data, block, below, limit, streams, resident
):
    """Random fragments (sizes, gaps) in one file, random runs of them, random
    coalescing thresholds and budgets: every destination gets exactly the saved bytes,
    no request exceeds the budget unless it holds a single part, no read leaves the
    file, and a flipped byte inside a read run is named."""
    uri = f"memory://many-{uuid.uuid4().hex[:8]}/ck"
    backend = Recording(backend_for(uri), resident)
    frags, pos = [], 0
    for i, (n, gap) in enumerate(layout):
        pos += gap
        frags.append((i, pos, n))
        pos += n
    size = pos + data.draw(st.integers(0, 100), label="tail")
    content = bytearray(np.random.default_rng(len(layout) + size).integers(0, 256, size, np.uint8).tobytes())
    fragments = [
        Fragment(
            f"t{i}",
            "[]",
            "uint8",
            (n,),
            (0,),
            (n,),
            "d.bin",
            off,
            n,
            tuple(crc32c(content[off + b : off + min(b + block, n)]) for b in range(0, n, block)),
        )
        for i, off, n in frags
    ]
    plans, views, want = [], [], []
    for frag in fragments:
        if not data.draw(st.booleans(), label="read"):
            continue
        s = data.draw(st.integers(0, frag.nbytes - 1), label="start")
        n = data.draw(st.integers(1, frag.nbytes - s), label="n")
        plans.append(RunSet(frag, len(views), np.array([s], np.int64), np.zeros(1, np.int64), n))
        views.append(memoryview(bytearray(n)))
        want.append(bytes(content[frag.byte_offset + s : frag.byte_offset + s + n]))
    bad = data.draw(st.none() | st.integers(0, max(len(plans) - 1, 0)), label="bad") if plans else None
    if bad is not None:
        flip = plans[bad].fragment.byte_offset + int(plans[bad].src[0])
        content[flip] ^= 0xFF
    backend.write("d.bin", bytes(content))
    with (
        mock.patch.object(read_exec, "COALESCE_BELOW", below),
        mock.patch.object(read_exec, "COALESCE_BYTES", limit),
        mock.patch.object(read_exec, "COALESCE_BUDGET", limit * streams),
    ):
        if bad is not None:
            with pytest.raises(CorruptCheckpointError, match=rf"tensor '{plans[bad].fragment.fqn}'"):
                read_exec.execute_reads(backend, plans, views, block_bytes=block, streams=streams)
            return
        read_exec.execute_reads(backend, plans, views, block_bytes=block, streams=streams)
    assert [bytes(v) for v in views] == want
    budget = max(below, limit)
    largest = max((p.nbytes for p in plans), default=0)
    for key, offset, n in backend.reads:
        assert key == "d.bin" and offset >= 0 and offset + n <= size, (offset, n, size)
        assert n <= max(budget, largest, block), (n, budget, largest)


def small_state(n: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"t{i:03d}": torch.randn(numel + (i % 7), generator=g) for i in range(n)}


def test_adjacent_small_fragments_in_one_file_cost_one_read_request(tmp_path):
    """40 small tensors saved by one stream: a cold load fetches their file in one request."""
    state = small_state(40, 300)
    uri = str(tmp_path / "ck")
    bcp.save(state, uri, streams=1)
    backend = Recording(backend_for(uri), resident=False)
    info_reads_before = len(backend.reads)
    got = bcp.open(backend).read_tensors(list(state))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    data = [r for r in backend.reads[info_reads_before:] if r[0].endswith(".bin")]
    assert len(data) == 1, data


def test_small_tensors_read_from_memory_open_their_file_once_per_request(tmp_path, monkeypatch):
    """Parts of a coalesced request found in memory are read in place through one open
    file, not one open (and its path checks) per tensor."""
    monkeypatch.setattr(file_backend, "is_cached", lambda *a: True)
    state = small_state(24, 20_000)  # ~80 KiB each: read in place from memory
    uri = str(tmp_path / "ck")
    bcp.save(state, uri, streams=1)
    opens = []
    real = file_backend.FileBackend._open_for_read

    def counting(self, key, path):
        if key.endswith(".bin"):
            opens.append(key)
        return real(self, key, path)

    monkeypatch.setattr(file_backend.FileBackend, "_open_for_read", counting)
    reader = bcp.open(uri)
    got = reader.read_tensors(list(state))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert len(opens) <= 4, f"{len(opens)} opens of the data file for {len(state)} tensors"


def test_a_cold_coalesced_read_lands_o_direct_without_a_bounce_copy(tmp_path, monkeypatch):
    """The scratch memory of a coalesced request agrees with its file offset modulo the
    page size, so the file backend reads it O_DIRECT in place, not through its bounce buffer."""
    monkeypatch.setattr(file_backend, "is_cached", lambda *a: False)
    monkeypatch.setattr(file_backend, "on_memory_fs", lambda fd: False)
    bounced = []
    real = file_reads.pread_bounced
    monkeypatch.setattr(file_reads, "pread_bounced", lambda *a: bounced.append(a[2]) or real(*a))
    state = small_state(12, 250_000)  # ~1 MiB each, 12 MiB in one coalesced request
    uri = str(tmp_path / "ck")
    bcp.save(state, uri, streams=1)
    backend = Recording(backend_for(uri), resident=False)
    got = bcp.open(backend).read_tensors(list(state))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    data = [r for r in backend.reads if r[0].endswith(".bin")]
    assert len(data) == 1 and data[0][2] >= 4 << 20, data
    assert bounced == [], f"bounced at file offsets {bounced}"


def test_load_cpu_bench_prints_the_rows_the_issue_asks_for(tmp_path):
    """bench/load_cpu.py: one row per count and the transformer's cold and warm rows,
    CPU and wall seconds side by side, and the ratio line; no files left behind."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "load_cpu.py"
    args = ["--gib", "0.002", "--counts", "10,100", "--calls", "1", "--dir", str(tmp_path)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    rows = [ln.split("|")[1].strip() for ln in lines if ln.startswith("| ") and not ln.startswith("| load")]
    assert rows[:2] == ["page cache, 10 tensors", "page cache, 100 tensors"], lines
    assert [r.rsplit(", ", 1)[-1] for r in rows[2:]] == ["cold", "warm"], lines
    assert re.fullmatch(r"load_cpu: 100/10 cpu [0-9.]+x wall [0-9.]+x", lines[-1]), lines[-1]
    assert list(tmp_path.iterdir()) == []


def test_plain_tensor_leaves_are_matched_without_the_shard_machinery(tmp_path, monkeypatch):
    """A plain tensor or Parameter leaf asks for its whole tensor directly; a subclass
    of torch.Tensor still goes through local_pieces; every value loads."""
    import bcp.loader

    class Sub(torch.Tensor):
        pass

    state = {"a": torch.randn(3, 4), "p": torch.nn.Parameter(torch.randn(5)), "s": torch.randn(2).as_subclass(Sub)}
    uri = str(tmp_path / "ck")
    bcp.save(state, uri)
    seen = []
    real = bcp.loader.local_pieces
    monkeypatch.setattr(bcp.loader, "local_pieces", lambda v, fqn: seen.append(fqn) or real(v, fqn))
    dst = {"a": torch.zeros(3, 4), "p": torch.nn.Parameter(torch.zeros(5)), "s": torch.zeros(2).as_subclass(Sub)}
    bcp.load(dst, uri)
    assert seen == ["s"]
    assert all(torch.equal(dst[k].detach(), v.detach()) for k, v in state.items())


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 1, 4)])
def test_the_whole_fragment_plan_holds_the_catalog_row(tmp_path, shape):
    """The usual plan (one writer saved the tensor whole, all of it wanted) carries the
    very row the catalog holds: same file, offset, size, checksums, box."""
    from bcp.io_scheduler.read_plan import plan_tensor_reads

    t = torch.randn(shape)
    uri = str(tmp_path / "ck")
    bcp.save({"t": t}, uri, checksum_block_bytes=16)
    entry = bcp.open(uri).catalog.tensors["t"]
    (plan,) = plan_tensor_reads(entry, [((0,) * len(shape), shape)], dest=3)
    assert plan.fragment == entry.fragment(0) and plan.dest == 3
    assert plan.src.tolist() == [0] and plan.dst.tolist() == [0] and plan.run_bytes == t.numel() * 4
