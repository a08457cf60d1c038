"""The scheme registry: built-ins, run-time registrations and entry-point plugins."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Self

import pytest

import bcp.backends.registry as registry
from bcp.backends import (
    backend_for,
    get_backend_class,
    register_backend,
    registered_backends,
    split_scheme,
)
from bcp.backends.file import FileBackend
from bcp.backends.memory import MemoryBackend


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own copy of the registrations and no installed plugins, so
    tests neither leak schemes into each other nor depend on what is installed."""
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    monkeypatch.setattr(registry, "_entry_points", {})


def _entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group="bcp.backends")


class RecordingBackend(MemoryBackend):
    """Remembers what from_uri was given."""

    seen_uri: str
    seen_options: dict[str, object]

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Self:
        b = cls(uri, "recording")
        b.seen_uri, b.seen_options = uri, options
        return b


# -- lookup ----------------------------------------------------------------------------


def test_unknown_scheme_lists_registered_schemes() -> None:
    with pytest.raises(ValueError, match="registered schemes") as info:
        backend_for("nosuch://bucket/ckpt")
    message = str(info.value)
    assert "file://" in message and "memory://" in message, f"error does not list the known schemes: {message}"


def test_unknown_scheme_repeats_uri() -> None:
    with pytest.raises(ValueError, match="nosuch://bucket/ckpt"):
        backend_for("nosuch://bucket/ckpt")


def test_unknown_scheme_lists_registered_at_run_time() -> None:
    register_backend("mine", RecordingBackend)
    with pytest.raises(ValueError, match="mine://"):
        get_backend_class("nosuch")


def test_plain_path_is_file_backend(tmp_path: Path) -> None:
    assert isinstance(backend_for(str(tmp_path)), FileBackend)


def test_path_like_is_file_backend(tmp_path: Path) -> None:
    assert isinstance(backend_for(tmp_path), FileBackend)  # type: ignore[arg-type]


def test_split_scheme() -> None:
    assert split_scheme("relative/dir") == ("file", "relative/dir")
    assert split_scheme("S3://b/k") == ("s3", "S3://b/k")


def test_scheme_lookup_ignores_case() -> None:
    assert get_backend_class("MEMORY") is MemoryBackend


def test_builtins_resolve() -> None:
    assert get_backend_class("file") is FileBackend and get_backend_class("memory") is MemoryBackend


# -- register_backend ------------------------------------------------------------------


def test_register_refuses_to_clobber_builtin() -> None:
    with pytest.raises(ValueError, match="clobber=True"):
        register_backend("memory", RecordingBackend)


def test_register_refuses_to_clobber_registered() -> None:
    register_backend("mine", RecordingBackend)
    with pytest.raises(ValueError, match="clobber=True"):
        register_backend("mine", MemoryBackend)
    assert get_backend_class("mine") is RecordingBackend, "a refused registration replaced the old one"


def test_register_with_clobber_replaces() -> None:
    register_backend("mine", RecordingBackend)
    register_backend("mine", MemoryBackend, clobber=True)
    assert get_backend_class("mine") is MemoryBackend


def test_register_with_clobber_replaces_builtin() -> None:
    register_backend("memory", RecordingBackend, clobber=True)
    assert get_backend_class("memory") is RecordingBackend


def test_register_dotted_path() -> None:
    register_backend("dotted", "bcp.backends.memory.MemoryBackend")
    assert get_backend_class("dotted") is MemoryBackend
    assert registered_backends()["dotted"] == "bcp.backends.memory.MemoryBackend"


def test_register_is_case_insensitive() -> None:
    register_backend("MiXeD", RecordingBackend)
    assert get_backend_class("mixed") is RecordingBackend


def test_register_rejects_invalid_scheme() -> None:
    with pytest.raises(ValueError, match="invalid URI scheme"):
        register_backend("1bad", RecordingBackend)


def test_registered_class_shown_by_dotted_name() -> None:
    register_backend("mine", RecordingBackend)
    assert registered_backends()["mine"] == f"{__name__}.RecordingBackend"


def test_registered_backends_is_read_only() -> None:
    view = registered_backends()
    with pytest.raises(TypeError):
        view["evil"] = "x"  # type: ignore[index]


def test_registered_backends_lists_builtins() -> None:
    view = registered_backends()
    assert view["file"] == "bcp.backends.file.FileBackend" and view["memory"] == "bcp.backends.memory.MemoryBackend"


