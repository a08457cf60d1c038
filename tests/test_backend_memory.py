"""MemoryBackend: the shared object contract, plus store naming and sharing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

import bcp.backends.memory as memory_mod
from bcp.backends import Backend, backend_for
from bcp.backends.memory import MemoryBackend, clear_memory_store
from bcp.conformance import BackendContractTests


@pytest.fixture
def store() -> Iterator[str]:
    """A unique store name, emptied afterwards so tests never see each other's objects."""
    name = f"test-{uuid.uuid4().hex}"
    yield name
    clear_memory_store(name)


class TestMemoryBackendContract(BackendContractTests):
    @pytest.fixture
    def backend(self, store: str) -> Iterator[Backend]:
        b = backend_for(f"memory://{store}/root")
        assert isinstance(b, MemoryBackend)
        yield b
        b.close()

    def raw_put(self, backend: Backend, key: str, data: bytes) -> None:
        with memory_mod._LOCK:
            memory_mod._OBJECTS[f"{backend.root}/{key}"] = bytes(data)  # type: ignore[attr-defined]

    def raw_get(self, backend: Backend, key: str) -> bytes:
        return memory_mod._OBJECTS[f"{backend.root}/{key}"]  # type: ignore[attr-defined]


def test_same_uri_shares_objects(store: str) -> None:
    backend_for(f"memory://{store}/root").write("k", b"shared")
    assert backend_for(f"memory://{store}/root").read("k") == b"shared", "two instances of one URI do not share objects"


def test_prefix_is_a_view_of_the_same_store(store: str) -> None:
    backend_for(f"memory://{store}/root/sub").write("k", b"nested")
    assert backend_for(f"memory://{store}/root").read("sub/k") == b"nested", "a sub-prefix is not a view of its parent"


def test_different_store_names_are_isolated(store: str) -> None:
    other = f"{store}x"  # a name that merely starts with the first one
    try:
        backend_for(f"memory://{store}/root").write("k", b"one")
        b2 = backend_for(f"memory://{other}/root")
        assert not b2.exists("k") and list(b2.list("")) == [], "different store names share objects"
    finally:
        clear_memory_store(other)


def test_different_roots_are_isolated(store: str) -> None:
    backend_for(f"memory://{store}/a").write("k", b"one")
    b2 = backend_for(f"memory://{store}/ab")
    assert list(b2.list("")) == [], "root 'ab' sees objects of root 'a'"


def test_clear_memory_store_by_name(store: str) -> None:
    other = f"{store}-other"
    try:
        backend_for(f"memory://{store}/root").write("k", b"x")
        backend_for(f"memory://{other}/root").write("k", b"y")
        clear_memory_store(store)
        assert not backend_for(f"memory://{store}/root").exists("k"), (
            "clear_memory_store(name) kept the store's objects"
        )
        assert backend_for(f"memory://{other}/root").exists("k"), "clear_memory_store(name) cleared another store"
    finally:
        clear_memory_store(other)


def test_clear_memory_store_all(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Clear a private table, not the process-wide one other tests may be using.
    monkeypatch.setattr(memory_mod, "_OBJECTS", {})
    b = backend_for(f"memory://{store}/root")
    b.write("k", b"x")
    clear_memory_store()
    assert not b.exists("k"), "clear_memory_store() kept objects"


def test_uri_is_normalized(store: str) -> None:
    b = backend_for(f"memory://{store}/root/")
    assert b.uri == f"memory://{store}/root" and b.root == f"{store}/root"  # type: ignore[attr-defined]


def test_store_name_required() -> None:
    with pytest.raises(ValueError, match="store name"):
        backend_for("memory://")


def test_options_rejected(store: str) -> None:
    with pytest.raises(TypeError, match="colour"):
        backend_for(f"memory://{store}/root?colour=blue")
