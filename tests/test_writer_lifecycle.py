"""The writer lifecycle that ``ObjectWriter`` owns (open, then committed or aborted):
first the state machine itself on a recording writer, then every built-in writer
through its backend, so none of them can drift from it."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import bcp.backends as backends
import bcp.backends.retry as retry_mod
import bcp.backends.storage_errors as errors_mod
from bcp.backends import (
    Backend,
    Buffer,
    ObjectWriter,
    StorageError,
    TransientError,
    WriterClosedError,
    backend_for,
)
from bcp.backends.hdfs import ArrowFsBackend
from bcp.backends.memory import clear_memory_store
from bcp.backends.retry import RetryPolicy
from bcp.backends.wrappers import FaultInjectingBackend, ForwardingWriter, RetryingBackend

# -- the state machine, on a writer that records its hook calls ---------------------------------


class _Boom(Exception):
    pass


def _write_in_a_block_that_raises(writer: ObjectWriter, data: bytes) -> None:
    """``with writer:`` around a write, then the caller's code fails (raises _Boom)."""
    with writer:
        writer.write_at(0, data)
        raise _Boom


class RecordingWriter(ObjectWriter):
    """Implements the hooks only; ``fail_commit`` makes ``_commit`` raise that error."""

    def __init__(self, fail_commit: BaseException | None = None) -> None:
        super().__init__("rec://store", "the/key")
        self.calls: list[str] = []
        self.fail_commit = fail_commit

    def _write_at(self, offset: int, data: Buffer) -> None:
        self.calls.append(f"write {offset} {bytes(data)!r}")

    def _commit(self) -> None:
        self.calls.append("commit")
        if self.fail_commit is not None:
            error, self.fail_commit = self.fail_commit, None  # fails once
            raise error

    def _abort(self) -> None:
        self.calls.append("abort")


def _closed(action: str, fn: Callable[[], object]) -> WriterClosedError:
    with pytest.raises(WriterClosedError) as info:
        fn()
    e = info.value
    assert (e.uri, e.key, e.action) == ("rec://store", "the/key", action), f"the error does not name the writer: {e}"
    assert "the/key" in str(e) and action in str(e), f"the message lacks key or action: {e}"
    return e


def test_write_after_commit_is_refused() -> None:
    w = RecordingWriter()
    w.write_at(0, b"x")
    w.commit()
    e = _closed("writing", lambda: w.write_at(1, b"y"))
    assert "committed" in str(e) and w.calls == ["write 0 b'x'", "commit"], w.calls


def test_write_after_abort_is_refused() -> None:
    w = RecordingWriter()
    w.abort()
    e = _closed("writing", lambda: w.write_at(0, b"y"))
    assert "aborted" in str(e) and w.calls == ["abort"], w.calls


def test_commit_after_abort_is_refused() -> None:
    w = RecordingWriter()
    w.abort()
    _closed("committing", w.commit)
    assert w.calls == ["abort"], f"the hook ran on an aborted writer: {w.calls}"


def test_second_commit_is_refused_unless_idempotent() -> None:
    w = RecordingWriter()
    w.commit()
    _closed("committing", w.commit)
    idem = RecordingWriter()
    idem.idempotent_commit = True
    idem.commit()
    idem.commit()
    assert idem.calls == ["commit"], f"an idempotent second commit ran the hook again: {idem.calls}"


def test_abort_is_idempotent_and_a_no_op_after_commit() -> None:
    w = RecordingWriter()
    w.abort()
    w.abort()
    assert w.calls == ["abort"], f"_abort ran more than once: {w.calls}"
    c = RecordingWriter()
    c.commit()
    c.abort()
    assert c.calls == ["commit"], f"abort after commit reached the hook: {c.calls}"


def test_failed_commit_aborts_and_stays_closed() -> None:
    w = RecordingWriter(fail_commit=_Boom("disk on fire"))
    with pytest.raises(_Boom):
        w.commit()
    assert w.calls == ["commit", "abort"], f"a failed commit did not abort the writer: {w.calls}"
    w.abort()  # safe after a failed commit
    _closed("committing", w.commit)
    assert w.calls == ["commit", "abort"], w.calls


