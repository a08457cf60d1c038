"""The exchange of a recovery from the local tier (``bcp.tiers.recover``, step 5; docs/tiers.md, "Recovering").

Every rank has listed the byte ranges its load will read from files its host does
not hold (its read plan's runs, widened to whole checksum blocks: :func:`wanted_ranges`);
one ``all_gather`` gives every rank every list. From them each rank computes the same plan
(:meth:`Exchange.plan`): the ranges of one host's ranks are merged per file, and each
merged range is asked once (by the lowest rank wanting part of it) from a host holding
its file, cut into pieces of at most ``chunk_bytes``, each piece served by the rank of a
holding host that sends the fewest bytes so far, and packed into rounds of at most
``round_bytes`` sent plus received per rank. Then each rank carries out its own part
(:meth:`Exchange.run`): uint8 tensors over bcp's gloo group (point-to-point), landing
at their offsets in the host's recovery directory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from bcp.coordination.collectives import Coordinator, GroupCoordinator
from bcp.errors import CorruptCheckpointError, StorageError
from bcp.io_scheduler.read_exec import MAX_PADDING
from bcp.io_scheduler.read_plan import plan_tensor_reads
from bcp.loader import match_state
from bcp.metadata import Manifest
from bcp.options import LoadOptions
from bcp.reader import CheckpointMetadata, open_reader
from bcp.references import parent_factory
from bcp.state import detach_stateful
from bcp.target import resolve_backend
from bcp.tensor_io import byte_view
from bcp.tiers.arrival import Arrivals
from bcp.tiers.hosts import HostMap
from bcp.tiers.incremental_local import data_path
from bcp.tiers.inventory import LocalChoice
from bcp.tiers.recovery_dir import NOFOLLOW

#: Each transfer between two ranks is cut into pieces of at most this many bytes.
CHUNK_BYTES = 64 << 20
#: What one rank sends plus receives in one round of the exchange, at most (a single
#: piece larger than this, impossible with the defaults, gets a round of its own).
ROUND_BYTES = 256 << 20


def merge_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The union of the byte ranges [starts[i], ends[i]) as disjoint, ascending ranges
    (lo, hi), ranges that overlap or touch merged into one; and, for each input range,
    the index of the merged range holding it."""
    if not len(starts):
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    group = np.empty(len(s), np.int64)
    group[order] = np.cumsum(new) - 1
    return s[first], reach[last], group


def join_across_padding(
    lo: np.ndarray, hi: np.ndarray, frag_starts: np.ndarray, frag_ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint ascending ranges (lo, hi) of one file with each range that ends at a
    fragment's end (one of ``frag_ends``) joined to the next when that one starts at a
    fragment's start (``frag_starts``) less than :data:`~bcp.io_scheduler.read_exec.MAX_PADDING`
    bytes on: the bytes between (the writer's alignment padding, or a small fragment not
    wanted) are ones a load's coalesced read spans (a bulk batch of tensors, planned reads
    joined across padding), so they are fetched too, and such a read waits for no byte the
    exchange would not bring."""
    if len(lo) < 2:
        return lo, hi
    joins = (lo[1:] - hi[:-1] < MAX_PADDING) & np.isin(hi[:-1], frag_ends) & np.isin(lo[1:], frag_starts)
    first = np.flatnonzero(np.concatenate([[True], ~joins]))
    last = np.append(first[1:] - 1, len(lo) - 1)
    return lo[first], hi[last]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One transfer: ``nbytes`` of data file ``file`` (manifest index) from ``offset``."""

    sender: int
    receiver: int
    file: int
    offset: int
    nbytes: int


