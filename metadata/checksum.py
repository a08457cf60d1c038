"""Checksums of the format: CRC32C (Castagnoli) over fixed-size blocks.

Why CRC32C: it is the checksum S3 and GCS verify server-side, so the same value can
travel with an upload, and with carry-less multiplication (VPCLMULQDQ, AVX-512) it runs
as fast as XXH3 here (about 90 GB/s per core on data in the CPU cache, against 29-33
GB/s for the SSE4.2 ``crc32`` instruction the ``crc32c`` package uses; docs/decisions.md).
The values are the same whichever implementation computes them: ``crc32c_rs`` where it
is installed (a dependency of bcp), else the ``crc32c`` package.

Why blocks: a reader that fetches only part of a fragment can verify what it read by
reading at most to the enclosing block edges, instead of the whole fragment. A reader
that has many whole blocks in memory checks them with one CRC call over all of them,
compared with the blocks' checksums combined (:func:`combine_blocks`: the CRC of a
concatenation follows from the CRCs of its parts), and only on a mismatch block by
block, to name the block.
"""

from __future__ import annotations

import importlib
import os
import struct
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING

import crc32c as _crc32c_pkg
import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

ALGORITHM = "crc32c"
#: Default block size. Each fragment is split into blocks from its first byte.
DEFAULT_BLOCK_BYTES = 64 << 10

#: The reflected CRC32C polynomial.
POLY = 0x82F63B78


def _pick() -> tuple[str, Callable[..., int]]:
    """The fastest CRC32C implementation importable here that gives the standard check
    value; ``BCP_CRC32C=crc32c`` forces the ``crc32c`` package."""
    if os.environ.get("BCP_CRC32C", "") != "crc32c":
        try:
            fn = importlib.import_module("crc32c_rs").crc32c
            if fn(b"123456789") == 0xE3069283 and fn(b"56789", fn(b"1234")) == 0xE3069283:
                return "crc32c_rs", fn
        except (ImportError, AttributeError, RuntimeError):  # not installed, or a CPU it cannot serve
            pass
    return "crc32c", _crc32c_pkg.crc32c


#: Which package computes CRC32C in this process ("crc32c_rs" or "crc32c").
IMPLEMENTATION, _impl = _pick()

