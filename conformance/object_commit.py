"""Object-contract groups about when a write becomes visible and what concurrent
writers and readers see: atomic commit, overwrite, create-only writes, concurrency."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from bcp.backends import Backend, Capability, ObjectExistsError, ObjectWriter
from bcp.conformance.object_base import (
    THREAD_TIMEOUT,
    THREADS,
    ObjectContractBase,
    check_bytes,
    expect_raises,
    in_threads,
    payload,
)


class AtomicCommitTests(ObjectContractBase):
    """A writer's object appears only on commit; unfinished, failed and aborted writes leave no trace."""

    report_heading = "atomic commit: unfinished, failed and aborted writes stay invisible"

    def test_uncommitted_object_does_not_exist(self, backend: Backend) -> None:
        with backend.open_writer("pending", size=4) as writer:
            writer.write_at(0, b"data")
            assert not backend.exists("pending"), "exists is True before the writer committed"
            writer.abort()

    def test_writer_has_the_interface_attributes(self, backend: Backend) -> None:
        """Every writer is an ObjectWriter with ``uri`` and ``key`` (wrappers and error
        messages read them) and boolean ``idempotent_commit``/``retryable_commit``."""
        with backend.open_writer("w/attrs", size=4) as writer:
            kind = type(writer).__name__
            assert isinstance(writer, ObjectWriter), f"open_writer returned a {kind}, not an ObjectWriter"
            key = getattr(writer, "key", None)
            uri = getattr(writer, "uri", None)
            writer.abort()
        assert key == "w/attrs", f"writer.key is {key!r}, not the key passed to open_writer ('w/attrs')"
        assert isinstance(uri, str) and uri, f"writer.uri is {uri!r}, not the store's URI (a non-empty str)"
        for flag in ("idempotent_commit", "retryable_commit"):
            assert isinstance(getattr(writer, flag), bool), f"writer.{flag} is not a bool"

    def test_uncommitted_object_cannot_be_read(self, backend: Backend) -> None:
        with backend.open_writer("pending", size=4) as writer:
            writer.write_at(0, b"data")
            expect_raises(
                FileNotFoundError,
                "an object could be read before its writer committed",
                lambda: backend.read("pending"),
            )
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

        with pytest.raises(Boom), backend.open_writer("ex/k", size=4) as writer:  # noqa: PT012 - the block raising is the test
            writer.write_at(0, b"data")
            raise Boom
        assert not backend.exists("ex/k") and list(backend.list("")) == [], (
            "a writer whose with-block raised left something visible"
        )

    def test_exception_in_writer_block_keeps_old_object(self, backend: Backend) -> None:
        self.seed(backend, "k", b"old-content")
        with pytest.raises(KeyError), backend.open_writer("k", size=3) as writer:  # noqa: PT012 - the block raising is the test
            writer.write_at(0, b"new")
            raise KeyError("boom")
        check_bytes(self.fetch(backend, "k"), b"old-content", "a writer whose with-block raised changed the old object")

    def test_leaving_writer_block_without_commit_leaves_nothing(self, backend: Backend) -> None:
        with backend.open_writer("k", size=4) as writer:
            writer.write_at(0, b"data")
        assert not backend.exists("k"), "leaving a writer's with-block without commit did not abort it"


