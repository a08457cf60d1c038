"""What the caller of ``async_save`` does itself (issue 37): it stages, and leaves opening
the data file (directories made durable) and starting threads to the save's own
threads; the kept plan's fingerprint is compared once per save. Every case still
writes exactly the values at the call, and a failure is the save's error with its
staging slabs returned."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

import bcp
from bcp.backends import file as file_backend
from bcp.io_scheduler.staging import StagingPool
from bcp.kept_plans import Fingerprint


def state_of(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 32, generator=g) for i in range(n)}


def test_the_caller_opens_no_file_and_starts_no_thread(tmp_path, monkeypatch):
    state = state_of(1)
    bcp.async_save(state, str(tmp_path / "warm"), overwrite=True).wait()  # the starter thread exists
    caller = threading.get_ident()
    opened: list[int] = []
    started: list[tuple[str, int]] = []
    real_open, real_start = file_backend.FileBackend.open_writer, threading.Thread.start

    def open_writer(self, key, *, size=None):
        opened.append(threading.get_ident())
        return real_open(self, key, size=size)

    def start(self):
        started.append((self.name, threading.get_ident()))
        return real_start(self)

    monkeypatch.setattr(file_backend.FileBackend, "open_writer", open_writer)
    monkeypatch.setattr(threading.Thread, "start", start)
    expected = {k: v.clone() for k, v in state.items()}
    handle = bcp.async_save(state, str(tmp_path / "ck"), overwrite=True)
    for v in state.values():
        v.fill_(float("nan"))  # at once: the checkpoint holds the values at the call
    handle.wait()
    assert opened and caller not in opened, "the caller opened the data file"
    assert started and all(ident != caller for _name, ident in started), f"the caller started {started}"
    assert {name for name, _ in started} >= {"bcp-async-save", "bcp-writer"}
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in expected.items())


def test_a_file_that_cannot_be_opened_fails_the_save_and_returns_the_slabs(tmp_path, monkeypatch):
    pool = StagingPool(8 << 20, slab_bytes=1 << 20)

    def refuse(self, key, *, size=None):
        raise PermissionError(13, "Permission denied", key)

    monkeypatch.setattr(file_backend.FileBackend, "open_writer", refuse)
    handle = bcp.async_save(state_of(2), str(tmp_path / "ck"), pool=pool)
    with pytest.raises(PermissionError, match="Permission denied"):
        handle.wait()
    assert pool._in_use == 0, "a slab of the failed save was never returned"  # private-ok: test introspection
    monkeypatch.undo()
    bcp.async_save(state_of(3), str(tmp_path / "ok"), pool=pool).wait()
    r = bcp.open(str(tmp_path / "ok"))
    assert all(torch.equal(r.read(k), v) for k, v in state_of(3).items())


def test_a_save_whose_thread_cannot_start_fails_from_wait(tmp_path, monkeypatch):
    pool = StagingPool(8 << 20, slab_bytes=1 << 20)
    bcp.async_save(state_of(4), str(tmp_path / "warm"), pool=pool).wait()
    _refuse_the_save_thread(monkeypatch)
    handle = bcp.async_save(state_of(5), str(tmp_path / "ck"), pool=pool)  # returns: the start is not waited for
    with pytest.raises(RuntimeError, match="can't start new thread"):
        handle.wait(timeout=60)
    assert handle.done()
    monkeypatch.undo()
    for _ in range(200):  # the writers return the slabs
        if pool._in_use == 0:  # private-ok: test introspection
            break
        threading.Event().wait(0.05)
    assert pool._in_use == 0, "a slab of the failed save was never returned"  # private-ok: test introspection
    assert not (tmp_path / "ck" / bcp.metadata.MANIFEST_KEY).exists()


def _save_in_child(path: str, out) -> None:
    state = state_of(6)
    bcp.async_save(state, path).wait(timeout=60)
    out.put(all(torch.equal(bcp.open(path).read(k), v) for k, v in state.items()))


def test_a_forked_child_starts_its_own_starter(tmp_path):
    bcp.async_save(state_of(6), str(tmp_path / "parent")).wait()  # the parent's starter thread exists
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_save_in_child, args=(str(tmp_path / "child"), out))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and out.get(timeout=5) is True


def test_equal_fingerprints_share_their_fields_and_colliding_ones_differ():
    a, b = (Fingerprint((1, ("x", torch.Size([n, 2])))) for n in (3, 3))
    assert a.sigs is not b.sigs and a == b
    assert a.sigs is b.sigs, "the second comparison would walk every tensor's fields again"
    c, d = Fingerprint((-1,)), Fingerprint((-2,))  # equal hashes in CPython, different fields
    assert hash(c) == hash(d) and c != d and c.sigs == (-1,) and d.sigs == (-2,)


def _refuse_the_save_thread(monkeypatch) -> None:
    real_start = threading.Thread.start

    def start(self):
        if self.name == "bcp-async-save":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def _settled(pool: StagingPool, before: set[threading.Thread]) -> list[str]:
    """The bcp-writer threads started since ``before`` still alive after a while; waits
    for the slabs to come back too."""
    for _ in range(100):
        writers = [t.name for t in threading.enumerate() if t.name == "bcp-writer" and t not in before]
        if not writers and pool._in_use == 0:  # private-ok: test introspection
            break
        threading.Event().wait(0.05)
    return writers


def test_an_overlapped_save_whose_thread_cannot_start_ends_its_writers_and_returns_the_slabs(tmp_path, monkeypatch):
    """Staged in part (``overlap``), the rest left to a thread that never starts: the
    writers get their end marks (before: four bcp-writer threads blocked forever)."""
    pool = StagingPool(8 << 20, slab_bytes=1 << 20)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    state = {"extra": torch.randn(256, 256), "model": model.state_dict(), "optim": opt.state_dict()}
    bcp.async_save(state, str(tmp_path / "warm"), pool=pool).wait()  # the starter thread exists
    before = set(threading.enumerate())
    _refuse_the_save_thread(monkeypatch)
    handle = bcp.async_save(state, str(tmp_path / "ck"), pool=pool, overlap=opt)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        handle.wait(timeout=60)
    monkeypatch.undo()
    assert _settled(pool, before) == [], "writers of the failed save still wait for their queue"
    assert pool._in_use == 0, "a slab of the failed save was never returned"  # private-ok: test introspection
    opt.step()  # waits for the part it must not change first: returns
    assert not (tmp_path / "ck" / bcp.metadata.MANIFEST_KEY).exists()


def test_a_fast_local_save_whose_thread_cannot_start_returns_its_slabs(tmp_path, monkeypatch):
    """The local tier's fast path (a save planned in its thread): the thread never
    starts, nothing is planned, and the deferred pipeline's staged slabs come back."""
    from bcp.io_scheduler.staging import default_pool
    from bcp.tiers import LocalTier

    manager = bcp.CheckpointManager(
        tmp_path / "ck", tier=LocalTier(keep_free=0.0, dir=tmp_path / "shm", persist_every=None, keep=3)
    )
    state = {"w": torch.randn(512, 512), "step": 1}
    manager.save(1, state)  # plans as bcp.async_save does; the next one takes the fast path
    manager.wait()
    pool = default_pool()
    before = set(threading.enumerate())
    assert pool._in_use == 0  # private-ok: test introspection
    _refuse_the_save_thread(monkeypatch)
    manager.save(2, {**state, "step": 2})
    assert manager._tier.last_fast  # private-ok: test introspection
    with pytest.raises(RuntimeError, match="can't start new thread"):
        manager.wait()
    monkeypatch.undo()
    assert _settled(pool, before) == []
    assert pool._in_use == 0, "the fast save's staged slabs stay taken"  # private-ok: test introspection
    manager.close()


def test_a_written_save_keeps_no_per_item_state_for_a_later_caller_to_free(tmp_path):
    """A save's block checksums (a dict entry a segment) are let go once its rows are
    built, in its own thread; a steady save staged by runs copies no per-item count.
    Before, the caller of the save two later freed them (1.5 ms of 10,000 tensors) when
    its handle replaced this one's, and copied the plan's counts at every call."""
    state = {f"t{i}": torch.randn(i + 1) for i in range(300)}
    bcp.async_save(state, str(tmp_path / "a"), overwrite=True).wait()  # planned: the next one is steady
    handle = bcp.async_save(state, str(tmp_path / "a"), overwrite=True)
    handle.wait()
    pipeline = handle._job.pipeline  # private-ok: test introspection
    assert pipeline.checksums == {}, "the written save still holds its checksums"
    assert pipeline._uses_left is None, (
        "a save staged by runs copied the per-item counts"
    )  # private-ok: test introspection
    r = bcp.open(str(tmp_path / "a"))
    assert all(torch.equal(r.read(k), v) for k, v in state.items())
