"""An async save's blocking part costs little Python per tensor (issue 37, item 4).

A steady-state ``async_save`` (the structure's plan kept, ``bcp.kept_plans``) stages a
chunk of dense host tensors by raw copies planned once (``Chunk.copies``): one
``memmove`` a tensor, the padding zeroed, no numpy or torch object per tensor. Counted,
not timed: the Python-level calls (functions and C functions) the calling thread makes
per extra tensor. And the copies stay exact: values at the call, every dtype, tensors
split over slabs, padding zero whatever the slab held before.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.io_scheduler.staging import StagingPool
from bcp.planning.cache import clear_plan_caches
from helpers import examples, tensor_bytes_equal

#: Python-level calls (``call`` and ``c_call`` profile events) the calling thread makes per
#: extra tensor in a steady-state async save of small host tensors. 21 before staging by
#: raw copies, 14 before flattening took plain tensors of str-keyed dicts inline, 11 before the
#: fingerprint was read in columns and the kept plan's items made only when read; now: flattening (1).
CALLS_PER_TENSOR = 1.5


def steady_calls(root: str, n: int) -> int:
    """Calls the caller's thread makes in the second async save of ``n`` small tensors."""
    g = torch.Generator().manual_seed(n)
    sizes = torch.randint(1, 300, (n,), generator=g).tolist()
    state = {f"t{i}": torch.randn(k, generator=g) for i, k in enumerate(sizes)}
    uri = os.path.join(root, f"n{n}")
    bcp.async_save(state, uri).wait()  # plans and keeps the structure
    count = 0
    me = threading.get_ident()

    def profile(_frame, event, _arg):
        nonlocal count
        if event in ("call", "c_call") and threading.get_ident() == me:
            count += 1

    sys.setprofile(profile)
    try:
        handle = bcp.async_save(state, uri, overwrite=True)
    finally:
        sys.setprofile(None)
    handle.wait()
    loaded = bcp.open(uri).state()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    return count


def test_steady_async_save_makes_few_python_calls_per_tensor(tmp_path):
    clear_plan_caches()
    few, many = steady_calls(str(tmp_path), 100), steady_calls(str(tmp_path), 500)
    per_tensor = (many - few) / 400
    assert per_tensor <= CALLS_PER_TENSOR, f"{per_tensor:.1f} calls per tensor"


def test_staging_by_runs_is_used_only_in_the_calling_thread(tmp_path):
    """The raw copies read the plan's addresses: valid during the call. Staging in
    another thread (an overlapped save's rest) reads the tensors as they are then."""
    from bcp.io_scheduler import write_pipeline

    calls: list[int] = []
    real = write_pipeline.WritePipeline._stage_runs

    def counting(self, chunk, copies):
        calls.append(threading.get_ident())
        return real(self, chunk, copies)

    clear_plan_caches()
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "extra": torch.arange(7.0)}
    try:
        write_pipeline.WritePipeline._stage_runs = counting  # type: ignore[method-assign]
        for _ in range(2):
            bcp.async_save(state, str(tmp_path / "x"), overwrite=True, overlap=opt).wait()
    finally:
        write_pipeline.WritePipeline._stage_runs = real  # type: ignore[method-assign]
    assert calls and set(calls) == {threading.get_ident()}
    loaded = bcp.open(str(tmp_path / "x")).state()
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_padding_is_zero_whatever_the_slab_held(tmp_path):
    """Slabs reused from a save of 0xFF bytes: the next save's padding is zeros (the
    bytes of a data file that are not a tensor's are all zero)."""
    pool = StagingPool(1 << 20, slab_bytes=256 << 10)
    clear_plan_caches()
    full = {"f": torch.full((1 << 20,), 255, dtype=torch.uint8)}
    bcp.async_save(full, str(tmp_path / "ff"), pool=pool).wait()
    state = {f"t{i}": torch.full((3 * i + 1,), 0x5A, dtype=torch.uint8) for i in range(200)}
    state["big"] = torch.full((70_001,), 0x5A, dtype=torch.uint8)  # page-aligned: long padding before it
    for _ in range(2):  # planned, then the kept plan's runs
        bcp.async_save(state, str(tmp_path / "x"), pool=pool, overwrite=True).wait()
        data = [os.path.join(d, f) for d, _s, fs in os.walk(tmp_path / "x") for f in fs if f.endswith(".bin")]
        assert len(data) == 1
        with open(data[0], "rb") as f:
            raw = f.read()
        tensor_bytes = sum(t.numel() for t in state.values())
        assert len(raw) > tensor_bytes  # there is padding
        assert len(raw) - raw.count(0) == tensor_bytes and raw.count(0x5A) == tensor_bytes


DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float64, torch.complex64)