#: The C function behind :func:`crc32c_raw`, for loops over many blocks where a
#: Python frame per call shows: ``crc32c_c(buffer, value=0)`` (both implementations
#: release the GIL for buffers of 32 KiB and more).
crc32c_c: Callable[..., int] = _impl


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data`` (any contiguous buffer), continuing from ``value``."""
    return _impl(memoryview(data).cast("B"), value)


def crc32c_raw(data: Buffer, value: int = 0) -> int:
    """CRC32C of the raw bytes of ``data``, a C-contiguous buffer of any format, taken
    as is (no memoryview made: for many small buffers, where that costs more than the
    CRC itself)."""
    return _impl(data, value)


def block_checksums(data: Buffer, block_bytes: int) -> list[int]:
    """CRC32C of each ``block_bytes`` block of ``data`` (the last one may be short).
    An empty buffer has no blocks."""
    view = memoryview(data).cast("B")
    crc = _impl
    return [crc(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


def digest_of_checksums(checksums: list[int]) -> int:
    """CRC32C over the little-endian uint32 block checksums, in file order: the
    data-file digest of the manifest (a file's content changes iff one of these does)."""
    return _impl(struct.pack(f"<{len(checksums)}I", *checksums)) if checksums else 0


# -- combining checksums (zlib's crc32_combine, for the CRC32C polynomial) ----------------


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, in the reflected bit order of the CRC."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
        m >>= 1
    return p


def _x2n(n: int) -> int:
    """x^(2^n) modulo the polynomial."""
    p = 1 << 30  # x^1
    for _ in range(n):
        p = _multmodp(p, p)
    return p


def shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: multiplying a CRC by it appends ``nbytes``
    zero bytes' worth of shift (before the pre/post conditioning cancels out)."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_x2n(k), p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A followed by B, from ``crc1`` of A, ``crc2`` of B and B's length."""
    return _multmodp(shift_operator(len2), crc1) ^ crc2


#: Blocks combined by one table lookup per byte of their checksums (see :class:`_Combiner`).
GROUP = 32


class _Combiner:
    """Combines the CRC32C values of runs of equal ``block_bytes`` blocks with numpy.

    Multiplying by a fixed x^k modulo the polynomial is linear over GF(2) in the CRC,
    so it is four 256-entry tables, one per byte of the CRC. ``table[j]`` shifts by
    ``j`` blocks; a run's blocks are padded in front with zero checksums (which
    contribute nothing) to whole groups of :data:`GROUP`, each group's value is one
    gather and one XOR reduction, and the groups are folded in order."""

    def __init__(self, block_bytes: int):
        one = _basis_images(shift_operator(block_bytes))  # the 32 bits' images under one block's shift
        images = np.empty((GROUP + 1, 32), np.uint32)
        images[0] = np.uint32(1) << np.arange(32, dtype=np.uint32)
        step = _byte_tables(one)
        for j in range(1, GROUP + 1):
            images[j] = _apply(step, images[j - 1])
        tables = np.stack([_byte_tables(images[j]) for j in range(GROUP + 1)])  # (GROUP + 1, 4, 256)
        # gather offsets: position k of a group is shifted by GROUP - 1 - k blocks
        self._flat = tables[:GROUP].reshape(-1)
        self._base = ((GROUP - 1 - np.arange(GROUP))[:, None] * 1024 + np.arange(4)[None, :] * 256).astype(np.intp)
        self._group_shift = [tables[GROUP][b].tolist() for b in range(4)]

    def combine(self, checksums: Sequence[int] | np.ndarray) -> int:
        """CRC32C of the concatenated blocks whose CRC32C values are ``checksums``."""
        n = len(checksums)
        if n == 0:
            return 0
        if n == 1:
            return int(checksums[0])
        groups = -(-n // GROUP)
        padded = np.zeros(groups * GROUP, np.dtype("<u4"))
        padded[groups * GROUP - n :] = checksums
        index = padded.view(np.uint8).reshape(groups, GROUP, 4) + self._base
        values = np.bitwise_xor.reduce(self._flat[index].reshape(groups, -1), axis=1).tolist()
        t0, t1, t2, t3 = self._group_shift
        acc = 0
        for v in values:
            acc = t0[acc & 255] ^ t1[(acc >> 8) & 255] ^ t2[(acc >> 16) & 255] ^ t3[acc >> 24] ^ v
        return acc

    def combine_runs(self, checksums: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> list[int]:
        """The combined CRC32C of each run ``checksums[starts[i]:stops[i]]`` of at most
        :data:`GROUP` blocks, all runs with one gather and one XOR reduction."""
        if not len(starts):
            return []
        width = max(1, int((stops - starts).max()))  # the group's last positions: runs are short in a load
        idx = stops[:, None] - width + np.arange(width)[None, :]  # each run right-aligned in one group
        vals = np.where(idx >= starts[:, None], checksums[np.maximum(idx, 0)], 0).astype("<u4")
        index = vals.view(np.uint8).reshape(len(starts), width, 4) + self._base[GROUP - width :]
        return np.bitwise_xor.reduce(self._flat[index].reshape(len(starts), -1), axis=1).tolist()


def _basis_images(op: int) -> np.ndarray:
    return np.array([_multmodp(op, 1 << i) for i in range(32)], np.uint32)


def _byte_tables(images: np.ndarray) -> np.ndarray:
    """(4, 256) tables of the linear map that sends bit i to ``images[i]``."""
    bits = (np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)[None, :]) & 1  # (256, 8)
    out = np.empty((4, 256), np.uint32)
    for b in range(4):
        chosen = np.where(bits.astype(bool), images[8 * b : 8 * b + 8][None, :], np.uint32(0))
        out[b] = np.bitwise_xor.reduce(chosen, axis=1)
    return out


def _apply(tables: np.ndarray, values: np.ndarray) -> np.ndarray:
    v = values.astype(np.uint32)
    return tables[0][v & 255] ^ tables[1][(v >> 8) & 255] ^ tables[2][(v >> 16) & 255] ^ tables[3][v >> 24]


@cache
def _combiner(block_bytes: int) -> _Combiner:
    return _Combiner(block_bytes)


def combine_blocks(checksums: Sequence[int] | np.ndarray, block_bytes: int) -> int:
    """CRC32C of consecutive ``block_bytes`` blocks (all whole) from their CRC32C
    values: what one CRC call over the same bytes must return."""
    if len(checksums) <= 1:
        return int(checksums[0]) if len(checksums) else 0
    return _combiner(block_bytes).combine(checksums)


def combine_block_runs(
    checksums: Sequence[int] | np.ndarray, block_bytes: int, runs: Sequence[tuple[int, int]] | np.ndarray
) -> list[int]:
    """:func:`combine_blocks` of ``checksums[a:b]`` for each ``(a, b)`` in ``runs``
    (whole ``block_bytes`` blocks, empty runs give 0), in one vectorised pass when every
    run has at most :data:`GROUP` blocks: the checks of a read cut into pieces (a load
    from memory) cost one numpy call, not one per piece."""
    bounds = np.asarray(runs, np.intp).reshape(-1, 2)  # (k, 2) already: a load's runs, no pairs walked
    if not len(bounds):
        return []
    if int((bounds[:, 1] - bounds[:, 0]).max()) > GROUP:
        return [combine_blocks(checksums[a:b], block_bytes) for a, b in bounds.tolist()]
    sums = np.asarray(checksums, np.uint32)
    if not len(sums):
        return [0] * len(runs)
    return _combiner(block_bytes).combine_runs(sums, bounds[:, 0], bounds[:, 1])