class Exchange:
    """Every rank computes the same transfers and rounds from the gathered requests,
    then carries out its own part."""

    def __init__(
        self,
        coord: Coordinator,
        hosts: HostMap,
        choice: LocalChoice,
        manifest: Manifest,
        step_dir: str,
        recovery_dir: str,
        round_bytes: int,
        chunk_bytes: int,
    ) -> None:
        self.coord = coord
        self.hosts = hosts
        self.choice = choice
        self.manifest = manifest
        self.step_dir = step_dir
        self.recovery_dir = recovery_dir
        self.round_bytes = max(1, round_bytes)
        self.chunk_bytes = max(1, min(chunk_bytes, self.round_bytes))
        self.rounds_of: list[list[Piece]] = []
        #: direction -> this rank's messages of one round, back to back, reused from round to
        #: round (memory touched for the first time fills at a fraction of memcpy speed); the
        #: two hold at most ``round_bytes`` together
        self._buffers: dict[str, torch.Tensor] = {}
        #: told of each piece this rank has written, when the host's ranks load meanwhile
        self.arrivals: Arrivals | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rounds = 0

    def plan(self, requests: list[np.ndarray]) -> None:
        """Who sends what to whom, in which round (the same on every rank). ``requests``:
        each rank's (file, offset, bytes) rows; the ranges of one host's ranks are merged
        per file (each byte moves once per host), each merged range received by the
        lowest rank that asked for part of it."""
        host_of = self.hosts.host_of_rank()
        asked: dict[tuple[int, int], list[np.ndarray]] = {}  # (host, file) -> (start, end, rank) rows
        for rank, rows in enumerate(requests):
            rows = rows[rows[:, 2] > 0]
            for file in np.unique(rows[:, 0]).tolist():
                mine = rows[rows[:, 0] == file]
                ends = mine[:, 1] + mine[:, 2]
                asked.setdefault((host_of[rank], file), []).append(
                    np.stack([mine[:, 1], ends, np.full(len(mine), rank, np.int64)], axis=1)
                )
        wanted: list[tuple[int, int, int, int, int]] = []  # (file, offset, bytes, host, receiving rank)
        for (host, file), parts in asked.items():
            rows = np.concatenate(parts)
            lo, hi, group = merge_ranges(rows[:, 0], rows[:, 1])
            receivers = np.full(len(lo), self.coord.world_size, np.int64)
            np.minimum.at(receivers, group, rows[:, 2])
            for a, b, r in zip(lo.tolist(), hi.tolist(), receivers.tolist(), strict=True):
                wanted.append((file, a, b - a, host, r))
        servers = {
            file: [r for h in holders for r in self.hosts.ranks[h]] for file, holders in enumerate(self.choice.holders)
        }
        # each piece (not each range) goes to the least-loaded rank holding its file: one
        # large range is served by every rank of its holders at once, not by one of them
        load = [0] * self.coord.world_size
        pieces: list[Piece] = []
        for file, offset, nbytes, _host, receiver in sorted(wanted):
            for at in range(0, nbytes, self.chunk_bytes):
                size = min(self.chunk_bytes, nbytes - at)
                sender = min(servers[file], key=lambda r: (load[r], r))
                load[sender] += size
                pieces.append(Piece(sender, receiver, file, offset + at, size))
        self.rounds_of = self._rounds(pieces)

    def _rounds(self, pieces: list[Piece]) -> list[list[Piece]]:
        """First fit: each piece in the earliest round where neither its sender nor its
        receiver would move more than ``round_bytes``."""
        used: list[dict[int, int]] = []
        first_open: dict[int, int] = {}
        rounds: list[list[Piece]] = []
        for p in pieces:
            r = max(first_open.get(p.sender, 0), first_open.get(p.receiver, 0))
            while r < len(rounds) and (
                used[r].get(p.sender, 0) + p.nbytes > self.round_bytes
                or used[r].get(p.receiver, 0) + p.nbytes > self.round_bytes
            ):
                r += 1
            if r == len(rounds):
                rounds.append([])
                used.append({})
            rounds[r].append(p)
            for who in (p.sender, p.receiver):
                used[r][who] = used[r].get(who, 0) + p.nbytes
                while first_open.get(who, 0) < len(rounds) and used[first_open.get(who, 0)].get(who, 0) >= (
                    self.round_bytes
                ):
                    first_open[who] = first_open.get(who, 0) + 1
        return rounds

    def run(self) -> BaseException | None:
        """This rank's sends and receives, round by round. Returns the first error (a
        file that could not be read or written): every transfer still happens, so no
        peer waits forever, and the caller raises it on every rank."""
        me = self.coord.rank
        files: dict[tuple[str, int], int] = {}
        error: BaseException | None = None
        try:
            for tag, pieces in enumerate(self.rounds_of):
                sends = [p for p in pieces if p.sender == me]
                recvs = [p for p in pieces if p.receiver == me]
                if not sends and not recvs:
                    continue
                self.rounds += 1
                failed = self._round(tag, sends, recvs, files)
                error = error or failed
        finally:
            for fd in files.values():
                os.close(fd)
        return error

    def _fd(self, files: dict[tuple[str, int], int], where: str, file: int) -> int:
        key = (where, file)
        if key not in files:
            root = self.step_dir if where == "read" else self.recovery_dir
            path = data_path(root, self.manifest.data_files[file])  # a reference: its sibling step's file
            flags = (os.O_RDONLY if where == "read" else os.O_WRONLY) | NOFOLLOW | os.O_NONBLOCK
            files[key] = os.open(path, flags)
        return files[key]

    def _round(
        self, tag: int, sends: list[Piece], recvs: list[Piece], files: dict[tuple[str, int], int]
    ) -> BaseException | None:
        assert isinstance(self.coord, GroupCoordinator), "only one rank: nothing to exchange"
        dist, group = self.coord.dist, self.coord.group
        ranks = dist.get_process_group_ranks(group)
        error: BaseException | None = None
        outgoing: dict[int, list[Piece]] = {}
        incoming: dict[int, list[Piece]] = {}
        for p in sends:
            outgoing.setdefault(p.receiver, []).append(p)
        for p in recvs:
            incoming.setdefault(p.sender, []).append(p)
        receiving = []
        inboxes: dict[int, torch.Tensor] = {}
        inbound = self._buffer("in", sum(p.nbytes for p in recvs))
        outbound = self._buffer("out", sum(p.nbytes for p in sends))
        start = 0
        for peer, ps in incoming.items():
            size = sum(p.nbytes for p in ps)
            inboxes[peer] = inbound[start : start + size]
            start += size
            receiving.append((peer, dist.irecv(inboxes[peer], src=ranks[peer], group=group, tag=tag)))
        sending = []
        start = 0
        for peer, ps in outgoing.items():
            box = outbound[start : start + sum(p.nbytes for p in ps)]
            start += box.numel()
            view = byte_view(box)
            at = 0
            for p in ps:
                try:
                    got = os.preadv(self._fd(files, "read", p.file), [view[at : at + p.nbytes]], p.offset)
                    if got != p.nbytes:
                        raise CorruptCheckpointError(
                            f"local tier: {self.manifest.data_files[p.file].path} in {self.step_dir} ended at "
                            f"byte {p.offset + got}, before {p.offset + p.nbytes}",
                            file=self.manifest.data_files[p.file].path,
                            offset=p.offset + got,
                        )
                except CorruptCheckpointError as e:
                    error = error or e
                    view[at : at + p.nbytes] = bytes(p.nbytes)
                except OSError as e:  # EIO, EACCES: damage of this host's copy, quarantined like bad bytes
                    unreadable = StorageError(
                        str(e), uri=self.step_dir, key=self.manifest.data_files[p.file].path, action="reading"
                    )
                    error = error or unreadable
                    view[at : at + p.nbytes] = bytes(p.nbytes)
                at += p.nbytes
            self.bytes_sent += at
            sending.append(dist.isend(box, dst=ranks[peer], group=group, tag=tag))
        for peer, work in receiving:  # each message written as soon as it is in
            work.wait()
            ps = incoming[peer]
            view = byte_view(inboxes[peer])
            at = 0
            for p in ps:
                try:
                    fd = self._fd(files, "write", p.file)
                    done = 0
                    while done < p.nbytes:
                        done += os.pwritev(fd, [view[at + done : at + p.nbytes]], p.offset + done)
                    if self.arrivals is not None:
                        self.arrivals.landed(p.file, p.offset, p.offset + p.nbytes)
                except OSError as e:
                    error = error or e
                at += p.nbytes
            self.bytes_received += at
        for work in sending:
            work.wait()
        return error

    def _buffer(self, direction: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of this rank's buffer for ``direction`` (grown when short)."""
        buf = self._buffers.get(direction)
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop(direction, None)  # freed before the larger one is made
            buf = self._buffers[direction] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]


