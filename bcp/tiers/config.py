"""The local tier's configuration: one value, given to ``CheckpointManager(tier=...)``."""

from __future__ import annotations

import dataclasses
import os

#: Replication sends data files in chunks of at most this many bytes (one in flight per stream).
DEFAULT_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """Keep the newest checkpoints in each host's memory (or NVMe), replicated to
    other hosts, and write one in ``persist_every`` steps to persistent storage
    (docs/tiers.md).

    ``CheckpointManager(root, tier=bcp.LocalTier())`` saves every ``every`` steps to
    ``<dir>/bcp-<uid>/<job>`` on each host (``<job>`` is derived from the manager's root
    URI), sends each host's share to ``replicas`` other hosts, keeps the newest
    ``keep`` local steps per host, and copies every step that is a multiple of
    ``persist_every`` to the manager's root (None: never; the persistent tier then
    only holds what the local tier could not save)."""

    #: the directory holding the local roots: host memory by default, or a local NVMe mount
    dir: str | os.PathLike = "/dev/shm"
    #: save to the local tier every ``every`` steps (a step that is a multiple of it)
    every: int = 1
    #: copies of each host's share on other hosts (0: none)
    replicas: int = 1
    #: drain to persistent storage the steps that are multiples of this (None: never)
    persist_every: int | None = 50
    #: local steps each host keeps (the newest ones)
    keep: int = 2
    #: largest message of replication (bounds its memory: one chunk in flight per stream)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: each local save refers to the host's previous local step for its unchanged pieces, and
    #: each drain uploads only the data files the persistent root lacks (docs/tiers.md,
    #: "Incremental local steps"); independent of the manager's own ``incremental``
    incremental: bool = False
    #: the share of the local root's file system each host keeps free: a host whose
    #: share (with the replicas it receives) would leave less skips the step locally
    keep_free: float = 0.10

    def __post_init__(self) -> None:
        for name, low in (("every", 1), ("replicas", 0), ("keep", 1), ("chunk_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LocalTier.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.incremental, bool):
            raise ValueError(f"LocalTier.incremental must be a bool, got {self.incremental!r}")
        k = self.keep_free
        if isinstance(k, bool) or not isinstance(k, int | float) or not 0 <= k < 1:
            raise ValueError(f"LocalTier.keep_free must be a number in [0, 1), got {k!r}")
        p = self.persist_every
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ValueError(f"LocalTier.persist_every must be an int >= 1 or None, got {p!r}")
        if self.chunk_bytes > 1 << 30:
            raise ValueError(f"LocalTier.chunk_bytes must be at most 1 GiB, got {self.chunk_bytes}")

    def local_due(self, step: int) -> bool:
        return step % self.every == 0

    def drain_due(self, step: int) -> bool:
        return self.persist_every is not None and step % self.persist_every == 0
