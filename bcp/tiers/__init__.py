"""The local tier: checkpoints in host memory (or NVMe), replicated to peer hosts,
drained to persistent storage, and recovered from whichever host still holds each
byte (docs/tiers.md)."""
