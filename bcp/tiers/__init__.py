"""The local tier: checkpoints in host memory (or NVMe), replicated to other hosts,
drained to persistent storage one in M (docs/tiers.md).

``bcp.LocalTier`` is its configuration, given to ``CheckpointManager(tier=...)``;
the manager drives the rest (:class:`bcp.tiers.tier.Tier`). Its modules, one job each,
are in docs/architecture.md.
"""

from bcp.tiers.config import LocalTier

__all__ = ["LocalTier"]
