"""Room for a local save: the local tier never fills a host's memory.

Each rank states what it will put on its host (its data file and the replicas it
will receive, estimated as ``replicas`` more of its own size), the free space of its
local root (``statvfs``; for ``/dev/shm`` that is host memory) and the bytes to keep
free there (``LocalTier.keep_free`` of the file system, 10% by default). The ranks
share these (one ``all_gather`` of three integers each), and every rank reaches the
same verdict: if any host's ranks together need more than its free space less what
it keeps free, no rank saves this step locally.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from bcp.coordination.collectives import Coordinator
from bcp.shards import local_pieces
from bcp.state import flatten_state
from bcp.tiers.hosts import HostMap

log = logging.getLogger(__name__)

Statvfs = Callable[[str], Any]


@dataclasses.dataclass(frozen=True)
class HostRoom:
    """One host's verdict, with its numbers (bytes)."""

    host: str
    need: int
    free: int
    #: what the host keeps free (``LocalTier.keep_free`` of its file system)
    kept: int

    @property
    def enough(self) -> bool:
        return self.need + self.kept <= self.free

    def __str__(self) -> str:
        return (
            f"host {self.host}: needs {self.need / 2**20:.1f} MiB, {self.free / 2**20:.1f} MiB free, "
            f"keeping {self.kept / 2**20:.1f} MiB free (LocalTier.keep_free)"
        )


def state_bytes(state: Mapping[str, Any]) -> int:
    """Tensor bytes this rank holds in ``state`` (an upper bound on its data file
    before deduplication: replicated tensors are written by one rank)."""
    return sum(
        piece.tensor.numel() * piece.tensor.element_size()
        for leaf in flatten_state(state).values()
        if leaf.is_tensor
        for piece in local_pieces(leaf.value, leaf.fqn).pieces
    )


def host_rooms(hosts: HostMap, records: list[tuple[int, int, int]]) -> list[HostRoom]:
    """Each host's need (the sum of its ranks') against its first rank's free space and margin."""
    out = []
    for h, ranks in enumerate(hosts.ranks):
        _need, free, kept = records[ranks[0]]
        out.append(HostRoom(hosts.hosts[h], sum(records[r][0] for r in ranks), free, kept))
    return out


def own_record(
    root: str, own_bytes: int, replicas: int, keep_free: float, statvfs: Statvfs = os.statvfs
) -> tuple[int, int, int]:
    """This rank's need, its local root's free space and the bytes to keep free there."""
    try:
        st = statvfs(root)
        free, total = int(st.f_bavail) * int(st.f_frsize), int(st.f_blocks) * int(st.f_frsize)
    except OSError as e:
        log.warning("local tier: cannot read the free space of %s: %s", root, e)
        free, total = 0, 0
    return own_bytes * (1 + replicas), free, math.ceil(keep_free * total)


def short_hosts(coord: Coordinator, hosts: HostMap, records: list[tuple[int, int, int]]) -> list[HostRoom]:
    """The hosts whose ranks' ``records`` (every rank's :func:`own_record`) lack room;
    a WARNING names them (on the coordinator and on a short host's first rank)."""
    short = [r for r in host_rooms(hosts, records) if not r.enough]
    mine = hosts.hosts[hosts.host_of(coord.rank)]
    if short and (coord.is_coordinator or (hosts.is_first(coord.rank) and mine in {r.host for r in short})):
        log.warning(
            "local tier: not enough room on %d host(s), this step is not saved locally: %s",
            len(short),
            "; ".join(map(str, short)),
        )
    return short


def check_room(
    coord: Coordinator,
    hosts: HostMap,
    root: str,
    own_bytes: int,
    replicas: int,
    keep_free: float,
    statvfs: Statvfs = os.statvfs,
) -> list[HostRoom]:
    """(all ranks, collective) The hosts that lack room for this local save (empty:
    every host has room); the same list on every rank. A WARNING names them."""
    return short_hosts(coord, hosts, coord.all_gather(own_record(root, own_bytes, replicas, keep_free, statvfs)))
