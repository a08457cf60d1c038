"""An async save's staging copy runs as one stream over its chunks (issue 37).

The caller posts each chunk's parts to the copy helpers and copies them too; once no
part of the chunk is left to take it sets up the next chunk instead of waiting for the
helpers' last parts (``chunk_bytes.RunCopies``), so no core idles at a chunk's end. A
chunk goes to the writers only once every byte of it is copied, every byte is written
exactly once, and a failed copy returns every slab to the pool.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.io_scheduler import chunk_bytes, chunk_plan
from bcp.io_scheduler.staging import StagingPool
from bcp.planning.cache import clear_plan_caches
from helpers import examples

HELPER = "bcp-stage-copy"


class _Crew:
    """A fresh crew of two helpers for the test (torch threads and cores patched to 3)."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, str, object]] = []
        self.set(chunk_bytes, "_CREW", chunk_bytes._Crew())
        self.set(torch, "get_num_threads", lambda: 3)
        self.set(chunk_bytes.os, "cpu_count", lambda: 3)

    def set(self, owner: object, name: str, value: object) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> _Crew:
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)


@settings(max_examples=examples(60), deadline=None)
@given(
    chunks=st.lists(
        st.lists(st.tuples(st.integers(1, 3000), st.booleans()), min_size=1, max_size=6), min_size=1, max_size=8
    ),
    part=st.integers(1, 5000),
)
def test_run_copies_write_every_byte_once_and_hand_over_whole_chunks_in_order(chunks, part):
    """Chunks of runs (bytes or zeros) cut into parts of any size, copied by the caller
    and two helpers: every destination byte is written by exactly one copy, each chunk's
    tag comes back once, in order, and only when all of its bytes are in place."""
    total = sum(n for runs in chunks for n, _ in runs)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.full((total,), 0xEE, dtype=torch.uint8)
    expect = src.clone()
    plans, at = [], 0
    for runs in chunks:
        start, cut = at, []
        for n, zero in runs:
            cut.append((at - start, 0 if zero else src.data_ptr() + at, n))
            if zero:
                expect[at : at + n] = 0
            at += n
        plans.append((start, at, chunk_plan.split_parts(cut, part)))
    writes: list[tuple[int, int]] = []

    def move(to: int, frm: int, n: int) -> None:
        writes.append((to, n))
        ctypes.memmove(to, frm, n)

    def fill(to: int, byte: int, n: int) -> None:
        writes.append((to, n))
        ctypes.memset(to, byte, n)

    with _Crew() as crew:
        crew.set(chunk_bytes, "_MEMMOVE", move)
        crew.set(chunk_bytes, "_MEMSET", fill)
        copies, returned = chunk_bytes.RunCopies(), []

        def check(tags: list) -> None:
            for tag in tags:  # handed over: complete now
                lo, hi, _ = plans[tag]
                assert torch.equal(dst[lo:hi], expect[lo:hi]), f"chunk {tag} handed over before its bytes"
            returned.extend(tags)

        for i, (lo, _, parts) in enumerate(plans):
            check(copies.copy(dst.data_ptr() + lo, parts, i))
        check(copies.finish())
    assert returned == list(range(len(plans)))
    assert torch.equal(dst, expect)
    spans = sorted((to - dst.data_ptr(), n) for to, n in writes)
    covered = 0
    for off, n in spans:
        assert off == covered, "a byte written twice, or none"
        covered += n
    assert covered == total