# -- options ---------------------------------------------------------------------------


def test_query_options_reach_from_uri() -> None:
    register_backend("rec", RecordingBackend)
    b = backend_for("rec://bucket/path?a=1&b=two")
    assert b.seen_options == {"a": "1", "b": "two"}  # type: ignore[attr-defined]


def test_query_removed_from_uri() -> None:
    register_backend("rec", RecordingBackend)
    b = backend_for("rec://bucket/path?a=1")
    assert b.seen_uri == "rec://bucket/path"  # type: ignore[attr-defined]


def test_keyword_options_override_query() -> None:
    register_backend("rec", RecordingBackend)
    b = backend_for("rec://bucket/path?a=1&b=two", b=2, c=None)
    assert b.seen_options == {"a": "1", "b": 2, "c": None}  # type: ignore[attr-defined]


def test_blank_query_value_kept() -> None:
    register_backend("rec", RecordingBackend)
    b = backend_for("rec://bucket/path?flag=")
    assert b.seen_options == {"flag": ""}  # type: ignore[attr-defined]


# -- entry points ----------------------------------------------------------------------


def test_broken_entry_point_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {"brk": _entry_point("brk", "no_such_module_xyz:Cls")})
    with pytest.raises(ImportError) as info:
        backend_for("brk://x/y")
    message = str(info.value)
    assert "'brk'" in message and "no_such_module_xyz:Cls" in message, f"error does not name the entry point: {message}"
    assert isinstance(info.value.__cause__, ImportError), "the import failure is not chained"


def test_entry_point_found_by_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {"mem2": _entry_point("mem2", "bcp.backends.memory:MemoryBackend")})
    assert get_backend_class("mem2") is MemoryBackend


def test_entry_point_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {"mem2": _entry_point("mem2", "bcp.backends.memory:MemoryBackend")})
    assert registered_backends()["mem2"] == "bcp.backends.memory:MemoryBackend (entry point)"


def test_entry_point_not_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {"odd": _entry_point("odd", "collections:OrderedDict")})
    with pytest.raises(TypeError, match="'odd'"):
        get_backend_class("odd")


def test_builtin_wins_over_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {"memory": _entry_point("memory", "no_such_module_xyz:Cls")})
    assert get_backend_class("memory") is MemoryBackend


def test_registration_wins_over_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {"mine": _entry_point("mine", "no_such_module_xyz:Cls")})
    register_backend("mine", RecordingBackend)
    assert get_backend_class("mine") is RecordingBackend


def test_entry_points_read_lazily_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        calls.append(group)
        return [_entry_point("Plug", "bcp.backends.memory:MemoryBackend")]

    monkeypatch.setattr(registry, "_entry_points", None)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", fake_entry_points)
    get_backend_class("memory")
    assert calls == [], "entry points were read for a built-in scheme"
    assert get_backend_class("plug") is MemoryBackend and get_backend_class("plug") is MemoryBackend
    assert calls == ["bcp.backends"], f"entry points were read {len(calls)} times, expected once"


@pytest.mark.parametrize(
    "uri",
    ["memory://st/run#1", "memory://st/run#", "s3://bkt/run#1?endpoint_url=http://127.0.0.1:9&part_size=5MiB"],
)
def test_a_fragment_is_refused_by_every_scheme(uri: str) -> None:
    """Everything after '#' was dropped: memory://st/run#1 and run#2 were one location
    (an overwrite of one replaced the other), an S3 URI lost its endpoint and options."""
    with pytest.raises(ValueError, match=r"a storage URI has no #fragment; a name that holds '#' is written %23"):
        backend_for(uri)
    assert backend_for("memory://st/run%231").uri == "memory://st/run#1"


@pytest.mark.parametrize("path", ["runs/a/../exp", "runs/./exp", "runs//exp", ".."])
@pytest.mark.parametrize("scheme", ["memory", "s3", "gs"])
def test_a_root_with_an_empty_dot_or_dotdot_segment_is_refused(scheme: str, path: str) -> None:
    """An object store keeps such segments literally: runs/a/../exp was not runs/exp, and a
    parent's listing held keys its reads and deletes refused."""
    query = "" if scheme == "memory" else "?endpoint_url=http://127.0.0.1:9"
    bucket = "st" if scheme == "memory" else "bkt"
    with pytest.raises(ValueError, match=r"has an empty, '\.' or '\.\.' segment"):
        backend_for(f"{scheme}://{bucket}/{path}{query}")
