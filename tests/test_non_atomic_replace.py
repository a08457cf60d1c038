"""Stores that cannot replace an object atomically (``Capability.NON_ATOMIC_REPLACE``):
the commit path bcp uses for them (delete the old manifest, create the new one, write
the old one back if that fails), what a reader sees meanwhile, and the conformance
checks that skip the atomic-overwrite check for them and check the weaker guarantee."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

import bcp
from bcp.backends import Backend, Buffer, Capability, ObjectWriter, StorageError
from bcp.backends.hdfs import ArrowFsBackend
from bcp.backends.memory import MemoryBackend, _MemoryWriter
from bcp.backends.wrappers import ForwardingBackend
from bcp.commit import generations, parse_manifest, replaces_atomically
from bcp.conformance import OverwriteTests
from bcp.metadata.keys import manifest_key
from bcp.reader import fetch_manifest
from broken_backends import DeclaredNonAtomicBackend, DeleteFirstBackend
from test_conformance_suite import run_cli

MANIFEST = manifest_key()


class Spy(ForwardingBackend):
    """Records what is done to the manifest; ``on`` runs a hook after (or instead of,
    when it raises) an operation on it."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.ops: list[str] = []
        self.on: dict[str, Callable[[], None]] = {}

    def _note(self, op: str, key: str) -> None:
        if key == MANIFEST:
            self.ops.append(op)
            if op in self.on:
                self.on[op]()

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        if key == MANIFEST and offset == 0:
            self.ops.append("read")
        return super().read_into(key, offset, buffer)

    def delete(self, key: str) -> None:
        super().delete(key)
        self._note("delete", key)

    def write(self, key: str, data: Buffer) -> None:
        self._note("write", key)
        super().write(key, data)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        self._note("write_if_absent", key)
        super().write_if_absent(key, data)


def store(cls: type[MemoryBackend] = DeclaredNonAtomicBackend) -> Spy:
    return Spy(cls.from_uri(f"{cls.scheme}://na-{uuid.uuid4().hex[:8]}/ck"))


def saved(backend: Backend, value: float) -> None:
    bcp.save({"w": torch.full((64,), value)}, backend, overwrite=True)


def loaded(backend: Backend) -> float:
    return float(bcp.load({"w": torch.empty(64)}, backend)["w"][0])


def test_the_capability_is_negative_so_existing_backends_keep_atomic_replace():
    assert replaces_atomically(MemoryBackend.from_uri("memory://x/y"))
    assert not replaces_atomically(DeclaredNonAtomicBackend.from_uri("nonatomic-declared://x/y"))
    assert Capability.NON_ATOMIC_REPLACE not in Capability.CREATE_ONLY | Capability.RANGED_READ


def test_overwrite_deletes_the_old_manifest_then_creates_the_new_one():
    backend = store()
    saved(backend, 1.0)
    backend.ops.clear()
    saved(backend, 2.0)
    assert backend.ops[-3:] == ["read", "delete", "write_if_absent"], backend.ops
    assert "write" not in backend.ops, "the manifest was replaced in place on a store without atomic replace"
    assert loaded(backend) == 2.0
    assert len(generations(backend)) == 1, "the replaced generation was not deleted after the commit"


def test_an_atomic_store_still_replaces_the_manifest_in_one_write():
    backend = store(MemoryBackend)
    saved(backend, 1.0)
    backend.ops.clear()
    saved(backend, 2.0)
    assert "write" in backend.ops and "delete" not in backend.ops, backend.ops
    assert loaded(backend) == 2.0


def test_a_reader_in_the_window_finds_no_checkpoint_and_is_told_why():
    backend = store()
    saved(backend, 1.0)
    seen: list[BaseException] = []

    def read_now() -> None:
        try:
            bcp.open(backend)
        except bcp.IncompleteCheckpointError as e:
            seen.append(e)

    backend.on["delete"] = read_now
    saved(backend, 2.0)
    assert len(seen) == 1, "the reader found a checkpoint between the delete and the create"
    assert "cannot replace objects atomically" in str(seen[0]) and "try again" in str(seen[0])
    assert loaded(backend) == 2.0


def test_readers_racing_overwrites_see_a_whole_manifest_or_none():
    backend = store()
    saved(backend, 0.0)
    save_ids = {fetch_manifest(backend)[1].save_id}
    seen: list[str] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def reader() -> None:
        # One read_into call a time: Backend.read's size-then-read can straddle two
        # whole manifests on any store, which is not what this test is about.
        buf = bytearray(1 << 20)
        while not stop.is_set():
            try:
                n = backend.read_into(MANIFEST, 0, memoryview(buf))
            except FileNotFoundError:
                seen.append("none")
                continue
            try:
                seen.append(parse_manifest(backend, bytes(buf[:n])).save_id)  # checksummed: a torn one raises
            except Exception as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(1, 6):
            saved(backend, float(i))
            save_ids.add(fetch_manifest(backend)[1].save_id)
    finally:
        stop.set()
        thread.join(30)
    assert not errors, f"a reader saw a torn manifest: {errors[0]}"
    assert seen, "the reader never ran"
    assert set(seen) - {"none"} <= save_ids, "a reader saw a manifest no save wrote"
    assert loaded(backend) == 5.0


class Refused(StorageError):
    pass


def _refuse(times: int) -> Callable[[], None]:
    count = [0]

    def hook() -> None:
        count[0] += 1
        if count[0] <= times:
            raise Refused("the store refused the write", uri="x", key=MANIFEST, action="creating")

    return hook