def test_caller_sets_up_the_next_chunk_while_a_helper_finishes_a_part(tmp_path, monkeypatch):
    """A helper slow on its part of a chunk (descheduled, say) does not hold up the caller:
    the caller takes the chunk's other parts and goes on to copy the next chunk meanwhile
    (before, it waited at every chunk's end for the helpers' parts). Bytes stay exact."""
    monkeypatch.setattr(chunk_plan, "COPY_PART_BYTES", 64 << 10)  # parts of the planned runs
    clear_plan_caches()
    pool = StagingPool(16 << 20, slab_bytes=1 << 20)  # room for the whole save: no writer starts
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(300_000, generator=g) for i in range(4)}  # 4.6 MiB: 5 chunks
    bcp.async_save(state, str(tmp_path / "a"), pool=pool).wait()  # planned (the next save copies by runs)
    acquired = [0]
    real_acquire = pool.acquire

    def acquire():
        acquired[0] += 1
        return real_acquire()

    monkeypatch.setattr(pool, "acquire", acquire)
    helper_in, caller_on = threading.Event(), threading.Event()
    stall: dict[str, int] = {}

    def move(to: int, frm: int, n: int) -> None:
        if threading.current_thread().name == HELPER and "at" not in stall:
            stall["at"] = acquired[0]  # the chunk this part belongs to
            helper_in.set()
            stall["waited"] = int(not caller_on.wait(10))
        elif threading.current_thread().name != HELPER:
            helper_in.wait(10)  # the helper holds a part before the caller goes on
            if "at" in stall and acquired[0] > stall["at"]:
                caller_on.set()  # copying a later chunk while the helper's part is unfinished
        ctypes.memmove(to, frm, n)

    with _Crew() as crew:
        crew.set(chunk_bytes, "_MEMMOVE", move)
        handle = bcp.async_save(state, str(tmp_path / "b"), pool=pool)
    handle.wait()
    assert stall.get("waited") == 0, "the caller waited for the helper's part before the next chunk"
    loaded = bcp.open(str(tmp_path / "b")).state()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_failed_copy_returns_every_slab_and_the_next_save_copies(tmp_path, monkeypatch):
    """A copy that raises mid-save (the caller's or a helper's part, chunks in flight):
    the save fails, no slab stays lent, and the next save is exact."""
    monkeypatch.setattr(chunk_plan, "COPY_PART_BYTES", 64 << 10)
    clear_plan_caches()
    pool = StagingPool(16 << 20, slab_bytes=1 << 20)
    g = torch.Generator().manual_seed(4)
    state = {f"t{i}": torch.randn(200_000, generator=g) for i in range(5)}
    uri = str(tmp_path / "c")
    bcp.async_save(state, uri, pool=pool).wait()
    calls = [0]
    lock = threading.Lock()

    def move(to: int, frm: int, n: int) -> None:
        with lock:
            calls[0] += 1
            if calls[0] == 23:
                raise OSError("copy failed")
        ctypes.memmove(to, frm, n)

    with _Crew() as crew:
        crew.set(chunk_bytes, "_MEMMOVE", move)
        with pytest.raises(OSError, match="copy failed"):
            bcp.async_save(state, uri, overwrite=True, pool=pool).wait()
        assert calls[0] > 23, "the copy went on after the failing part (chunks in flight)"
        lent = []
        for _ in range(pool.max_slabs):  # every slab back in the pool
            assert not pool.would_block(), f"{len(lent)} of {pool.max_slabs} slabs free after the failed save"
            lent.append(pool.acquire())
        for slab in lent:
            pool.release(slab)
        for v in state.values():
            v.mul_(-1)
        bcp.async_save(state, uri, overwrite=True, pool=pool).wait()
    loaded = bcp.open(uri).state()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_pool_smaller_than_the_save_hands_over_only_copied_chunks(tmp_path, monkeypatch):
    """Two slabs for a save of many chunks: staging waits for the writers, which get
    each chunk only once it is copied (helpers racing the caller); the file is exact."""
    monkeypatch.setattr(chunk_plan, "COPY_PART_BYTES", 16 << 10)
    clear_plan_caches()
    pool = StagingPool(512 << 10, slab_bytes=256 << 10)
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(int(n), generator=g) for i, n in enumerate(torch.randint(1, 90_000, (12,)))}
    uri = str(tmp_path / "d")
    with _Crew():
        for step in range(3):
            bcp.async_save(state, uri, overwrite=step > 0, pool=pool).wait()
            loaded = bcp.open(uri).state()
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
            for v in state.values():
                v.add_(1)


def test_a_deferred_save_too_big_for_the_pool_hands_over_what_it_copied(tmp_path):
    """A deferred pipeline (the local tier's fast path) whose chunks outgrow the pool
    raises StagingFull once every slab holds a chunk: the copies in flight are finished
    and queued first (whole: their bytes are the tensors'), discarding returns every slab,
    and the crew is free for the next caller."""
    from bcp.io_scheduler.kept_pipelines import make_pipeline
    from bcp.io_scheduler.write_pipeline import StagingFull
    from bcp.kept_plans import LocalPlans, prepare_tensors
    from bcp.state import flatten_state
    from bcp.target import resolve_backend

    g = torch.Generator().manual_seed(6)
    state = {f"t{i}": torch.randn(40_000, generator=g) for i in range(6)}  # 937 KiB: 15 chunks of 64 KiB
    prepared = prepare_tensors(flatten_state(state), 0, {}, plans=LocalPlans())
    backend = resolve_backend(str(tmp_path / "x"), None)
    pool = StagingPool(256 << 10, slab_bytes=64 << 10)  # 4 slabs

    def move(to: int, frm: int, n: int) -> None:
        if threading.current_thread().name == HELPER:
            time.sleep(0.002)  # a slow helper: its part of the last chunk is in flight when the pool is full
        ctypes.memmove(to, frm, n)

    with _Crew() as crew:
        crew.set(chunk_plan, "COPY_PART_BYTES", 8 << 10)
        crew.set(chunk_bytes, "_MEMMOVE", move)
        pipeline = make_pipeline(backend, "", 0, prepared.items, 4096, pool=pool, stage_all=True, deferred=True)
        assert all(c.copies is not None for c in pipeline.chunks())
        with pytest.raises(StagingFull):
            pipeline.stage()
        queued = pipeline._queue  # private-ok: test introspection
        staged = [queued.get_nowait() for _ in range(queued.qsize())]
        assert len([s for s in staged if s is not None]) == pool.max_slabs and pool.would_block()
        tensors = [t.view(torch.uint8) for t in state.values()]  # the items, in order
        for s in staged:
            if s is not None:
                got = s.data.view(torch.uint8)
                for seg in s.chunk.segments:
                    want = tensors[seg.item][seg.start : seg.start + seg.nbytes]
                    assert torch.equal(got[seg.at : seg.at + seg.nbytes], want)
                queued.put(s)
        pipeline.discard()
        assert not pool.would_block()
        assert chunk_bytes._CREW_LOCK.acquire(blocking=False), "the failed stage kept the copy crew"
        chunk_bytes._CREW_LOCK.release()
