"""The memory-speed limit of a load: a copy of the same bytes into warm buffers.

A load from the page cache or tmpfs copies bytes that are already in memory, so the
fastest it can be is a memcpy of those bytes into destination memory that has been
touched before (no page faults), the way a load fills a model's existing tensors.
Benchmarks import this to print that limit beside their loads, measured in the same
run (the machine is shared: compare ratios from one run, never numbers across runs):

    from memcpy_limit import WarmMemcpy     # with bench/ on sys.path
    memcpy = WarmMemcpy(state)              # or WarmMemcpy(nbytes)
    seconds = memcpy()                      # one timed copy; call again for more samples

The copy is ``torch.Tensor.copy_`` tensor by tensor, with torch's default intra-op
threads (bench/peers.py's "memcpy into warm buffers" row).

:func:`fresh_memcpy_seconds` is the other limit: a copy into newly allocated memory
(every page faulted in on first touch), what a first ``async_save`` staging its
tensors into memory it has just allocated costs at best.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TypeAlias

import torch

#: tensors, a dict of them, or a byte count
Source: TypeAlias = "int | Mapping[str, torch.Tensor] | Iterable[torch.Tensor]"

#: a byte count is copied as this many float32 tensors (as bench/peers.py's state)
DEFAULT_TENSORS = 48


def _sources(src: Source, tensors: int) -> list[torch.Tensor]:
    if isinstance(src, int):
        per = max(1, src // tensors // 4)
        out = [torch.empty(per) for _ in range(tensors)]
        for t in out:
            t.uniform_(-1, 1)  # touched: the source is in memory, as a page-cache page is
        return out
    values = src.values() if isinstance(src, Mapping) else src
    return [t for t in values if isinstance(t, torch.Tensor)]


class WarmMemcpy:
    """Times a copy of ``src`` (tensors, a dict of them, or a byte count) into
    destination buffers allocated and copied into once up front: each call is one
    copy of :attr:`nbytes` bytes, returned in seconds."""

    def __init__(self, src: Source, *, tensors: int = DEFAULT_TENSORS):
        self.src = _sources(src, tensors)
        self.dst = [torch.empty_like(t) for t in self.src]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)
        self._copy()  # warm-up: touches every destination page

    def _copy(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self._copy()
        return time.perf_counter() - t0


def warm_memcpy_seconds(src: Source, repeats: int = 1) -> list[float]:
    """Seconds of ``repeats`` copies of ``src`` into warm buffers (see :class:`WarmMemcpy`)."""
    memcpy = WarmMemcpy(src)
    return [memcpy() for _ in range(repeats)]


def fresh_memcpy_seconds(src: Source, *, tensors: int = DEFAULT_TENSORS) -> float:
    """Seconds of one copy of ``src`` into destination tensors allocated for it, never
    touched before (``torch.empty_like`` then ``copy_``, tensor by tensor)."""
    sources = _sources(src, tensors)
    t0 = time.perf_counter()
    out = [torch.empty_like(t).copy_(t) for t in sources]
    seconds = time.perf_counter() - t0
    del out
    return seconds


#: the piece a verified read copies and checks at a time (bcp's in-memory loads use 2 MiB)
VERIFIED_PIECE = 2 << 20


class VerifiedReads:
    """Times the bare verified read of every file under ``root`` (or of ``files``, or of
    byte ``ranges`` (file, offset, bytes), each read on its own: a tensor at a time):
    ``preadv`` in 2 MiB pieces into one warm buffer of their size (each piece to its own
    place, as a load fills distinct tensors), each piece checked with CRC32C (the implementation bcp
    uses) right after it lands, while it is in cache, on ``threads`` threads. It is the
    limit of a load from the page cache or tmpfs that verifies every byte on this
    machine, copy and checksum sharing the cores: no planning, no catalog, no
    destinations' checks. ``into``: a writable byte view per range to read it into
    instead (a state's own tensors: many small allocations copy slower than one buffer)."""

    def __init__(
        self,
        root: str | None = None,
        *,
        files: list[str] | None = None,
        ranges: list[tuple[str, int, int]] | None = None,
        into: list[memoryview] | None = None,
        threads: int = 2,
        piece: int = VERIFIED_PIECE,
    ):
        from bcp.metadata import checksum

        self.crc = checksum.crc32c
        if ranges is None:  # whole files: every file under root, or those given
            if files is None:
                assert root is not None, "a root, a list of files or of byte ranges"
                files = [os.path.join(d, name) for d, _dirs, names in os.walk(root) for name in sorted(names)]
            ranges = [(path, 0, os.path.getsize(path)) for path in files]
        self.nbytes = sum(size for _p, _s, size in ranges)
        if into is None:  # one buffer, zero-filled: every page touched
            buffer = memoryview(bytearray(self.nbytes))
            ends = list(itertools.accumulate(size for _p, _s, size in ranges))
            into = [buffer[end - size : end] for (_p, _s, size), end in zip(ranges, ends, strict=True)]
        pieces: list[tuple[str, int, memoryview]] = []  # (file, offset in it, where its bytes go)
        for (path, start, size), dest in zip(ranges, into, strict=True):  # a tensor's bytes in pieces
            pieces += [(path, start + o, dest[o : o + piece]) for o in range(0, size, piece)]
        self.shares = [pieces[i::threads] for i in range(threads)]
        self()  # warm-up: opens the pages

    def _read(self, share: list[tuple[str, int, memoryview]]) -> None:
        fds: dict[str, int] = {}
        try:
            for path, at, view in share:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                os.preadv(fd, [view], at)
                self.crc(view)
        finally:
            for fd in fds.values():
                os.close(fd)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._read, args=(s,)) for s in self.shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0


def verified_reads_into(uri: str, tensors: dict) -> VerifiedReads:
    """:class:`VerifiedReads` of each tensor's bytes in the checkpoint at ``uri`` (one row
    each: saved by one process) into the tensor of the same name in ``tensors``: the
    in-memory load's limit in the load's own destination memory."""
    import bcp

    ranges, into = [], []
    with bcp.open(uri) as reader:
        for fqn, tensor in tensors.items():
            if not tensor.numel():
                continue
            entry = reader.meta(fqn).entry
            (file,), (at,), (size,) = entry.files, entry.byte_offsets, entry.sizes
            ranges.append((os.path.join(uri, entry.file_names[int(file)]), int(at), int(size)))
            into.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return VerifiedReads(ranges=ranges, into=into)
