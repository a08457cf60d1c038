"""Which ranks share a host, and which hosts hold each host's replicas.

A host is a failure domain of memory: the processes that lose their local tier
together. It is named by ``BCP_HOST_ID`` when set (tests simulate hosts this way),
else by the host name. ``BCP_FAILURE_DOMAIN`` (a rack, a power domain) groups hosts
that may fail together: replicas go to other domains first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from bcp.coordination.collectives import Coordinator
from bcp.trace import host_name

log = logging.getLogger(__name__)


def host_id() -> str:
    """This process's host: ``BCP_HOST_ID``, else the host name (the name its trace files carry)."""
    return host_name()


def failure_domain() -> str | None:
    """This process's failure domain (``BCP_FAILURE_DOMAIN``), or None."""
    return os.environ.get("BCP_FAILURE_DOMAIN") or None


@dataclasses.dataclass(frozen=True)
class HostMap:
    """The job's hosts, in host order (ordered by their lowest rank), and their ranks."""

    #: host ids in host order
    hosts: tuple[str, ...]
    #: each host's ranks, ascending
    ranks: tuple[tuple[int, ...], ...]
    #: each host's failure domain (its first rank's), None when unset
    domains: tuple[str | None, ...]

    @classmethod
    def from_records(cls, records: Sequence[tuple[str, str | None]]) -> HostMap:
        """From every rank's (host id, failure domain), in rank order."""
        order: dict[str, list[int]] = {}
        domain: dict[str, str | None] = {}
        for rank, (host, dom) in enumerate(records):
            order.setdefault(host, []).append(rank)
            domain.setdefault(host, dom)
        hosts = tuple(order)  # insertion order: by lowest rank
        return cls(hosts, tuple(tuple(order[h]) for h in hosts), tuple(domain[h] for h in hosts))

    @classmethod
    def gather(cls, coord: Coordinator) -> HostMap:
        """(all ranks, collective) Every rank's host and failure domain."""
        return cls.from_records(coord.all_gather((host_id(), failure_domain())))

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks)

    def host_of(self, rank: int) -> int:
        for h, ranks in enumerate(self.ranks):
            if rank in ranks:
                return h
        raise ValueError(f"rank {rank} is not in the host map")

    def host_of_rank(self) -> list[int]:
        """Each rank's host, in rank order (one pass, for lookups of many ranks)."""
        out = [0] * self.world_size
        for h, ranks in enumerate(self.ranks):
            for r in ranks:
                out[r] = h
        return out

    def local_index(self, rank: int) -> int:
        """The rank's position among its host's ranks."""
        return self.ranks[self.host_of(rank)].index(rank)

    def first_rank(self, host: int) -> int:
        return self.ranks[host][0]

    def is_first(self, rank: int) -> bool:
        """Whether ``rank`` is its host's first rank (the one that writes host-wide files)."""
        return self.first_rank(self.host_of(rank)) == rank


def replica_hosts(domains: Sequence[str | None], host: int, replicas: int) -> list[int]:
    """The hosts holding replicas of ``host``'s share: the next hosts in host order
    (``host+1, host+2, ...``, wrapping), those of another failure domain first; never
    ``host`` itself. Fewer than ``replicas`` when there are fewer other hosts."""
    n = len(domains)
    others = [(host + i) % n for i in range(1, n)]
    mine = domains[host]
    away = [o for o in others if mine is None or domains[o] != mine]
    near = [o for o in others if o not in away]
    return (away + near)[:replicas]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One replica: ``src`` sends its data file to ``dst`` (ranks of bcp's group)."""

    src: int
    dst: int


def transfers(hosts: HostMap, replicas: int) -> list[Transfer]:
    """Every replica of a local save: each rank sends to the rank of the same local
    index on each replica host of its host (wrapping when that host has fewer ranks)."""
    out: list[Transfer] = []
    for h, ranks in enumerate(hosts.ranks):
        for r in replica_hosts(hosts.domains, h, replicas):
            peers = hosts.ranks[r]
            out.extend(Transfer(src, peers[i % len(peers)]) for i, src in enumerate(ranks))
    return out


def warn_if_short(hosts: HostMap, replicas: int) -> None:
    """The WARNING (once per manager, on the caller's rank) when the hosts cannot
    hold ``replicas`` copies of each share plus the share itself."""
    if replicas and len(hosts.hosts) < replicas + 1:
        log.warning(
            "local tier: %d replicas asked for, but the job runs on %d host(s): each share gets %d replica(s)",
            replicas,
            len(hosts.hosts),
            len(hosts.hosts) - 1,
        )
    same = [h for h, d in enumerate(hosts.domains) if d is not None and hosts.domains.count(d) == len(hosts.hosts)]
    if replicas and len(hosts.hosts) > 1 and same:
        log.warning("local tier: every host is in failure domain %r: replicas cannot leave it", hosts.domains[same[0]])