@settings(max_examples=examples(20), deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.sampled_from(DTYPES), st.sampled_from([0, 1, 3, 17, 100, 1000, 20_000]), st.sampled_from(["", "t", "v"])
        ),
        min_size=1,
        max_size=12,
    ),
    slab_kib=st.sampled_from([64, 128, 1024]),
)
def test_async_saves_by_runs_hold_the_values_at_each_call(tmp_path_factory, specs, slab_kib):
    """Mixed dtypes and sizes (empty, tiny, split over slabs), dense or not (a transposed
    view, a view tied to another entry); each of three saves of the same structure holds
    the values at its call, though every tensor changes right after it."""
    root = tmp_path_factory.mktemp("runs")
    pool = StagingPool(8 << 20, slab_bytes=slab_kib << 10)
    g = torch.Generator().manual_seed(len(specs))
    state: dict = {}
    for i, (dtype, n, kind) in enumerate(specs):
        base = torch.randint(0, 100, (2 * n,), generator=g).to(dtype)
        if kind == "t" and n:
            state[f"x{i}"] = base.view(2, n).t()  # not dense: staged through its own copy
        else:
            state[f"x{i}"] = base[:n]
        if kind == "v" and i:
            state[f"tie{i}"] = state[f"x{i - 1}"]
    handles = []
    for step in range(3):
        expect = {k: v.clone() for k, v in state.items()}
        handles.append((expect, bcp.async_save(state, str(root / f"s{step}"), pool=pool, checksum_block_bytes=4096)))
        for v in state.values():
            if v.numel():
                v.add_(1) if v.dtype != torch.bool else v.logical_not_()
    for step, (expect, handle) in enumerate(handles):
        handle.wait()
        loaded = bcp.open(str(root / f"s{step}")).state()
        assert list(loaded) == list(expect)
        for k, v in expect.items():
            assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
            assert tensor_bytes_equal(loaded[k], v), k


@settings(max_examples=examples(50), deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=20),
    zero=st.lists(st.booleans(), min_size=20, max_size=20),
    part=st.integers(1, 3000),
)
def test_split_parts_covers_exactly_the_runs_in_order(sizes, zero, part):
    """A chunk's runs cut into parts the copy helpers take in turn: the same bytes from
    the same sources to the same offsets, in order, no part longer than ``part`` bytes."""
    from bcp.io_scheduler.chunk_plan import split_parts

    runs, at = [], 0
    for i, n in enumerate(sizes):
        runs.append((at, 0 if zero[i] else 1_000_000 * (i + 1), n))
        at += n + 7

    def expand(rs):
        return [(a + j, s + j if s else 0) for a, s, n in rs for j in range(n)]

    parts = split_parts(runs, part)
    assert all(sum(n for _a, _s, n in p) <= part for p in parts)
    assert expand(r for p in parts for r in p) == expand(runs)


def test_large_chunks_are_copied_by_helpers_and_hold_the_values_at_the_call(tmp_path):
    """Chunks of several parts are copied on the caller's cores (a helper thread beside
    the caller, as a large ``Tensor.copy_`` is); ``async_save`` returns only once every
    part is copied: changing every tensor right after it returns changes nothing saved."""
    if min(torch.get_num_threads(), os.cpu_count() or 1) < 2:
        torch.set_num_threads(2)
    pool = StagingPool(64 << 20, slab_bytes=16 << 20)
    clear_plan_caches()
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate([3 << 20, 5, 1 << 20, 777, 2 << 20])}
    handles = []
    for step in range(3):  # planned, then the kept plan's runs
        expect = {k: v.clone() for k, v in state.items()}
        handles.append((expect, bcp.async_save(state, str(tmp_path / f"s{step}"), pool=pool)))
        for v in state.values():
            v.add_(1)
    for step, (expect, handle) in enumerate(handles):
        handle.wait()
        loaded = bcp.open(str(tmp_path / f"s{step}")).state()
        assert all(torch.equal(loaded[k], v) for k, v in expect.items())
    if (os.cpu_count() or 1) >= 2:
        assert any(t.name == "bcp-stage-copy" for t in threading.enumerate())


def copy_runs(base: int, parts) -> None:
    """One chunk's runs copied (``RunCopies``), returned once every byte is."""
    from bcp.io_scheduler.chunk_bytes import RunCopies

    copies = RunCopies()
    assert copies.copy(base, parts, "x") + copies.finish() == ["x"]


def test_copy_runs_copies_every_part_exactly_once():
    """Many small parts raced for by the caller and the helpers: every byte lands once."""

    src = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    dst = torch.full((src.numel() + 64,), 0xEE, dtype=torch.uint8)
    step = 1000
    runs = [(at, src.data_ptr() + at, min(step, src.numel() - at)) for at in range(0, src.numel(), step)]
    parts = [runs[i : i + 3] for i in range(0, len(runs), 3)] + [((src.numel(), 0, 64),)]
    for _ in range(20):
        dst.fill_(0xEE)
        copy_runs(dst.data_ptr(), parts)
        assert torch.equal(dst[: src.numel()], src) and not dst[src.numel() :].any()