# -- what each rank needs --------------------------------------------------------------------------


def wanted_ranges(
    state: Any,
    recovery_dir: str,
    manifest: Manifest,
    metadata: CheckpointMetadata,
    held: frozenset[int],
    coord: Coordinator,
    opts: LoadOptions,
) -> np.ndarray:
    """(N, 3) int64 rows (data file index, byte offset, bytes), disjoint and sorted: the
    byte ranges this rank's load will read from files its host does not hold. The
    template is matched as ``bcp.load`` matches it (same strictness, world size and
    replica choice), so a mismatch raises here, before any byte moves; the runs are
    bcp.load's own (:func:`~bcp.io_scheduler.read_plan.plan_tensor_reads`, one box at a
    time, the same replica choice), each widened to the whole checksum blocks it
    touches, and joined across the padding between two fragments where a read of the
    load may span it (:func:`join_across_padding`): the load reads exactly those bytes
    (the runs, the rest of each block it verifies, the padding its coalesced reads skip
    over), so every byte it reads has been fetched by this rank, and no read of it waits
    for the end of the whole exchange."""
    detached, _stateful = detach_stateful(state)
    reader = open_reader(
        resolve_backend(recovery_dir),
        metadata,
        allow_pickle=opts.allow_pickle,
        parent=parent_factory(recovery_dir),  # never read here: the plan needs the catalog alone
    )
    index = {f.path: i for i, f in enumerate(manifest.data_files)}
    block = manifest.checksum_block_bytes
    starts: dict[int, list[np.ndarray]] = {}
    ends: dict[int, list[np.ndarray]] = {}
    bounds: dict[int, list[tuple[int, int]]] = {}  # file -> (start, end) of each fragment read from it
    # a tensor whose every fragment lies in files this host holds needs nothing fetched: not planned
    held_names = {manifest.data_files[i].path for i in held}
    try:
        plan = match_state(reader, detached, opts.strict, coord.world_size, opts.reshard_objects)
        requests = plan.tensor_requests
        # the entries built together, as the load builds them (one tiling check, not one per tensor)
        entries = reader.catalog.entries([request.fqn for request in requests])
        for request, entry in zip(requests, entries, strict=True):
            names = entry.file_names
            if all(names[code] in held_names for code in entry.files.tolist()):
                continue
            for runs in plan_tensor_reads(entry, [request.box], prefer_rank=coord.rank):
                frag = runs.fragment
                file = index[frag.file]
                if file in held or not runs.nbytes:
                    continue
                first = runs.src // block
                last = (runs.src + (runs.run_bytes - 1)) // block
                bounds.setdefault(file, []).append((frag.byte_offset, frag.byte_offset + frag.nbytes))
                starts.setdefault(file, []).append(frag.byte_offset + first * block)
                ends.setdefault(file, []).append(frag.byte_offset + np.minimum((last + 1) * block, frag.nbytes))
    finally:
        reader.close()
    rows = [np.empty((0, 3), np.int64)]
    for file in sorted(starts):
        lo, hi, _group = merge_ranges(np.concatenate(starts[file]), np.concatenate(ends[file]))
        frags = np.array(bounds[file], np.int64)
        lo, hi = join_across_padding(lo, hi, frags[:, 0], frags[:, 1])
        rows.append(np.stack([np.full(len(lo), file, np.int64), lo, hi - lo], axis=1))
    return np.concatenate(rows).astype(np.int64)