def test_failed_commit_cleanup_error_does_not_hide_the_commit_error() -> None:
    class BadCleanup(RecordingWriter):
        def _abort(self) -> None:
            super()._abort()
            raise OSError("cleanup failed too")

    w = BadCleanup(fail_commit=_Boom("the real failure"))
    with pytest.raises(_Boom, match="the real failure"):
        w.commit()
    assert w.calls == ["commit", "abort"], w.calls


def test_retryable_commit_stays_open_after_a_transient_failure() -> None:
    w = RecordingWriter(fail_commit=TransientError("slow down", uri="rec://store", key="the/key", action="committing"))
    w.retryable_commit = True
    with pytest.raises(TransientError):
        w.commit()
    w.commit()  # the retry
    assert w.calls == ["commit", "commit"], f"a transient commit failure was not left open for a retry: {w.calls}"
    w.abort()
    assert w.calls == ["commit", "commit"], "abort after the retried commit reached the hook"


def test_retryable_commit_aborts_after_a_permanent_failure() -> None:
    w = RecordingWriter(fail_commit=PermissionError("denied"))
    w.retryable_commit = True
    with pytest.raises(PermissionError):
        w.commit()
    assert w.calls == ["commit", "abort"], f"a permanent failure left the writer open: {w.calls}"
    _closed("committing", w.commit)


def test_with_block_that_raises_aborts() -> None:
    w = RecordingWriter()
    with pytest.raises(_Boom):
        _write_in_a_block_that_raises(w, b"x")
    assert w.calls == ["write 0 b'x'", "abort"], w.calls


def test_with_block_that_commits_stays_committed() -> None:
    with RecordingWriter() as w:
        w.write_at(0, b"x")
        w.commit()
    assert w.calls == ["write 0 b'x'", "commit"], f"leaving the block touched a committed writer: {w.calls}"


def test_with_block_left_without_commit_aborts() -> None:
    with RecordingWriter() as w:
        w.write_at(0, b"x")
    assert w.calls == ["write 0 b'x'", "abort"], w.calls


def test_a_writer_missing_a_hook_fails_when_constructed() -> None:
    class NoAbort(ObjectWriter):
        def _write_at(self, offset: int, data: Buffer) -> None: ...

        def _commit(self) -> None: ...

    with pytest.raises(TypeError, match="_abort"):
        NoAbort("rec://store", "k")


@pytest.mark.parametrize("public", ["write_at", "commit", "abort"])
def test_a_writer_overriding_the_public_methods_instead_of_the_hooks_is_refused(public: str) -> None:
    """No writer interface without the hooks was ever published, so there is no adapter
    for one: a writer that overrides a public method instead of its hook does not
    construct, naming the hook it lacks (rather than silently losing the lifecycle)."""
    hooks = {"write_at": "_write_at", "commit": "_commit", "abort": "_abort"}
    body = {
        name: (lambda self, *a: None) for name in ["_write_at", "_commit", "_abort", public] if name != hooks[public]
    }
    Partial = type("Partial", (ObjectWriter,), body)
    with pytest.raises(TypeError, match=hooks[public]):
        Partial("rec://store", "k")


def test_forwarding_writer_follows_the_inner_writer() -> None:
    inner = RecordingWriter()
    inner.idempotent_commit = True
    outer = ForwardingWriter(inner)
    outer.write_at(0, b"x")
    outer.commit()
    outer.commit()  # idempotent because the inner writer is
    with pytest.raises(WriterClosedError):
        outer.write_at(1, b"y")
    assert inner.calls == ["write 0 b'x'", "commit"] and (outer.uri, outer.key) == ("rec://store", "the/key")


def test_error_types_are_exported_once() -> None:
    assert backends.TransientError is errors_mod.TransientError is retry_mod.TransientError
    assert backends.WriterClosedError is errors_mod.WriterClosedError
    assert {"TransientError", "WriterClosedError"} <= set(backends.__all__)
    e = WriterClosedError("the writer was already committed", uri="u://x", key="k", action="writing")
    assert isinstance(e, StorageError) and isinstance(e, ValueError), "WriterClosedError is not a StorageError"
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is WriterClosedError and str(again) == str(e)


# -- every built-in writer that runs without a server (and S3/GCS on the test servers) ----------


def _local_arrow(tmp_path: Path) -> Backend:
    """The HDFS backend's class over pyarrow's local filesystem."""
    root = tmp_path / "arrow"
    root.mkdir()
    return ArrowFsBackend(f"arrow://{root}", pafs.LocalFileSystem(), str(root), part_size=64 << 10)