def test_a_failed_create_writes_the_old_manifest_back():
    backend = store()
    saved(backend, 1.0)
    before = generations(backend)
    backend.on["write_if_absent"] = _refuse(1)
    with pytest.raises(Refused) as caught:
        saved(backend, 2.0)
    assert any("was kept" in note for note in getattr(caught.value, "__notes__", [])), caught.value
    assert loaded(backend) == 1.0, "a failed overwrite lost the previous checkpoint"
    assert generations(backend) == before, "the failed save's generation was left behind"


def test_when_the_old_manifest_cannot_be_written_back_the_error_says_so():
    backend = store()
    saved(backend, 1.0)
    backend.on["write_if_absent"] = _refuse(2)
    with pytest.raises(Refused) as caught:
        saved(backend, 2.0)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "could not be written back" in notes and "nothing is committed" in notes, notes
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.open(backend)


def test_a_racing_save_that_commits_in_the_window_wins_and_is_not_replaced():
    backend = store()
    saved(backend, 1.0)

    def racing_commit() -> None:
        backend.on.pop("delete")
        bcp.save({"w": torch.full((64,), 9.0)}, backend.inner)  # a create: the key is free

    backend.on["delete"] = racing_commit
    with pytest.raises(bcp.CheckpointExistsError):
        saved(backend, 2.0)
    assert loaded(backend) == 9.0, "the overwrite replaced (or wrote back over) the racing save's checkpoint"


def test_arrow_backend_declares_it_over_a_filesystem_whose_rename_does_not_replace(tmp_path: Path):
    local = ArrowFsBackend("arrow://local", pafs.LocalFileSystem(), str(tmp_path / "a"))
    assert replaces_atomically(local)
    sub = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())  # not LocalFileSystem: deletes first
    other = ArrowFsBackend("arrow://sub", sub, "b")
    assert not replaces_atomically(other)
    saved(other, 1.0)
    saved(other, 2.0)
    assert loaded(other) == 2.0


# -- the conformance checks -------------------------------------------------------------------


def _overwrite_checks(tmp_path: Path, scheme: str) -> tuple[int, dict]:
    report = tmp_path / f"r-{scheme}.json"
    proc = run_cli(
        f"{scheme}://c{uuid.uuid4().hex[:6]}/root",
        "--quick",
        "--import",
        "broken_backends",
        "-k",
        "overwrite",
        "--json",
        str(report),
        cwd=tmp_path,
    )
    return proc.returncode, json.loads(report.read_text())


def test_the_atomic_check_skips_for_a_store_that_declares_it_and_the_weaker_one_runs():
    backend = DeclaredNonAtomicBackend.from_uri(f"nonatomic-declared://c{uuid.uuid4().hex[:6]}/root")
    with pytest.raises(pytest.skip.Exception, match=r"declares Capability\.NON_ATOMIC_REPLACE"):
        OverwriteTests().test_overwrite_is_atomic_for_concurrent_readers(backend)
    OverwriteTests().test_overwrite_never_mixes_for_concurrent_readers(backend)


def test_the_atomic_check_tells_an_undeclared_delete_first_store_what_to_declare():
    backend = DeleteFirstBackend.from_uri(f"broken-nonatomic://c{uuid.uuid4().hex[:6]}/root")

    def race() -> None:
        for _ in range(10):  # each round overwrites 11 times under 4 readers: one finds the gap
            OverwriteTests().test_overwrite_is_atomic_for_concurrent_readers(backend)

    with pytest.raises(AssertionError, match="missing for a moment") as caught:
        race()
    assert "declares Capability.NON_ATOMIC_REPLACE" in str(caught.value)
    OverwriteTests().test_overwrite_never_mixes_for_concurrent_readers(backend)


@pytest.mark.slow
def test_bcp_conformance_on_a_declared_store_passes_the_overwrite_checks(tmp_path: Path):
    status, data = _overwrite_checks(tmp_path, "nonatomic-declared")
    checks = {c["name"]: c for cs in data["groups"].values() for c in cs}
    atomic = checks["test_overwrite_is_atomic_for_concurrent_readers"]
    assert atomic["outcome"] == "skipped" and "NON_ATOMIC_REPLACE" in atomic["why"], atomic
    assert checks["test_overwrite_never_mixes_for_concurrent_readers"]["outcome"] == "passed"
    assert checks["test_overwrite_needs_consent_and_replaces"]["outcome"] == "passed"
    assert "NON_ATOMIC_REPLACE" in data["backend"]["capabilities"]
    assert status == 0


class _TornWriter(_MemoryWriter):
    """Rewrites in place: for a moment the object is half new, half old."""

    def _commit(self) -> None:
        data, key = bytes(self._buf), self.key
        if self.backend.exists(key):
            old = self.backend.read(key)
            self.backend._put(key, data[: len(data) // 2] + old[len(data) // 2 :], if_absent=False)
            time.sleep(0.002)
        self.backend._put(key, data, if_absent=False)


class _TornReplaceBackend(DeclaredNonAtomicBackend):
    """Declares NON_ATOMIC_REPLACE but tears objects, which that does not allow."""

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _TornWriter(self, key, size)


def test_the_weaker_check_still_fails_a_store_that_tears_objects():
    backend = _TornReplaceBackend.from_uri(f"nonatomic-declared://t{uuid.uuid4().hex[:6]}/root")

    def race() -> None:
        for _ in range(20):  # a race: each round has many chances to catch a half-replaced object
            OverwriteTests().test_overwrite_never_mixes_for_concurrent_readers(backend)

    with pytest.raises(AssertionError, match="torn"):
        race()
