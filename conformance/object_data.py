"""Object-contract groups about the bytes themselves: whole-object round trips,
multi-part writes and ranged reads."""

from __future__ import annotations

import array
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from bcp.backends import Backend, Buffer, Capability
from bcp.conformance.object_base import THREADS, ObjectContractBase, check_bytes, expect_raises, payload


class RoundTripTests(ObjectContractBase):
    """Whole objects come back as written, also when the store itself wrote or reads them."""

    report_heading = "round trip"

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
        buffers: dict[str, Buffer] = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}
        backend.write("buf", buffers[kind])
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


class MultipartWriteTests(ObjectContractBase):
    """Objects written in parts through ``open_writer``, in any order, the way bcp's pipeline writes."""

    report_heading = "multi-part writes"

    def _write_parts(
        self, backend: Backend, key: str, data: bytes, order: list[tuple[int, int]], threads: int = 1
    ) -> None:
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


class RangedReadTests(ObjectContractBase):
    """``read_into``, ``read`` and ``read_exact`` of byte ranges, at the edges of an object too."""

    report_heading = "ranged reads"

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
        expect_raises(
            EOFError,
            "read_exact running past the end of object did not raise EOFError",
            lambda: backend.read_exact("ranged", self.RANGED_SIZE - 10, memoryview(bytearray(11))),
        )

    def test_size(self, backend: Backend, ranged: bytes) -> None:
        assert backend.size("ranged") == self.RANGED_SIZE, "size() does not match the object's length"
