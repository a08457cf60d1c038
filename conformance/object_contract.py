"""The object contract every storage backend must keep, as pytest tests.

Use it from a test module of your backend::

    from bcp.conformance import BackendContractTests

    class TestMyBackend(BackendContractTests):
        @pytest.fixture
        def backend(self, tmp_path):
            b = MyBackend.from_uri(...)   # an EMPTY store, fresh for every test
            yield b
            b.close()

        def raw_put(self, backend, key, data): ...   # write with the store's own SDK
        def raw_get(self, backend, key): ...         # read with the store's own SDK

The ``backend`` fixture must give an empty store (or an empty root inside one) to each
test: listing tests compare against exactly the keys they wrote.

The raw hooks bypass the backend under test, so a broken write cannot hide a broken
read (and the reverse): read tests seed their objects with ``raw_put`` and write tests
check what landed with ``raw_get``. Without the hooks those tests fall back to the
backend's own ``write``/``read``, and the tests that exist only to cross-check
against the store are skipped.

Tests are grouped by operation (round trip, multi-part writes, ranged reads, list,
delete, keys, missing objects, writer lifecycle, create-only writes, concurrency);
each checks one guarantee and fails with a message naming it. Tests for optional
guarantees (``Capability.PARALLEL_WRITES``, ``Capability.CREATE_ONLY``) skip when the
backend does not declare them.
"""

from __future__ import annotations

import array
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
from bcp.backends import Backend, Capability, ObjectExistsError, ObjectNotFoundError

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
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        detail = f"{len(got)} bytes, first difference at byte {first}"
    raise AssertionError(f"{guarantee} ({detail})")


def expect_raises(exc_type: type[BaseException] | tuple[type[BaseException], ...], guarantee: str,
                  fn: Callable[[], object]) -> BaseException:
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


