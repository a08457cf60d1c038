"""Pieces of an incremental save: fragments cut into boxes of whole dim-0 rows, and
their XXH3-128 digests (metadata/FORMAT.md, "References"; ``bcp.incremental``).

Apart from ``bcp.incremental`` because preparing a save (``bcp.kept_plans``) cuts the
pieces, and must not import the reading side that matching needs.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import xxhash

from bcp.shards import Piece
from bcp.tensor_io import flat_bytes, host_contiguous

if TYPE_CHECKING:
    from bcp.io_scheduler.write_pipeline import WriteItem

_T = TypeVar("_T")

#: The most bytes a piece of an incremental save holds (a row larger than that is one piece).
PIECE_BYTES = 4 << 20


# -- pieces ------------------------------------------------------------------------------------


def rows_per_piece(box_lengths: Sequence[int], dtype: torch.dtype, piece_bytes: int) -> int:
    """Rows of a box (whole dim-0 rows of ``box_lengths``) in one piece: at most
    ``piece_bytes``, at least one row."""
    row = math.prod(box_lengths[1:]) * dtype.itemsize  # math.prod: np.prod costs ~10 us a call, per piece
    return max(1, piece_bytes // row) if row else 0


def cut_pieces(piece: Piece, dtype: torch.dtype, piece_bytes: int) -> list[Piece]:
    """``piece`` cut at the global row indices that are multiples of the rows per piece
    (FORMAT.md): a row-range update then changes only the pieces it touches."""
    offsets, lengths = piece.box
    if not lengths or lengths[0] <= 1:
        return [piece]
    rows = rows_per_piece(lengths, dtype, piece_bytes)
    if not rows or (rows >= lengths[0] and offsets[0] // rows == (offsets[0] + lengths[0] - 1) // rows):
        return [piece]
    start, end = offsets[0], offsets[0] + lengths[0]
    out = []
    a = start
    while a < end:
        b = min(end, (a // rows + 1) * rows)
        box = ((a, *offsets[1:]), (b - a, *lengths[1:]))
        out.append(Piece(box, piece.tensor[a - start : b - start]))
        a = b
    return out


def piece_digest(tensor: torch.Tensor) -> bytes:
    """XXH3-128 of the tensor's stored bytes (row-major, as the data file holds them),
    canonical (big-endian) form. A CUDA tensor is read with ``.cpu()`` on this thread's
    stream: the caller waits first for the saving thread's stream (``device_copy.caller_done``)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = host_contiguous(t)
    if not t.numel():
        return xxhash.xxh3_128_digest(b"")
    return xxhash.xxh3_128_digest(flat_bytes(t).numpy())  # type: ignore[arg-type]  # a buffer


#: The most bytes :class:`StreamDigests` keeps of parts that arrived ahead of their turn
#: (beyond it, an item is digested from the data file after the writes).
EARLY_CAP = 64 << 20

#: Items below this many bytes are digested on the calling thread (a thread hop costs more).
THREAD_FROM = 256 << 10