def _server_backend(request: pytest.FixtureRequest, kind: str) -> Backend:
    from conftest import new_bucket, store_uri

    server = request.getfixturevalue({"s3": "moto_server", "gcs": "gcs_server"}[kind])
    extra = {"part_size": "256KiB", "conditional_writes": "false"} if kind == "gcs" else {}
    uri = store_uri("moto" if kind == "s3" else "gcs", server, new_bucket(server), uuid.uuid4().hex, **extra)
    return backend_for(uri).unwrap()  # the store's own writer; the retry wrapper is tested on memory


KINDS = ["file", "memory", "sqlite", "fsspec-memory", "arrow-local", "retrying", "fault-injecting", "s3", "gcs"]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """An empty backend of each kind."""
    kind = request.param
    name = f"lc{uuid.uuid4().hex[:12]}"
    if kind == "file":
        backend = backend_for(str(tmp_path / "store"))
    elif kind in ("memory", "retrying", "fault-injecting"):
        backend = backend_for(f"memory://{name}/root")
        if kind == "retrying":
            backend = RetryingBackend(backend, RetryPolicy(attempts=2, base_delay=0.0))
        elif kind == "fault-injecting":
            backend = FaultInjectingBackend(backend)  # no faults: only its writer is under test
    elif kind == "sqlite":
        pytest.importorskip("bcp_sqlite")
        backend = backend_for(f"sqlite://{tmp_path}/store.db/root")
    elif kind == "fsspec-memory":
        backend = backend_for(f"fsspec+memory://{name}/root?part_size=64KiB")
    elif kind == "arrow-local":
        backend = _local_arrow(tmp_path)
    else:
        backend = _server_backend(request, kind)
    yield backend
    backend.close()
    clear_memory_store(name)


def _nothing_visible(backend: Backend, key: str) -> bool:
    return not backend.exists(key) and list(backend.list("")) == []


def test_store_write_after_commit_raises_and_keeps_the_object(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    writer.write_at(0, b"data")
    writer.commit()
    with pytest.raises(WriterClosedError) as info:
        writer.write_at(0, b"more")
    assert info.value.key == "lc/k" and info.value.action == "writing", f"the error does not name it: {info.value}"
    assert store.read("lc/k") == b"data", "a write after commit changed the object"


def test_store_commit_after_abort_raises_and_shows_nothing(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    writer.write_at(0, b"data")
    writer.abort()
    with pytest.raises(WriterClosedError) as info:
        writer.commit()
    assert info.value.action == "committing", f"wrong action: {info.value}"
    assert _nothing_visible(store, "lc/k"), "commit after abort made the object visible"


def test_store_write_after_abort_raises(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    writer.abort()
    with pytest.raises(WriterClosedError):
        writer.write_at(0, b"data")
    assert _nothing_visible(store, "lc/k")


def test_store_abort_twice_is_fine(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    writer.write_at(0, b"data")
    writer.abort()
    writer.abort()
    assert _nothing_visible(store, "lc/k"), "an aborted writer left something visible"


def test_store_abort_after_commit_keeps_the_object(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    writer.write_at(0, b"data")
    writer.commit()
    writer.abort()
    assert store.read("lc/k") == b"data", "abort after commit removed or changed the object"


def test_store_second_commit_follows_idempotent_commit(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    writer.write_at(0, b"data")
    writer.commit()
    if writer.idempotent_commit:
        writer.commit()  # a retried commit whose answer was lost: a no-op
    else:
        with pytest.raises(WriterClosedError):
            writer.commit()
    assert store.read("lc/k") == b"data" and list(store.list("")) == ["lc/k"]


def test_store_with_block_that_raises_aborts(store: Backend) -> None:
    writer = store.open_writer("lc/k", size=4)
    with pytest.raises(_Boom):
        _write_in_a_block_that_raises(writer, b"data")
    assert _nothing_visible(store, "lc/k"), "a with-block that raised left its object visible"
    with pytest.raises(WriterClosedError):
        writer.commit()


def test_store_with_block_that_completes_commits(store: Backend) -> None:
    with store.open_writer("lc/k", size=4) as writer:
        writer.write_at(0, b"data")
        writer.commit()
    assert store.read("lc/k") == b"data" and list(store.list("")) == ["lc/k"], "the committed object is not visible"