class BackendContractTests:
    """Base class of a backend's contract tests. Not collected itself (no ``Test`` prefix)."""

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
        return type(self).raw_put is not BackendContractTests.raw_put

    def _has_raw_get(self) -> bool:
        return type(self).raw_get is not BackendContractTests.raw_get

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

    # -- round trip --------------------------------------------------------------------

    def test_round_trip_empty_object(self, backend: Backend) -> None:
        backend.write("empty", b"")
        check_bytes(backend.read("empty"), b"", "round trip of an empty object returned different bytes")

    def test_empty_object_exists(self, backend: Backend) -> None:
        backend.write("empty", b"")
        assert backend.exists("empty"), "an empty object does not exist after being written"

    def test_empty_object_size_is_zero(self, backend: Backend) -> None:
        backend.write("empty", b"")
        assert backend.size("empty") == 0, "size of an empty object is not 0"

    def test_round_trip_one_byte_object(self, backend: Backend) -> None:
        backend.write("tiny", b"\x7f")
        check_bytes(backend.read("tiny"), b"\x7f", "round trip of a 1-byte object returned different bytes")

    def test_round_trip_odd_sized_object(self, backend: Backend) -> None:
        data = payload(1_000_003)
        backend.write("odd", data)
        check_bytes(backend.read("odd"), data, "round trip of a 1_000_003-byte object returned different bytes")

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
    def test_write_accepts_any_buffer(self, backend: Backend, kind: str) -> None:
        data = payload(4099, seed=3)
        buf = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}[kind]
        backend.write("buf", buf)
        check_bytes(backend.read("buf"), data, f"write from a {kind} stored different bytes")

    def test_write_lands_in_store(self, backend: Backend) -> None:
        self._need_raw_get()
        data = payload(70_001, seed=4)
        backend.write("landed", data)
        check_bytes(self.raw_get(backend, "landed"), data, "write stored different bytes than given (checked raw)")

    def test_read_sees_raw_object(self, backend: Backend) -> None:
        self._need_raw_put()
        data = payload(70_001, seed=5)
        self.raw_put(backend, "raw", data)
        check_bytes(backend.read("raw"), data, "read of an object put by the store itself returned different bytes")

    def test_size_of_raw_object(self, backend: Backend) -> None:
        self._need_raw_put()
        self.raw_put(backend, "raw", payload(12_345))
        assert backend.size("raw") == 12_345, "size of an object put by the store itself is wrong"

    def test_exists_for_raw_object(self, backend: Backend) -> None:
        self._need_raw_put()
        self.raw_put(backend, "raw", b"x")
        assert backend.exists("raw"), "exists is False for an object put by the store itself"

    def test_list_shows_raw_object(self, backend: Backend) -> None:
        self._need_raw_put()
        self.raw_put(backend, "d/raw", b"x")
        assert list(backend.list("")) == ["d/raw"], "list does not show an object put by the store itself"

    # -- multi-part writes -------------------------------------------------------------

    def _write_parts(self, backend: Backend, key: str, data: bytes, order: list[tuple[int, int]],
                     threads: int = 1) -> None:
        view = memoryview(data)
        with backend.open_writer(key, size=len(data)) as writer:
            if threads == 1:
                for off, n in order:
                    writer.write_at(off, view[off : off + n])
            else:
                with ThreadPoolExecutor(max_workers=threads) as pool:
                    list(pool.map(lambda p: writer.write_at(p[0], view[p[0] : p[0] + p[1]]), order))
            writer.commit()

    def test_multipart_write_in_order(self, backend: Backend) -> None:
        parts = self.part_layout(backend)
        data = payload(self._layout_size(parts), seed=6)
        self._write_parts(backend, "mp", data, parts)
        check_bytes(self.fetch(backend, "mp"), data, "multi-part write in offset order stored wrong bytes")

    def test_multipart_write_shuffled_order(self, backend: Backend) -> None:
        parts = self.part_layout(backend)
        data = payload(self._layout_size(parts), seed=7)
        order = list(parts)
        random.Random(7).shuffle(order)
        self._write_parts(backend, "mp", data, order)
        check_bytes(self.fetch(backend, "mp"), data, "multi-part write in shuffled order stored wrong bytes")

    def test_multipart_write_from_threads(self, backend: Backend) -> None:
        if Capability.PARALLEL_WRITES not in backend.capabilities:
            pytest.skip("backend does not declare Capability.PARALLEL_WRITES")
        parts = self.part_layout(backend)
        data = payload(self._layout_size(parts), seed=8)
        order = list(parts)
        random.Random(8).shuffle(order)
        self._write_parts(backend, "mp", data, order, threads=THREADS)
        check_bytes(self.fetch(backend, "mp"), data, "multi-part write from several threads stored wrong bytes")

    def test_multipart_write_without_size_hint(self, backend: Backend) -> None:
        parts = self.part_layout(backend)
        data = payload(self._layout_size(parts), seed=9)
        view = memoryview(data)
        with backend.open_writer("mp") as writer:
            for off, n in reversed(parts):
                writer.write_at(off, view[off : off + n])
            writer.commit()
        check_bytes(self.fetch(backend, "mp"), data, "multi-part write without a size hint stored wrong bytes")

    def test_writer_does_not_keep_caller_buffer(self, backend: Backend) -> None:
        data = payload(10_000, seed=10)
        buf = bytearray(data)
        with backend.open_writer("reuse", size=len(buf)) as writer:
            writer.write_at(0, buf)
            buf[:] = b"\xff" * len(buf)  # the caller reuses its buffer right after write_at
            writer.commit()
        check_bytes(self.fetch(backend, "reuse"), data, "writer kept a reference to the caller's buffer after write_at")

    # -- ranged reads ------------------------------------------------------------------

    RANGED_SIZE = 100_003

    @pytest.fixture
    def ranged(self, backend: Backend) -> bytes:
        """An odd-sized object under key "ranged", seeded raw when possible."""
        data = payload(self.RANGED_SIZE, seed=11)
        self.seed(backend, "ranged", data)
        return data

    def test_read_into_at_start_returns_full_count(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(1000)
        n = backend.read_into("ranged", 0, memoryview(buf))
        assert n == 1000, f"ranged read at start of object returned {n} bytes, expected 1000"

    def test_read_into_at_start(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(1000)
        backend.read_into("ranged", 0, memoryview(buf))
        check_bytes(buf, ranged[:1000], "ranged read at start of object returned wrong bytes")

    def test_read_into_in_middle_returns_full_count(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(1234)
        n = backend.read_into("ranged", 49_999, memoryview(buf))
        assert n == 1234, f"ranged read in the middle of object returned {n} bytes, expected 1234"

    def test_read_into_in_middle(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(1234)
        backend.read_into("ranged", 49_999, memoryview(buf))
        check_bytes(buf, ranged[49_999 : 49_999 + 1234], "ranged read in the middle of object returned wrong bytes")

    def test_read_into_at_end_returns_short_count(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(1000)
        n = backend.read_into("ranged", self.RANGED_SIZE - 100, memoryview(buf))
        assert n == 100, f"ranged read running past end of object returned {n} bytes, expected the 100 left"

    def test_read_into_at_end(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(1000)
        n = backend.read_into("ranged", self.RANGED_SIZE - 100, memoryview(buf))
        check_bytes(buf[:n], ranged[-100:], "ranged read at end of object returned wrong bytes")

    @pytest.mark.parametrize("beyond", [0, 1, 10_000])
    def test_read_into_past_end_returns_zero(self, backend: Backend, ranged: bytes, beyond: int) -> None:
        n = backend.read_into("ranged", self.RANGED_SIZE + beyond, memoryview(bytearray(16)))
        assert n == 0, f"ranged read {beyond} bytes past the end of object returned {n}, expected 0"

    @pytest.mark.parametrize("offset", [0, 500])
    def test_read_into_zero_length_buffer_returns_zero(self, backend: Backend, ranged: bytes, offset: int) -> None:
        n = backend.read_into("ranged", offset, memoryview(bytearray(0)))
        assert n == 0, f"read_into a zero-length buffer returned {n}, expected 0"

    def test_read_into_typed_buffer(self, backend: Backend, ranged: bytes) -> None:
        buf = array.array("I", bytes(4000))  # a non-byte memoryview format, as tensors give
        n = backend.read_into("ranged", 8, memoryview(buf))
        assert n == 4000 and buf.tobytes() == ranged[8:4008], "read_into a typed (non-byte) buffer read wrong bytes"

    def test_read_whole_object(self, backend: Backend, ranged: bytes) -> None:
        check_bytes(backend.read("ranged"), ranged, "read() of the whole object returned wrong bytes")

    def test_read_offset_and_length(self, backend: Backend, ranged: bytes) -> None:
        check_bytes(backend.read("ranged", 777, 3333), ranged[777:4110], "read(offset, length) returned wrong bytes")

    def test_read_from_offset_to_end(self, backend: Backend, ranged: bytes) -> None:
        check_bytes(backend.read("ranged", 90_000), ranged[90_000:], "read(offset) to the end returned wrong bytes")

    def test_read_past_end_is_empty(self, backend: Backend, ranged: bytes) -> None:
        check_bytes(backend.read("ranged", self.RANGED_SIZE + 5), b"", "read() past the end of object was not empty")

    def test_read_length_past_end_is_truncated(self, backend: Backend, ranged: bytes) -> None:
        got = backend.read("ranged", self.RANGED_SIZE - 10, 100)
        check_bytes(got, ranged[-10:], "read() with a length running past the end did not stop at the end")

    def test_read_exact_fills_buffer(self, backend: Backend, ranged: bytes) -> None:
        buf = bytearray(5000)
        backend.read_exact("ranged", 95_003, memoryview(buf))
        check_bytes(buf, ranged[95_003:], "read_exact returned wrong bytes")

    def test_read_exact_past_end_raises_eof(self, backend: Backend, ranged: bytes) -> None:
        expect_raises(EOFError, "read_exact running past the end of object did not raise EOFError",
                      lambda: backend.read_exact("ranged", self.RANGED_SIZE - 10, memoryview(bytearray(11))))

    def test_size(self, backend: Backend, ranged: bytes) -> None:
        assert backend.size("ranged") == self.RANGED_SIZE, "size() does not match the object's length"

    # -- list --------------------------------------------------------------------------

    NESTED = ["a", "ab", "abc/x", "abd", "b/ab", "x/abc/y", "x/y/z", "x/ab"]

    def _write_all(self, backend: Backend, keys: list[str]) -> None:
        for k in keys:
            self.seed(backend, k, k.encode())

    def test_list_empty_store_is_empty(self, backend: Backend) -> None:
        assert list(backend.list("")) == [], "list('') of an empty store is not empty"

    def test_list_empty_prefix_lists_all(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("")) == sorted(self.NESTED), "list('') does not return exactly every key"

    def test_list_default_prefix_lists_all(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list()) == sorted(self.NESTED), "list() without a prefix does not return every key"

    def test_list_directory_prefix(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("x/")) == ["x/ab", "x/abc/y", "x/y/z"], "list('x/') returned wrong keys"

    def test_list_string_prefix_is_not_a_directory(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("ab")) == ["ab", "abc/x", "abd"], (
            "list('ab') must match every key starting with the string 'ab' ('ab', 'abc/x', 'abd')"
        )

    def test_list_string_prefix_inside_directory(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("x/ab")) == ["x/ab", "x/abc/y"], "list('x/ab') returned wrong keys"

    def test_list_prefix_equal_to_a_key(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert list(backend.list("x/y/z")) == ["x/y/z"], "list(prefix equal to a key) does not return that key"

    def test_list_prefix_without_matches_is_empty(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        for prefix in ("nope", "x/q", "abc/x/", "a/"):
            assert list(backend.list(prefix)) == [], f"list({prefix!r}) matched keys although none start with it"

    def test_list_many_keys(self, backend: Backend) -> None:
        keys = [f"many/{i % 7}/k{i:03d}" for i in range(200)]
        self._write_all(backend, keys)
        assert sorted(backend.list("many/")) == sorted(keys), "list of 200 keys did not return exactly those keys"

    def test_list_returns_each_key_once(self, backend: Backend) -> None:
        keys = [f"dup/{i % 5}/k{i}" for i in range(40)]
        self._write_all(backend, keys)
        found = list(backend.list(""))
        assert len(found) == len(set(found)), "list returned a key more than once"

    def test_list_hides_uncommitted_writer(self, backend: Backend) -> None:
        self.seed(backend, "w/done", b"1")
        with backend.open_writer("w/pending", size=3) as writer:
            writer.write_at(0, b"abc")
            assert sorted(backend.list("")) == ["w/done"], "list shows an object whose writer has not committed"
            writer.abort()

    def test_list_hides_uncommitted_overwrite_duplicates(self, backend: Backend) -> None:
        self.seed(backend, "w/k", b"old")
        with backend.open_writer("w/k", size=3) as writer:
            writer.write_at(0, b"new")
            assert list(backend.list("w/")) == ["w/k"], "list shows a pending overwrite as a second entry"
            writer.abort()

    # -- delete ------------------------------------------------------------------------

    def test_delete_removes_object(self, backend: Backend) -> None:
        self.seed(backend, "gone", b"data")
        backend.delete("gone")
        assert not backend.exists("gone"), "exists is True after delete"

    def test_deleted_object_is_not_listed(self, backend: Backend) -> None:
        self.seed(backend, "d/gone", b"data")
        backend.delete("d/gone")
        assert list(backend.list("")) == [], "list shows a deleted object"

    def test_deleted_object_read_raises_not_found(self, backend: Backend) -> None:
        self.seed(backend, "gone", b"data")
        backend.delete("gone")
        expect_raises(FileNotFoundError, "reading a deleted object did not raise FileNotFoundError",
                      lambda: backend.read("gone"))

    def test_delete_missing_key_is_not_an_error(self, backend: Backend) -> None:
        try:
            backend.delete("never/was")
        except Exception as e:
            raise AssertionError(f"deleting a missing key raised {type(e).__name__}: {e}") from e

    def test_delete_keeps_siblings(self, backend: Backend) -> None:
        self._write_all(backend, ["s/a", "s/b", "s/c/d"])
        backend.delete("s/b")
        assert sorted(backend.list("")) == ["s/a", "s/c/d"], "delete removed keys other than the one named"

    def test_delete_keeps_keys_it_prefixes(self, backend: Backend) -> None:
        self._write_all(backend, ["p", "p2", "p3/q"])
        backend.delete("p")
        assert sorted(backend.list("")) == ["p2", "p3/q"], "delete('p') removed keys that merely start with 'p'"

    def test_write_after_delete(self, backend: Backend) -> None:
        backend.write("r/e/k", b"one")
        backend.delete("r/e/k")
        backend.write("r/e/k", b"two")
        check_bytes(self.fetch(backend, "r/e/k"), b"two", "writing a key again after deleting it failed")

    def test_delete_prefix_removes_only_keys_under_prefix(self, backend: Backend) -> None:
        self._write_all(backend, ["run/a", "run/b/c", "run/b/d/e", "runner/x", "other", "r"])
        backend.delete_prefix("run/")
        assert sorted(backend.list("")) == ["other", "r", "runner/x"], (
            "delete_prefix('run/') did not remove exactly the keys under 'run/'"
        )

    def test_delete_prefix_without_matches(self, backend: Backend) -> None:
        self._write_all(backend, ["keep/a"])
        backend.delete_prefix("nothing/")
        assert list(backend.list("")) == ["keep/a"], "delete_prefix of an unmatched prefix removed something"

    # -- exists and keys that are only prefixes -----------------------------------------

    def test_exists_false_for_missing(self, backend: Backend) -> None:
        assert not backend.exists("missing"), "exists is True for a key never written"

    def test_exists_true_after_write(self, backend: Backend) -> None:
        backend.write("here", b"x")
        assert backend.exists("here"), "exists is False after write"

    def test_exists_false_for_directory_like_prefix(self, backend: Backend) -> None:
        self.seed(backend, "dir/obj", b"x")
        assert not backend.exists("dir"), "exists is True for 'dir', which is only a prefix of 'dir/obj'"

    def test_size_of_directory_like_prefix_raises_not_found(self, backend: Backend) -> None:
        self.seed(backend, "dir/obj", b"x")
        expect_raises(ObjectNotFoundError,
                      "size('dir') of a mere prefix of 'dir/obj' did not raise ObjectNotFoundError",
                      lambda: backend.size("dir"))

    def test_read_into_directory_like_prefix_raises_not_found(self, backend: Backend) -> None:
        self.seed(backend, "dir/obj", b"x")
        expect_raises(ObjectNotFoundError,
                      "read_into('dir') of a mere prefix of 'dir/obj' did not raise ObjectNotFoundError",
                      lambda: backend.read_into("dir", 0, memoryview(bytearray(4))))

    # -- keys --------------------------------------------------------------------------

    UNICODE_KEY = "données/模型/ключ 🙂.bin"
    DEEP_KEY = "/".join(f"l{i}" for i in range(12)) + "/leaf"

    def test_unicode_key_round_trip(self, backend: Backend) -> None:
        backend.write(self.UNICODE_KEY, b"unicode")
        check_bytes(backend.read(self.UNICODE_KEY), b"unicode", "round trip under a unicode key failed")

    def test_unicode_key_listed(self, backend: Backend) -> None:
        backend.write(self.UNICODE_KEY, b"unicode")
        assert list(backend.list("données/")) == [self.UNICODE_KEY], "list does not return a unicode key unchanged"

    def test_deeply_nested_key_round_trip(self, backend: Backend) -> None:
        backend.write(self.DEEP_KEY, b"deep")
        check_bytes(backend.read(self.DEEP_KEY), b"deep", "round trip under a 12-level key failed")

    def test_deeply_nested_key_listed(self, backend: Backend) -> None:
        backend.write(self.DEEP_KEY, b"deep")
        assert list(backend.list("l0/l1/")) == [self.DEEP_KEY], "list does not return a 12-level key"

    @pytest.mark.parametrize("op", sorted(KEYED_OPS))
    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_key_rejected(self, backend: Backend, key: str, op: str) -> None:
        expect_raises(ValueError, f"{op} accepted the invalid key {key!r} (must raise ValueError)",
                      lambda: KEYED_OPS[op](backend, key))

    # -- missing objects ---------------------------------------------------------------

    @pytest.mark.parametrize("op", sorted(READ_OPS))
    def test_missing_object_raises_file_not_found(self, backend: Backend, op: str) -> None:
        expect_raises(FileNotFoundError, f"{op} of a missing object did not raise FileNotFoundError",
                      lambda: READ_OPS[op](backend, "no/such/key"))

    @pytest.mark.parametrize("op", sorted(READ_OPS))
    def test_missing_object_raises_object_not_found(self, backend: Backend, op: str) -> None:
        expect_raises(ObjectNotFoundError, f"{op} of a missing object did not raise bcp.backends.ObjectNotFoundError",
                      lambda: READ_OPS[op](backend, "no/such/key"))

    @pytest.mark.parametrize("op", sorted(READ_OPS))
    def test_missing_object_error_names_key(self, backend: Backend, op: str) -> None:
        e = expect_raises(FileNotFoundError, f"{op} of a missing object did not raise",
                          lambda: READ_OPS[op](backend, "no/such/key"))
        assert "no/such/key" in str(e), f"{op}'s missing-object error does not name the key: {e}"

    # -- writer lifecycle --------------------------------------------------------------

    def test_uncommitted_object_does_not_exist(self, backend: Backend) -> None:
        with backend.open_writer("pending", size=4) as writer:
            writer.write_at(0, b"data")
            assert not backend.exists("pending"), "exists is True before the writer committed"
            writer.abort()

    def test_uncommitted_object_cannot_be_read(self, backend: Backend) -> None:
        with backend.open_writer("pending", size=4) as writer:
            writer.write_at(0, b"data")
            expect_raises(FileNotFoundError, "an object could be read before its writer committed",
                          lambda: backend.read("pending"))
            writer.abort()

    def test_committed_object_is_visible(self, backend: Backend) -> None:
        with backend.open_writer("c/k", size=4) as writer:
            writer.write_at(0, b"data")
            writer.commit()
        assert backend.exists("c/k") and list(backend.list("c/")) == ["c/k"], (
            "an object is not visible (exists and listed) after its writer committed"
        )

    def test_uncommitted_overwrite_keeps_old_object(self, backend: Backend) -> None:
        self.seed(backend, "k", b"old-content")
        with backend.open_writer("k", size=3) as writer:
            writer.write_at(0, b"new")
            check_bytes(backend.read("k"), b"old-content", "readers saw a pending overwrite before it committed")
            writer.abort()

    def test_abort_leaves_nothing_visible(self, backend: Backend) -> None:
        writer = backend.open_writer("ab/k", size=4)
        writer.write_at(0, b"data")
        writer.abort()
        assert not backend.exists("ab/k") and list(backend.list("")) == [], "an aborted writer left something visible"

    def test_abort_keeps_old_object(self, backend: Backend) -> None:
        self.seed(backend, "k", b"old-content")
        writer = backend.open_writer("k", size=3)
        writer.write_at(0, b"new")
        writer.abort()
        check_bytes(self.fetch(backend, "k"), b"old-content", "an aborted overwrite changed the old object")

    def test_abort_is_idempotent(self, backend: Backend) -> None:
        writer = backend.open_writer("k", size=1)
        writer.write_at(0, b"x")
        writer.abort()
        try:
            writer.abort()
        except Exception as e:
            raise AssertionError(f"a second abort raised {type(e).__name__}: {e}") from e

    def test_abort_without_writes(self, backend: Backend) -> None:
        backend.open_writer("k").abort()
        assert list(backend.list("")) == [], "aborting a writer that wrote nothing left something visible"

    def test_exception_in_writer_block_leaves_nothing_visible(self, backend: Backend) -> None:
        class Boom(Exception):
            pass

        with pytest.raises(Boom), backend.open_writer("ex/k", size=4) as writer:
            writer.write_at(0, b"data")
            raise Boom
        assert not backend.exists("ex/k") and list(backend.list("")) == [], (
            "a writer whose with-block raised left something visible"
        )

    def test_exception_in_writer_block_keeps_old_object(self, backend: Backend) -> None:
        self.seed(backend, "k", b"old-content")
        with pytest.raises(KeyError):
            with backend.open_writer("k", size=3) as writer:
                writer.write_at(0, b"new")
                raise KeyError("boom")
        check_bytes(self.fetch(backend, "k"), b"old-content", "a writer whose with-block raised changed the old object")

    def test_leaving_writer_block_without_commit_leaves_nothing(self, backend: Backend) -> None:
        with backend.open_writer("k", size=4) as writer:
            writer.write_at(0, b"data")
        assert not backend.exists("k"), "leaving a writer's with-block without commit did not abort it"

    # -- overwrite ---------------------------------------------------------------------

    def test_overwrite_replaces_content(self, backend: Backend) -> None:
        self.seed(backend, "ow", payload(50_000, seed=12))
        backend.write("ow", b"short")
        check_bytes(self.fetch(backend, "ow"), b"short",
                    "overwriting with a shorter object did not replace the content")

    def test_overwrite_updates_size(self, backend: Backend) -> None:
        self.seed(backend, "ow", payload(50_000, seed=12))
        backend.write("ow", b"short")
        assert backend.size("ow") == 5, "size after overwriting with a shorter object still reports the old size"

    def test_overwrite_is_atomic_for_concurrent_readers(self, backend: Backend) -> None:
        n = 64 * 1024 + 3
        versions = (b"\xaa" * n, b"\xbb" * n)
        backend.write("atomic", versions[0])
        stop = threading.Event()
        problems: list[str] = []

        def reader(_: int) -> None:
            buf = bytearray(n)
            while not stop.is_set() and not problems:
                try:
                    got = backend.read_into("atomic", 0, memoryview(buf))
                except FileNotFoundError:
                    problems.append("the object was missing for a moment")
                    return
                if got != n or bytes(buf) not in versions:
                    problems.append(f"read {got} bytes mixing the old and new content")

        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(reader, i) for i in range(4)]
            try:
                for i in range(1, 12):
                    backend.write("atomic", versions[i % 2])
            finally:
                stop.set()
            for f in futures:
                f.result(timeout=THREAD_TIMEOUT)
        assert not problems, f"overwrite was not atomic for concurrent readers: {problems[0]}"

    # -- create-only writes ------------------------------------------------------------

    def test_write_if_absent_creates(self, backend: Backend) -> None:
        backend.write_if_absent("once", b"first")
        check_bytes(self.fetch(backend, "once"), b"first", "write_if_absent on a new key stored wrong bytes")

    def test_write_if_absent_existing_raises_file_exists(self, backend: Backend) -> None:
        self.seed(backend, "once", b"first")
        expect_raises(FileExistsError, "write_if_absent on an existing key did not raise FileExistsError",
                      lambda: backend.write_if_absent("once", b"second"))

    def test_write_if_absent_existing_raises_object_exists(self, backend: Backend) -> None:
        self.seed(backend, "once", b"first")
        expect_raises(ObjectExistsError,
                      "write_if_absent on an existing key did not raise bcp.backends.ObjectExistsError",
                      lambda: backend.write_if_absent("once", b"second"))

    def test_write_if_absent_existing_keeps_old_content(self, backend: Backend) -> None:
        self.seed(backend, "once", b"first")
        with pytest.raises(FileExistsError):
            backend.write_if_absent("once", b"second")
        check_bytes(self.fetch(backend, "once"), b"first", "a losing write_if_absent changed the existing object")

    def test_write_if_absent_loser_leaves_nothing_listed(self, backend: Backend) -> None:
        self.seed(backend, "d/once", b"first")
        with pytest.raises(FileExistsError):
            backend.write_if_absent("d/once", b"second")
        assert list(backend.list("")) == ["d/once"], "a losing write_if_absent left something listed"

    def test_write_if_absent_after_delete(self, backend: Backend) -> None:
        backend.write_if_absent("once", b"first")
        backend.delete("once")
        backend.write_if_absent("once", b"again")
        check_bytes(self.fetch(backend, "once"), b"again", "write_if_absent after delete did not create the key")

    def _race_write_if_absent(self, backend: Backend) -> tuple[list[int], dict[int, bytes]]:
        if Capability.CREATE_ONLY not in backend.capabilities:
            pytest.skip("backend does not declare Capability.CREATE_ONLY")
        payloads = {i: payload(20_000 + i, seed=100 + i) for i in range(THREADS)}

        def attempt(i: int) -> bool:
            try:
                backend.write_if_absent("race/commit", payloads[i])
            except ObjectExistsError:
                return False
            return True

        won = in_threads(THREADS, attempt)
        return [i for i, w in enumerate(won) if w], payloads

    def test_write_if_absent_race_has_exactly_one_winner(self, backend: Backend) -> None:
        winners, _ = self._race_write_if_absent(backend)
        assert len(winners) == 1, (
            f"{THREADS} threads raced write_if_absent on one key and {len(winners)} won, expected 1"
        )

    def test_write_if_absent_race_stores_winner_payload(self, backend: Backend) -> None:
        winners, payloads = self._race_write_if_absent(backend)
        assert winners, "nobody won the write_if_absent race"
        check_bytes(self.fetch(backend, "race/commit"), payloads[winners[0]],
                    "after a write_if_absent race the stored object is not the winner's payload")

    # -- concurrency -------------------------------------------------------------------

    def test_concurrent_writers_distinct_keys(self, backend: Backend) -> None:
        datas = [payload(30_000 + i, seed=200 + i) for i in range(THREADS)]
        in_threads(THREADS, lambda i: backend.write(f"cw/{i % 2}/k{i}", datas[i]))
        for i, data in enumerate(datas):
            check_bytes(self.fetch(backend, f"cw/{i % 2}/k{i}"), data,
                        f"concurrent writers to distinct keys: key {i} holds wrong bytes")

    def test_concurrent_writers_distinct_keys_all_listed(self, backend: Backend) -> None:
        in_threads(THREADS, lambda i: backend.write(f"cw/{i % 2}/k{i}", b"x"))
        expected = sorted(f"cw/{i % 2}/k{i}" for i in range(THREADS))
        assert sorted(backend.list("cw/")) == expected, "concurrent writers to distinct keys: list is missing keys"

    def test_concurrent_readers(self, backend: Backend) -> None:
        data = payload(256 * 1024 + 7, seed=13)
        self.seed(backend, "shared", data)

        def read_many(i: int) -> list[bool]:
            ok = [backend.read("shared") == data]
            for j in range(8):
                off = (i * 8 + j) * 4001
                buf = bytearray(4001)
                n = backend.read_into("shared", off, memoryview(buf))
                ok.append(bytes(buf[:n]) == data[off : off + 4001])
            return ok

        results = in_threads(THREADS, read_many)
        assert all(all(r) for r in results), "concurrent readers of one object got wrong bytes"