def test_copy_runs_copies_alone_when_no_helper_thread_can_start(monkeypatch):
    """A process at its thread limit (``Thread.start`` raising): the staging copy is the
    caller's alone, as before the helpers, rather than the save failing on them."""
    from bcp.io_scheduler import chunk_bytes

    monkeypatch.setattr(chunk_bytes, "_CREW", chunk_bytes._Crew())  # no helper started yet
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(chunk_bytes.os, "cpu_count", lambda: 4)
    started = threading.Thread.start

    def refused(self):
        if self.name == "bcp-stage-copy":
            raise RuntimeError("can't start new thread")
        started(self)

    monkeypatch.setattr(threading.Thread, "start", refused)
    src = torch.arange(1 << 12, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros(src.numel(), dtype=torch.uint8)
    runs = [(at, src.data_ptr() + at, 1024) for at in range(0, src.numel(), 1024)]
    for _ in range(2):
        dst.zero_()
        copy_runs(dst.data_ptr(), [runs[i : i + 2] for i in range(0, len(runs), 2)])
        assert torch.equal(dst, src)


@settings(max_examples=examples(40), deadline=None)
@given(
    segs=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 3), st.integers(0, 300), st.booleans()),
        min_size=1,
        max_size=10,
    )
)
def test_chunk_runs_copy_exactly_its_bytes_in_fewest_copies(segs):
    """A chunk's runs (``chunk_copies``) give exactly the bytes staging segment by
    segment gives (padding zero), and segments adjacent both in the chunk and in memory
    (views of one buffer) are one copy."""
    import ctypes

    import numpy as np

    from bcp.io_scheduler.chunk_plan import Chunk, Segment, chunk_copies

    memory = np.random.default_rng(len(segs)).integers(1, 255, 3 << 12, dtype=np.uint8)
    sources = [memory[i << 12 : (i + 1) << 12] for i in range(3)]  # three buffers, back to back in memory
    segments, at, start_of, expect_runs = [], 0, [0, 0, 0], 0
    last: tuple[int, int] | None = None
    for item, start, gap, nbytes, same in segs:
        start = start_of[item] if same else start  # same: right after this buffer's previous segment
        at += 0 if same else gap
        segments.append(Segment(item, start, nbytes, at))
        src = sources[item].ctypes.data + start
        adjacent = last is not None and last[0] == at and last[1] == src and nbytes
        expect_runs += 0 if adjacent or not nbytes else 1
        last = (at + nbytes, src + nbytes) if nbytes else last  # an empty segment copies nothing
        start_of[item] = start + nbytes
        at += nbytes
    chunk = Chunk(0, at + 7, segments)
    copies = chunk_copies(chunk, [s.ctypes.data for s in sources])
    assert copies is not None
    out = np.full(chunk.nbytes, 0xEE, np.uint8)
    for part in copies.parts:
        for where, src, n in part:
            ctypes.memmove(out.ctypes.data + where, src, n) if src else ctypes.memset(out.ctypes.data + where, 0, n)
    if copies.zeros is not None:
        out[copies.zeros] = 0
    want = np.zeros(chunk.nbytes, np.uint8)
    for seg in segments:
        want[seg.at : seg.at + seg.nbytes] = sources[seg.item][seg.start : seg.start + seg.nbytes]
    assert np.array_equal(out, want)
    moves = sum(1 for part in copies.parts for _at, src, n in part if src and n)
    assert moves == expect_runs


def test_views_of_one_buffer_are_staged_by_one_copy_and_hold_the_values_at_each_call(tmp_path):
    """Tensors laid back to back in one buffer (64-byte multiples: back to back in the
    file too) are staged by one ``memmove``; each save holds the values at its call."""
    from bcp.kept_plans import LocalPlans
    from bcp.planning.cache import plan_cache_for

    clear_plan_caches()
    buf = torch.arange(16 * 60, dtype=torch.float32)
    state = {f"v{i}": buf[16 * i * (i + 1) // 2 : 16 * (i + 1) * (i + 2) // 2] for i in range(10)}
    handles = []
    for step in range(3):
        expect = {k: v.clone() for k, v in state.items()}
        handles.append((expect, bcp.async_save(state, str(tmp_path / f"s{step}"))))
        buf.add_(1000)
    for step, (expect, handle) in enumerate(handles):
        handle.wait()
        loaded = bcp.open(str(tmp_path / f"s{step}")).state()
        assert all(torch.equal(loaded[k], v) for k, v in expect.items())
    kept = next(iter(plan_cache_for("local").local(LocalPlans)._plans.values()))  # private-ok: test introspection
    (plan,) = kept.pipelines.values()
    runs = [r for c in plan.chunks for part in c.copies.parts for r in part if r[1]]
    assert len(runs) == 1 and runs[0][2] == sum(v.nbytes for v in state.values())