_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked child has none of the parent's threads: its pools would take work and
    never run it (they count the parent's idle threads), so it starts its own."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _pool(key: int, threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide pool of ``threads`` threads, started once: starting threads at
    every save cost tens of milliseconds on a loaded machine."""
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        return pool


def background(fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """Run ``fn`` on the process-wide thread for an incremental save's reads (apart from
    the digest threads, so that it does not wait behind them)."""
    return _pool(0, 1, "bcp-base").submit(fn)


def start_digests(
    items: Sequence[WriteItem], threads: int, only: Sequence[int] | None = None
) -> Callable[[], np.ndarray]:
    """Start digesting ``items`` (those at ``only``; every one when None; large ones on up
    to ``threads`` threads, at most the CPU count; xxhash releases the GIL for large
    buffers); the returned function finishes (small items on the calling thread) and
    gives the (n, 16) uint8 digests (zeros for the items not digested)."""
    out = np.zeros((len(items), 16), np.uint8)
    which = range(len(items)) if only is None else only
    threads = max(1, min(threads, os.cpu_count() or 1))
    large = [k for k in which if items[k].piece.tensor.numel() * items[k].piece.tensor.element_size() >= THREAD_FROM]
    pending: dict[int, concurrent.futures.Future[bytes]] = {}
    if threads > 1 and len(large) > 1:
        pool = _pool(threads, threads, "bcp-digest")
        pending = {k: pool.submit(piece_digest, items[k].piece.tensor) for k in large}

    def finish() -> np.ndarray:
        try:
            for k in which:
                if k not in pending:
                    out[k] = np.frombuffer(piece_digest(items[k].piece.tensor), np.uint8)
            for k, future in pending.items():
                out[k] = np.frombuffer(future.result(), np.uint8)
        finally:
            for future in pending.values():
                future.cancel()
        return out

    return finish


class StreamDigests:
    """The digests of the items a write pipeline writes, taken by its writer threads
    from the bytes they write, right after the block checksums read them (in cache):
    no pass of their own before the data file is laid out, and for an asynchronous
    save the staged copy (the bytes at the call). An item split over chunks is hashed
    in order: a part that arrives before the parts ahead of it is kept (a copy) until
    the writer of the part ahead takes it; no writer waits for another (a writer that
    waited for its turn while holding a staging slab could starve the stager of the
    part ahead of the slab it needs: a deadlock).

    The parts kept are bounded by ``early_cap`` bytes in all: a part that would pass it
    drops its item's parts instead, and the item is left to :func:`digest_stored`
    (over its bytes in the data file, after the writes): :attr:`spilled`."""

    def __init__(self, wanted: Sequence[int], nbytes: Sequence[int], early_cap: int | None = None) -> None:
        #: unique pipeline item -> its size, for the items to digest
        self.nbytes = {i: int(nbytes[i]) for i in wanted}
        self.done: dict[int, bytes] = {}
        self._states: dict[int, xxhash.xxh3_128] = {}
        #: per item being hashed in parts: the next byte offset it takes, and the parts
        #: that arrived early (offset -> bytes)
        self._next: dict[int, int] = {}
        self._early: dict[int, dict[int, bytes]] = {}
        self.early_cap = EARLY_CAP if early_cap is None else early_cap
        #: bytes in ``_early`` now, and the most at once
        self.held = self.peak_held = 0
        #: items whose early parts passed ``early_cap``: digested from the data file instead
        self.spilled: set[int] = set()
        self._lock = threading.Lock()

    def feed(self, item: int, start: int, view: memoryview) -> None:
        """Take the bytes ``[start, start + len(view))`` of ``item`` (ignored unless wanted)."""
        total = self.nbytes.get(item)
        if total is None:
            return
        if start == 0 and len(view) == total:
            self.done[item] = xxhash.xxh3_128_digest(view)
            return
        with self._lock:
            if item in self.spilled:
                return
            if self._next.get(item, 0) != start:
                if self.held + len(view) > self.early_cap:
                    self._spill(item)
                    return
                self._early.setdefault(item, {})[start] = bytes(view)
                self.held += len(view)
                self.peak_held = max(self.peak_held, self.held)
                return
            self._next[item] = -1  # this writer hashes: later parts wait in _early
            state = self._states.setdefault(item, xxhash.xxh3_128())
        part: memoryview | bytes | None = view
        at = start
        while part is not None:
            state.update(part)
            at += len(part)
            with self._lock:
                if item in self.spilled:  # dropped meanwhile: its parts are no longer kept
                    return
                part = self._early.get(item, {}).pop(at, None)
                if part is None:
                    self._next[item] = at
                    if at == total:
                        self.done[item] = self._states.pop(item).digest()
                        self._early.pop(item, None)
                else:
                    self.held -= len(part)

    def _spill(self, item: int) -> None:
        """(under the lock) Stop hashing ``item`` in parts: drop what is kept of it."""
        self.spilled.add(item)
        self.held -= sum(len(p) for p in self._early.pop(item, {}).values())
        self._states.pop(item, None)
        self._next.pop(item, None)

    def result(self, item: int) -> bytes:
        """``item``'s digest, once every byte of it was written (not for a spilled one)."""
        if self.nbytes.get(item) == 0:
            return xxhash.xxh3_128_digest(b"")
        return self.done[item]


def digest_stored(read_into: Callable[[int, memoryview], int], offset: int, nbytes: int, chunk: int) -> bytes:
    """XXH3-128 (as :func:`piece_digest`) of the ``nbytes`` bytes at ``offset`` read with
    ``read_into(offset, buffer)`` (a backend's, bound to the data file), ``chunk`` at a time."""
    state = xxhash.xxh3_128()
    buffer = memoryview(bytearray(max(1, min(chunk, nbytes))))
    at, end = offset, offset + nbytes
    while at < end:
        want = buffer[: min(len(buffer), end - at)]
        got = read_into(at, want)
        if got <= 0:
            raise EOFError(f"the data file ends at offset {at}, before the {nbytes} bytes at {offset}")
        state.update(want[:got])
        at += got
    return state.digest()


def digest_items(items: Sequence[WriteItem], threads: int) -> np.ndarray:
    """(n, 16) uint8: each item's digest (:func:`start_digests`, finished at once)."""
    return start_digests(items, threads)()


__all__ = [
    "EARLY_CAP",
    "PIECE_BYTES",
    "StreamDigests",
    "background",
    "cut_pieces",
    "digest_items",
    "digest_stored",
    "piece_digest",
    "rows_per_piece",
    "start_digests",
]