class OverwriteTests(ObjectContractBase):
    """Writing an existing key replaces it whole, and readers never see a mix or a gap."""

    report_heading = "overwrite: new content and size, atomic for readers"

    def test_overwrite_replaces_content(self, backend: Backend) -> None:
        self.seed(backend, "ow", payload(50_000, seed=12))
        backend.write("ow", b"short")
        check_bytes(
            self.fetch(backend, "ow"), b"short", "overwriting with a shorter object did not replace the content"
        )

    def test_overwrite_updates_size(self, backend: Backend) -> None:
        self.seed(backend, "ow", payload(50_000, seed=12))
        backend.write("ow", b"short")
        assert backend.size("ow") == 5, "size after overwriting with a shorter object still reports the old size"

    def test_overwrite_is_atomic_for_concurrent_readers(self, backend: Backend) -> None:
        if Capability.NON_ATOMIC_REPLACE in backend.capabilities:
            pytest.skip(
                "backend declares Capability.NON_ATOMIC_REPLACE: readers may find an object missing while it is "
                "replaced (test_overwrite_never_mixes_for_concurrent_readers checks what still holds)"
            )
        problems = self._overwrite_while_reading(backend, missing_allowed=False)
        hint = ""
        if problems and problems[0] == _MISSING:
            hint = (
                " (a store whose replace deletes the old object first, as WebDAV's MOVE and HDFS's rename do, "
                "declares Capability.NON_ATOMIC_REPLACE: bcp then commits overwrites in two steps, and "
                "test_overwrite_never_mixes_for_concurrent_readers checks the weaker guarantee)"
            )
        assert not problems, f"overwrite was not atomic for concurrent readers: {problems[0]}{hint}"

    def test_overwrite_never_mixes_for_concurrent_readers(self, backend: Backend) -> None:
        """What every store keeps, atomic replace or not: a reader racing overwrites gets
        the whole old object or the whole new one (or, with NON_ATOMIC_REPLACE, none),
        never a mix or a short read; the last write wins."""
        problems = self._overwrite_while_reading(backend, missing_allowed=True)
        assert not problems, f"an overwrite showed concurrent readers a torn object: {problems[0]}"
        check_bytes(self.fetch(backend, "atomic"), b"\xbb" * _OVERWRITE_SIZE, "after the overwrites")

    @staticmethod
    def _overwrite_while_reading(backend: Backend, *, missing_allowed: bool) -> list[str]:
        """Overwrite one object 11 times while 4 threads read it whole; what they saw wrong."""
        n = _OVERWRITE_SIZE
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
                    if missing_allowed:
                        continue
                    problems.append(_MISSING)
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
        return problems


#: The object the overwrite tests replace (an odd size: a torn read shows).
_OVERWRITE_SIZE = 64 * 1024 + 3
_MISSING = "the object was missing for a moment"


class CreateOnlyWriteTests(ObjectContractBase):
    """``write_if_absent``: creates once, then refuses; one winner of a race when declared."""

    report_heading = "create-only writes"

    def test_write_if_absent_creates(self, backend: Backend) -> None:
        backend.write_if_absent("once", b"first")
        check_bytes(self.fetch(backend, "once"), b"first", "write_if_absent on a new key stored wrong bytes")

    def test_write_if_absent_existing_raises_file_exists(self, backend: Backend) -> None:
        self.seed(backend, "once", b"first")
        expect_raises(
            FileExistsError,
            "write_if_absent on an existing key did not raise FileExistsError",
            lambda: backend.write_if_absent("once", b"second"),
        )

    def test_write_if_absent_existing_raises_object_exists(self, backend: Backend) -> None:
        self.seed(backend, "once", b"first")
        expect_raises(
            ObjectExistsError,
            "write_if_absent on an existing key did not raise bcp.backends.ObjectExistsError",
            lambda: backend.write_if_absent("once", b"second"),
        )

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
        check_bytes(
            self.fetch(backend, "race/commit"),
            payloads[winners[0]],
            "after a write_if_absent race the stored object is not the winner's payload",
        )


class ConcurrencyTests(ObjectContractBase):
    """Writers of distinct keys and readers of one object at the same time."""

    report_heading = "concurrency"

    def test_concurrent_writers_distinct_keys(self, backend: Backend) -> None:
        datas = [payload(30_000 + i, seed=200 + i) for i in range(THREADS)]
        in_threads(THREADS, lambda i: backend.write(f"cw/{i % 2}/k{i}", datas[i]))
        for i, data in enumerate(datas):
            check_bytes(
                self.fetch(backend, f"cw/{i % 2}/k{i}"),
                data,
                f"concurrent writers to distinct keys: key {i} holds wrong bytes",
            )

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
