"""What every group of the object contract shares: the hooks a backend author
overrides, the helpers the tests use, and the heading each group reports under.

The tests themselves live in one class per operation (object_data.py,
object_keys.py, object_commit.py); :class:`~bcp.conformance.BackendContractTests`
inherits them all. Each of those classes derives from :class:`ObjectContractBase`,
so one group can be run alone with the same ``backend`` fixture and raw hooks.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, TypeVar

import pytest

from bcp.backends import Backend

T = TypeVar("T")

#: Seconds any thread in a concurrency test may take before the test fails instead of hanging.
THREAD_TIMEOUT = 60.0
THREADS = 8

#: Part sizes for multi-part writes when the backend has no ``part_size``: tiny, page-sized,
#: odd and large parts mixed, so an off-by-one in offset handling shows.
IRREGULAR_PARTS = (1, 4095, 1, 65536, 3, 12345, 7, 100_000, 17, 4096, 4097, 999, 2, 65535, 5, 33_333)

INVALID_KEYS = ["", "/a", "a//b", "a/../b", "./a", "a/", "a/.", "..", "a\\b", "a\0b"]


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes that differ at every position, so a shifted or truncated
    read cannot match by accident."""
    return random.Random(seed).randbytes(n)


def check_bytes(got: bytes | bytearray | memoryview, want: bytes, guarantee: str) -> None:
    """Compare without dumping megabytes into the failure message."""
    got = bytes(got)
    if got == want:
        return
    if len(got) != len(want):
        detail = f"got {len(got)} bytes, expected {len(want)}"
    else:
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        detail = f"{len(got)} bytes, first difference at byte {first}"
    raise AssertionError(f"{guarantee} ({detail})")


def expect_raises(
    exc_type: type[BaseException] | tuple[type[BaseException], ...], guarantee: str, fn: Callable[[], object]
) -> BaseException:
    """Like ``pytest.raises`` but fails with a message naming the broken guarantee."""
    try:
        fn()
    except exc_type as e:
        return e
    except BaseException as e:
        raise AssertionError(f"{guarantee} (raised {type(e).__name__}: {e})") from e
    raise AssertionError(f"{guarantee} (nothing was raised)")


def in_threads(n: int, fn: Callable[[int], T]) -> list[T]:
    """Run ``fn(0) .. fn(n-1)`` on ``n`` threads released together by a barrier, so they
    really overlap; returns the results in order and re-raises the first error."""
    barrier = threading.Barrier(n, timeout=THREAD_TIMEOUT)

    def call(i: int) -> T:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(call, i) for i in range(n)]
        return [f.result(timeout=THREAD_TIMEOUT) for f in futures]


def _read_into_one(b: Backend, k: str) -> object:
    return b.read_into(k, 0, memoryview(bytearray(1)))


#: Every keyed operation, for the "invalid keys are rejected everywhere" tests.
KEYED_OPS: dict[str, Callable[[Backend, str], object]] = {
    "write": lambda b, k: b.write(k, b"x"),
    "write_if_absent": lambda b, k: b.write_if_absent(k, b"x"),
    "open_writer": lambda b, k: b.open_writer(k).abort(),
    "read_into": _read_into_one,
    "read": lambda b, k: b.read(k),
    "size": lambda b, k: b.size(k),
    "exists": lambda b, k: b.exists(k),
    "delete": lambda b, k: b.delete(k),
}

#: Operations that must report a missing object as ObjectNotFoundError.
READ_OPS: dict[str, Callable[[Backend, str], object]] = {
    "read_into": _read_into_one,
    "read": lambda b, k: b.read(k),
    "read_exact": lambda b, k: b.read_exact(k, 0, memoryview(bytearray(1))),
    "size": lambda b, k: b.size(k),
}


class ObjectContractBase:
    """Hooks and helpers of every object-contract group. Declares no heading and no
    tests: each group class below it sets ``report_heading`` for the tests it defines."""

    #: The heading the conformance report shows this class's own tests under. Every
    #: class that defines tests declares it, so the report never guesses from test names.
    report_heading: ClassVar[str]

    # -- what the implementer provides -------------------------------------------------

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        """The backend under test, on an empty store, fresh for each test."""
        raise NotImplementedError("override the `backend` fixture to build the backend under test")

    def raw_put(self, backend: Backend, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` without going through ``backend``."""
        raise NotImplementedError("override raw_put to write objects without the backend under test")

    def raw_get(self, backend: Backend, key: str) -> bytes:
        """Fetch ``key`` without going through ``backend``."""
        raise NotImplementedError("override raw_get to read objects without the backend under test")

    # -- helpers -----------------------------------------------------------------------

    def _has_raw_put(self) -> bool:
        return type(self).raw_put is not ObjectContractBase.raw_put

    def _has_raw_get(self) -> bool:
        return type(self).raw_get is not ObjectContractBase.raw_get

    def _need_raw_put(self) -> None:
        if not self._has_raw_put():
            pytest.skip(f"{type(self).__name__} does not override raw_put; cannot cross-check reads against the store")

    def _need_raw_get(self) -> None:
        if not self._has_raw_get():
            pytest.skip(f"{type(self).__name__} does not override raw_get; cannot cross-check writes against the store")

    def seed(self, backend: Backend, key: str, data: bytes) -> None:
        """Put an object for a read test: raw when possible, so reads are tested alone."""
        if self._has_raw_put():
            self.raw_put(backend, key, data)
        else:
            backend.write(key, data)

    def fetch(self, backend: Backend, key: str) -> bytes:
        """Get an object for a write test: raw when possible, so writes are tested alone."""
        return self.raw_get(backend, key) if self._has_raw_get() else backend.read(key)

    @staticmethod
    def part_layout(backend: Backend) -> list[tuple[int, int]]:
        """``(offset, length)`` parts covering an object, aligned to ``hints.part_size``
        when the backend sets one (only the last part may be shorter)."""
        part_size = backend.hints.part_size
        sizes = IRREGULAR_PARTS if part_size is None else (part_size,) * 4 + (part_size // 2 + 1,)
        parts, offset = [], 0
        for n in sizes:
            parts.append((offset, n))
            offset += n
        return parts

    @staticmethod
    def _layout_size(parts: list[tuple[int, int]]) -> int:
        return parts[-1][0] + parts[-1][1]

    def _write_all(self, backend: Backend, keys: list[str]) -> None:
        for k in keys:
            self.seed(backend, k, k.encode())
