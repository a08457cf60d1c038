"""Replication: each rank sends its data file to its peers on the replica hosts.

Point-to-point over bcp's gloo group (CPU memory, so it works beside an NCCL
training group), in chunks of at most ``chunk_bytes``, one chunk in flight per
stream: in round ``k`` every rank posts chunk ``k`` of each file it sends and of each
file it receives, then waits for them. Messages between two ranks match in order,
so the rounds need no barrier and cannot deadlock.

The receiver writes through its host's file backend (a partial file renamed into
place), then recomputes the file's size and digest and lists it in ``holding.json``
only when they match the manifest. A file it could not write or that fails the check
is logged and left unlisted; the stream is still read to its end, so the other
files keep flowing. A sender that cannot read its file sends zeros (its receivers'
checks fail): it never leaves a peer waiting for a message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence

import torch

from bcp.backends import Backend, ObjectWriter
from bcp.coordination.collectives import Coordinator
from bcp.metadata import FileEntry, Manifest
from bcp.metadata.keys import data_file_key
from bcp.tiers.holding import add_held, verify
from bcp.tiers.hosts import HostMap, transfers
from bcp.tiers.paths import READ_FLAGS

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stream:
    peer: int
    entry: FileEntry
    buffer: torch.Tensor
    #: the sender's open file, or the receiver's writer
    fd: int | None = None
    writer: ObjectWriter | None = None
    #: why this stream's file will not be listed (receiver), or None
    failed: str | None = None

    def chunks(self, chunk_bytes: int) -> int:
        return math.ceil(self.entry.nbytes / chunk_bytes)

    def span(self, k: int, chunk_bytes: int) -> tuple[int, int]:
        offset = k * chunk_bytes
        return offset, min(chunk_bytes, self.entry.nbytes - offset)


def _write_chunk(writer: ObjectWriter, offset: int, data: memoryview) -> None:
    """Write one received chunk (a seam: tests corrupt or interrupt it here)."""
    writer.write_at(offset, data)


def _local_path(step_dir: str, key: str) -> str:
    return os.path.join(step_dir, *key.split("/"))


def replicate(
    coord: Coordinator,
    hosts: HostMap,
    replicas: int,
    manifest: Manifest,
    backend: Backend,
    step_dir: str,
    spans: Mapping[str, Sequence[tuple[int, int]]],
    chunk_bytes: int,
) -> list[str]:
    """(all ranks, collective) Send this rank's data file to its replica peers, receive
    those sent to it, list the received files that check out; returns their keys."""
    files = {e.path: e for e in manifest.data_files}
    generation = manifest.generation

    def file_of(rank: int) -> FileEntry | None:
        return files.get(data_file_key(generation, rank))

    plan = transfers(hosts, replicas)
    out_ = [(t.dst, e) for t in plan if t.src == coord.rank and (e := file_of(t.src)) is not None]
    in_ = [(t.src, e) for t in plan if t.dst == coord.rank and (e := file_of(t.src)) is not None]
    if not out_ and not in_:
        return []

    def buffer(entry: FileEntry) -> torch.Tensor:
        return torch.empty(min(chunk_bytes, max(entry.nbytes, 1)), dtype=torch.uint8)

    sends = [_Stream(dst, e, buffer(e)) for dst, e in out_]
    recvs = [_Stream(src, e, buffer(e)) for src, e in in_]
    try:
        if sends:
            fd = os.open(_local_path(step_dir, sends[0].entry.path), READ_FLAGS)  # checked by record_own
            for s in sends:  # one file, sent to each replica host
                s.fd = fd
        for r in recvs:
            try:
                r.writer = backend.open_writer(r.entry.path, size=r.entry.nbytes)
            except OSError as e:
                r.failed = f"cannot open it for writing: {e}"
        rounds = max(s.chunks(chunk_bytes) for s in (*sends, *recvs))
        for k in range(rounds):
            works = []
            for s in sends:
                if k < s.chunks(chunk_bytes):
                    offset, n = s.span(k, chunk_bytes)
                    view = s.buffer[:n]
                    _read(s, view, offset)
                    works.append(coord.isend(view, s.peer))
            for r in recvs:
                if k < r.chunks(chunk_bytes):
                    works.append(coord.irecv(r.buffer[: r.span(k, chunk_bytes)[1]], r.peer))
            for w in works:
                if w is not None:
                    w.wait()
            for r in recvs:
                if k < r.chunks(chunk_bytes) and r.failed is None and r.writer is not None:
                    offset, n = r.span(k, chunk_bytes)
                    try:
                        _write_chunk(r.writer, offset, r.buffer[:n].numpy().data)
                    except OSError as e:
                        r.failed = f"writing it failed: {e}"
                        r.writer.abort_after_failure()
        listed = _finish(recvs, step_dir, manifest, spans)
    finally:
        if sends and sends[0].fd is not None:
            os.close(sends[0].fd)
        for r in recvs:
            if r.writer is not None:
                r.writer.abort_after_failure()  # nothing after a commit
    return listed


def _read(stream: _Stream, view: torch.Tensor, offset: int) -> None:
    assert stream.fd is not None
    mem = view.numpy().data
    try:
        got = os.preadv(stream.fd, [mem], offset)
    except OSError as e:
        got = 0
        log.warning("local tier: reading %s to replicate it failed: %s (sending zeros)", stream.entry.path, e)
    if got < len(mem):
        view[got:].zero_()


def _finish(
    recvs: list[_Stream], step_dir: str, manifest: Manifest, spans: Mapping[str, Sequence[tuple[int, int]]]
) -> list[str]:
    """Commit the received files, check each against the manifest, list those that pass."""
    good: list[FileEntry] = []
    for r in recvs:
        if r.failed is None and r.writer is not None:
            try:
                if r.entry.nbytes == 0:
                    r.writer.write_at(0, b"")
                r.writer.commit()
            except OSError as e:
                r.failed = f"committing it failed: {e}"
        if r.failed is None:
            path = _local_path(step_dir, r.entry.path)
            r.failed = verify(path, r.entry, spans, manifest.checksum_block_bytes)
            if r.failed is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # never listed: only memory
        if r.failed is None:
            good.append(r.entry)
        else:
            log.warning("local tier: the replica %s from rank %d is not kept: %s", r.entry.path, r.peer, r.failed)
    if good:
        add_held(step_dir, manifest.save_id, good)
    return [e.path for e in good]
