"""The local tier: checkpoints in host memory (or NVMe), replicated to other hosts,
drained to persistent storage one in M (docs/tiers.md).

``bcp.LocalTier`` is its configuration, given to ``CheckpointManager(tier=...)``;
the manager drives the rest (:class:`bcp.tiers.tier.Tier`). Modules, one job each:
``hosts`` (host identity, replica placement), ``paths`` (the local root, private
to its user), ``job`` (the job id binding local steps to the persistent root),
``room`` (the free-space check), ``holding`` (``holding.json``, file checks),
``local_save`` (after a local commit: metadata to every host, own share recorded),
``replicate`` (shares to replica hosts), ``retention`` (local steps kept per host),
``drain`` (a local step copied to persistent storage), ``inventory`` (what each
host holds, the choice of step), ``recover`` (fetching from peers and loading),
``recovery_dir`` (its directory, the check of a host's copy and quarantine),
``exchange`` (the transfers between hosts) and ``fallback`` (what recovery loads
instead, and says, when the local tier holds less than expected).
"""

from bcp.tiers.config import LocalTier

__all__ = ["LocalTier"]
