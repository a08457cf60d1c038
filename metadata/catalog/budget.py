"""The decode budget: how many bytes decoding untrusted catalog bytes may allocate.

An Arrow IPC file can declare buffers far larger than itself (compression, or
dictionary strings repeated by index). Before Arrow decompresses anything,
:func:`check_ipc_budget` reads the IPC footer and message headers with a small
bounds-checked FlatBuffers reader and adds up what decoding would allocate;
:func:`check_expansion` does the same for dictionary strings once decoded. A
catalog over budget is refused as a FormatError, never an out-of-memory.
"""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute  # binds pa.compute

from bcp.metadata.format_errors import FormatError

#: Decoding may use at most this many bytes of Arrow buffers per byte of the catalog
#: file, and never less than DECODE_FLOOR_BYTES. bcp's own catalogs decode to about
#: 3-15x their file size; a decompression bomb reaches thousands.
DECODE_RATIO = 256
DECODE_FLOOR_BYTES = 64 << 20


def decode_budget(file_bytes: int) -> int:
    """Most bytes that decoding a catalog of ``file_bytes`` may allocate (buffers,
    decompressed, with dictionary strings expanded)."""
    return max(DECODE_FLOOR_BYTES, DECODE_RATIO * file_bytes)


class _Flat:
    """Just enough FlatBuffers to read the Arrow IPC footer and message headers;
    every read is bounds-checked (a FormatError, never an IndexError)."""

    def __init__(self, buf: bytes, where: str) -> None:
        self.buf, self.where = buf, where

    def _get(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.buf):
            raise FormatError(f"{self.where}: Arrow metadata points outside itself (offset {pos})")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def root(self) -> int:
        return self._get("<I", 0)

    def field(self, table: int, index: int) -> int | None:
        """Position of field ``index`` of the table at ``table``, None when absent."""
        vtable = table - self._get("<i", table)
        vsize = self._get("<H", vtable)
        if 4 + 2 * index + 2 > vsize:
            return None
        off = self._get("<H", vtable + 4 + 2 * index)
        return table + off if off else None

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        pos = self.field(table, index)
        return default if pos is None else self._get(fmt, pos)

    def ref(self, table: int, index: int) -> int | None:
        """The table, vector or union a field points to."""
        pos = self.field(table, index)
        return None if pos is None else pos + self._get("<I", pos)

    def structs(self, table: int, index: int, size: int, fmts: str) -> list[tuple[int, ...]]:
        """A vector of structs, each unpacked with ``fmts`` (little-endian)."""
        vec = self.ref(table, index)
        if vec is None:
            return []
        count = self._get("<I", vec)
        if vec + 4 + count * size > len(self.buf):
            raise FormatError(f"{self.where}: Arrow metadata vector of {count} entries overruns its buffer")
        return [struct.unpack_from("<" + fmts, self.buf, vec + 4 + i * size) for i in range(count)]


_MESSAGE_SCHEMA, _MESSAGE_DICTIONARY, _MESSAGE_RECORDS = 1, 2, 3


def check_ipc_budget(data: bytes, *, where: str, budget: int) -> int:
    """Refuse an Arrow IPC file whose batches would decode to more than ``budget``
    bytes, before anything is decompressed.

    Reads the footer and the header of every message it lists (the blocks the Arrow
    reader will decode): row and element counts of every array, and each buffer's
    size, where compressed buffers declare their decompressed size in their first 8
    bytes (Arrow's format). Files that are not Arrow IPC files are left to the Arrow
    reader to reject. Returns the bytes counted (what decoding will allocate, at most)."""
    if len(data) < 18 or data[:6] != b"ARROW1" or data[-6:] != b"ARROW1":
        return 0  # not an IPC file: open_file says so
    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    if not 0 < footer_len <= len(data) - 18:
        raise FormatError(f"{where}: Arrow footer length {footer_len} is impossible for a {len(data)}-byte file")
    footer = _Flat(data[len(data) - 10 - footer_len : len(data) - 10], where)
    root = footer.root()
    block = "qi4xq"  # offset, metadata length, padding, body length
    blocks = footer.structs(root, 2, 24, block) + footer.structs(root, 3, 24, block)
    used = 0
    view = pa.py_buffer(data)
    for offset, _meta_len, body_len in blocks:
        if not 0 <= offset < len(data) or not 0 <= body_len <= len(data):
            raise FormatError(f"{where}: Arrow block at offset {offset} lies outside the file")
        try:
            message = pa.ipc.read_message(pa.BufferReader(view.slice(offset)))
        except (pa.ArrowException, OSError, EOFError) as e:
            raise FormatError(f"{where}: unreadable Arrow message at offset {offset}: {e}") from e
        head = _Flat(message.metadata.to_pybytes(), where)
        m = head.root()
        kind = head.scalar(m, 1, "<B")
        batch = head.ref(m, 2)
        if batch is None or kind not in (_MESSAGE_DICTIONARY, _MESSAGE_RECORDS):
            continue
        if kind == _MESSAGE_DICTIONARY:
            batch = head.ref(batch, 1)
            if batch is None:
                continue
        length = head.scalar(batch, 0, "<q")
        nodes = head.structs(batch, 1, 16, "qq")
        buffers = head.structs(batch, 2, 16, "qq")
        compressed = head.ref(batch, 3) is not None
        body = message.body
        if length < 0 or any(n < 0 or nulls < 0 for n, nulls in nodes):
            raise FormatError(f"{where}: negative length in the Arrow message at offset {offset}")
        # every array element costs at least a byte of some buffer once decoded (and 8
        # for the columns a reader casts to int64): count them, then the buffers
        used += 8 * (length + sum(n for n, _nulls in nodes))
        for b_off, b_len in buffers:
            if b_off < 0 or b_len < 0 or b_off + b_len > body.size:
                raise FormatError(f"{where}: Arrow buffer [{b_off}, {b_off + b_len}) outside its message body")
            if compressed and b_len >= 8:
                declared = struct.unpack_from("<q", body, b_off)[0]
                if declared < -1:
                    raise FormatError(f"{where}: negative decompressed size {declared} in the Arrow message")
                used += b_len - 8 if declared == -1 else declared
            else:
                used += b_len
        if used > budget:
            raise FormatError(
                f"{where}: the catalog would decode to more than {budget} bytes from {len(data)} "
                "(a decompression bomb, or a catalog far larger than its file); refusing it"
            )
    return used


def check_expansion(table: pa.Table, *, where: str, budget: int) -> int:
    """Refuse dictionary-encoded string columns that would expand past ``budget`` bytes
    when decoded to one string per row (a long value repeated by a million indices
    compresses to nothing). Computed from the value lengths, without expanding."""
    total = 0
    for column in table.columns:
        if not pa.types.is_dictionary(column.type):
            continue
        for chunk in column.chunks:
            values = chunk.dictionary
            if not (pa.types.is_string(values.type) or pa.types.is_binary(values.type)):
                continue
            lengths = pa.compute.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            indices = chunk.indices.fill_null(0).to_numpy(zero_copy_only=False)
            total += int(lengths[indices].sum()) if len(lengths) else 0
            if total > budget:
                raise FormatError(
                    f"{where}: dictionary-encoded strings would expand to more than {budget} bytes; refusing it"
                )
    return total
