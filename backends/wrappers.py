"""Backends that wrap another backend: retrying, and fault injection for tests.

``RetryingBackend`` is what :func:`~bcp.backends.backend_for` puts around every
backend that declares ``network = True`` (S3, GCS, HDFS, generic fsspec), so every
request to a network store goes through one bounded retry loop. Stacking a
``FaultInjectingBackend`` under it (``RetryingBackend(FaultInjectingBackend(real))``)
is how the retry logic is tested against real servers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Self, TypeVar

from bcp.backends.base import Backend, Buffer, IOHints, ObjectWriter, Unfinished
from bcp.backends.retry import RetryPolicy
from bcp.backends.storage_errors import ObjectExistsError, TransientError

T = TypeVar("T")


class ForwardingBackend(Backend):
    """Passes every call and the metadata (scheme, capabilities, hints) through to
    the wrapped backend; subclasses override only what they change."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner.uri)
        self.inner = inner
        self.capabilities = inner.capabilities  # instance attributes shadow the class defaults
        self.scheme = inner.scheme
        self.network = getattr(inner, "network", False)

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Self:  # pragma: no cover - wrappers are built directly
        raise TypeError(f"{cls.__name__} wraps a backend; build it with {cls.__name__}(backend)")

    @property
    def hints(self) -> IOHints:
        return self.inner.hints

    def unwrap(self) -> Backend:
        return self.inner.unwrap()

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return self.inner.open_writer(key, size=size)

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        return self.inner.read_into(key, offset, buffer)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def in_memory(self, key: str, offset: int, nbytes: int) -> bool:
        return self.inner.in_memory(key, offset, nbytes)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def write(self, key: str, data: Buffer) -> None:
        self.inner.write(key, data)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        self.inner.write_if_absent(key, data)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def unfinished(self, prefix: str = "") -> Iterator[Unfinished]:
        return self.inner.unfinished(prefix)

    def delete_unfinished(self, name: str) -> None:
        self.inner.delete_unfinished(name)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class RetryingBackend(ForwardingBackend):
    """Retries transient failures of every call (all bcp requests are idempotent)."""

    def __init__(self, inner: Backend, policy: RetryPolicy | None = None) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()

    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        return self.policy.call(fn, uri=self.uri, key=key, action=action)

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        writer = self._call("starting upload of", key, lambda: self.inner.open_writer(key, size=size))
        return _RetryingWriter(self, writer)

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        return self._call("reading", key, lambda: self.inner.read_into(key, offset, buffer))

    def size(self, key: str) -> int:
        return self._call("sizing", key, lambda: self.inner.size(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(self._call("listing", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._call("deleting", key, lambda: self.inner.delete(key))

    def exists(self, key: str) -> bool:
        return self._call("checking", key, lambda: self.inner.exists(key))

    def write(self, key: str, data: Buffer) -> None:
        self._call("writing", key, lambda: self.inner.write(key, data))

    def write_if_absent(self, key: str, data: Buffer) -> None:
        failed_before = False

        def attempt() -> None:
            nonlocal failed_before
            try:
                return self.inner.write_if_absent(key, data)
            except ObjectExistsError:
                # An earlier attempt may have succeeded with its answer lost: if the
                # object holds exactly our bytes, that attempt won.
                if failed_before and self._call("reading", key, lambda: self.inner.read(key)) == bytes(data):
                    return None
                raise
            except Exception:
                failed_before = True
                raise

        self._call("creating", key, attempt)

    def delete_prefix(self, prefix: str) -> None:
        self._call("deleting prefix", prefix, lambda: self.inner.delete_prefix(prefix))


class ForwardingWriter(ObjectWriter):
    """Passes a writer's calls through to the one it wraps; subclasses override the
    hooks they change (as :class:`ForwardingBackend` does for backends).

    The wrapped writer keeps its own lifecycle, so this one follows it: a repeated
    commit is a no-op when the inner one's is, and a transient failure leaves this one
    open, for a retry loop above it to try again (the inner writer then says whether
    that can work)."""

    retryable_commit = True

    def __init__(self, inner: ObjectWriter, *, uri: str | None = None) -> None:
        super().__init__(inner.uri if uri is None else uri, inner.key)
        self.inner = inner
        self.idempotent_commit = inner.idempotent_commit

    def _write_at(self, offset: int, data: Buffer) -> None:
        self.inner.write_at(offset, data)

    def _commit(self) -> None:
        self.inner.commit()

    def _abort(self) -> None:
        self.inner.abort()


class _RetryingWriter(ForwardingWriter):
    def __init__(self, backend: RetryingBackend, inner: ObjectWriter) -> None:
        super().__init__(inner, uri=backend.uri)
        self.backend = backend

    def _write_at(self, offset: int, data: Buffer) -> None:
        self.backend._call("writing", self.key, lambda: self.inner.write_at(offset, data))

    def _commit(self) -> None:
        self.backend._call("committing", self.key, self.inner.commit)


class FaultInjectingBackend(ForwardingBackend):
    """Makes a working backend misbehave on a schedule, for tests.

    ``fail_every=N``: every Nth call among ``actions`` raises :class:`TransientError`
    (before the call reaches the store, or after it took effect when
    ``fail_after=True``: the store changed but the caller saw an error). ``latency``
    seconds are added to every call. ``truncate_every=M``: every Mth ``read_into``
    returns only the first half of what it could (a body cut short).
    ``permanent=True`` makes the failures non-transient. One count is shared by all
    threads, but a thread whose previous call failed is not failed again at once
    (unless ``fail_every=1``), so a retry loop cannot be starved by the interleaving.
    Counters are thread-safe; ``injected`` counts the faults raised.
    """

    ACTIONS = frozenset({"read", "size", "list", "delete", "exists", "write", "commit", "open"})

    def __init__(
        self,
        inner: Backend,
        *,
        fail_every: int = 0,
        actions: Iterable[str] = ACTIONS,
        fail_after: bool = False,
        latency: float = 0.0,
        truncate_every: int = 0,
        permanent: bool = False,
    ) -> None:
        super().__init__(inner)
        unknown = set(actions) - self.ACTIONS
        if unknown:
            raise ValueError(f"unknown fault actions {sorted(unknown)}; choose from {sorted(self.ACTIONS)}")
        self.fail_every, self.actions, self.fail_after = fail_every, frozenset(actions), fail_after
        self.latency, self.truncate_every, self.permanent = latency, truncate_every, permanent
        self._lock = threading.Lock()
        self._thread = threading.local()
        self.calls = 0
        self.reads = 0
        self.injected = 0
        self.truncated = 0
        self.in_flight = 0
        #: Most calls of any kind that were running at once (shows parallel requests).
        self.max_in_flight = 0

    def _fault(self, action: str, key: str) -> Exception | None:
        if self.latency:
            time.sleep(self.latency)
        if not self.fail_every or action not in self.actions:
            return None
        last = getattr(self._thread, "faulted", False)
        with self._lock:
            self.calls += 1
            # With many threads sharing one count, the same caller could land on the
            # failing slot on every retry; a store does not single one out like that.
            hit = self.calls % self.fail_every == 0 and not (last and self.fail_every > 1)
            self._thread.faulted = hit
            if not hit:
                return None
            self.injected += 1
        reason = f"injected fault #{self.injected} ({action})"
        if self.permanent:
            return PermissionError(reason)
        return TransientError(reason, uri=self.uri, key=key, action=action)

    def _run(self, action: str, key: str, fn: Callable[[], T]) -> T:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            fault = self._fault(action, key)
            if fault is not None and not self.fail_after:
                raise fault
            result = fn()
        finally:
            with self._lock:
                self.in_flight -= 1
        if fault is not None:
            raise fault
        return result

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _FaultyWriter(self, self._run("open", key, lambda: self.inner.open_writer(key, size=size)))

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        n = self._run("read", key, lambda: self.inner.read_into(key, offset, buffer))
        if self.truncate_every and n > 1:
            with self._lock:
                self.reads += 1
                cut = self.reads % self.truncate_every == 0
                self.truncated += cut
            if cut:
                return n // 2
        return n

    def size(self, key: str) -> int:
        return self._run("size", key, lambda: self.inner.size(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(self._run("list", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def exists(self, key: str) -> bool:
        return self._run("exists", key, lambda: self.inner.exists(key))

    def write(self, key: str, data: Buffer) -> None:
        self._run("write", key, lambda: self.inner.write(key, data))

    def write_if_absent(self, key: str, data: Buffer) -> None:
        self._run("write", key, lambda: self.inner.write_if_absent(key, data))

    def delete_prefix(self, prefix: str) -> None:
        self._run("delete", prefix, lambda: self.inner.delete_prefix(prefix))


class _FaultyWriter(ForwardingWriter):
    def __init__(self, backend: FaultInjectingBackend, inner: ObjectWriter) -> None:
        super().__init__(inner, uri=backend.uri)
        self.backend = backend

    def _write_at(self, offset: int, data: Buffer) -> None:
        self.backend._run("write", self.key, lambda: self.inner.write_at(offset, data))

    def _commit(self) -> None:
        self.backend._run("commit", self.key, self.inner.commit)
