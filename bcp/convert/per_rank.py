"""Per-rank objects (``bcp.PerRank``: RNG states, a dataloader's position) in the
torch and DCP exports: no export picks one rank's value silently. Every saving
rank's value is kept under ``__rank_<r>__`` keys (``per_rank="all"``), or the caller
names one saved rank (docs/interop.md, "Per-rank objects in exports")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bcp.reader import CheckpointReader, PerRankChoice

#: An export that keeps every rank's value of a per-rank object (``per_rank="all"``)
#: writes ``{rank_key(0): value of rank 0, rank_key(1): ...}`` where the object was.
RANK_KEY = "__rank_{}__"


def rank_key(rank: int) -> str:
    """``__rank_<rank>__``: the key of saved rank ``rank``'s value of a per-rank object
    in a torch or DCP export (the key a DCP load template on rank ``rank`` uses)."""
    return RANK_KEY.format(rank)


def per_rank_keys(reader: CheckpointReader, keys: Iterable[str] | None = None) -> list[str]:
    """The objects among ``keys`` (default: all) that were saved per rank."""
    return [k for k in (reader.object_keys() if keys is None else keys) if reader.is_per_rank(k)]


def export_object(reader: CheckpointReader, key: str, per_rank: PerRankChoice) -> Any:
    """A stored object as an export writes it. A per-rank one: with ``"all"``, a dict
    ``{rank_key(r): value}`` over every saving rank ``r``, in rank order; with a rank,
    that saved rank's value (ValueError naming the key and the ranks that saved it
    when it did not)."""
    if not reader.is_per_rank(key):
        return reader.read_object(key)
    values = reader.per_rank_objects(key)
    if per_rank == "all":
        return {rank_key(r): values[r] for r in sorted(values)}
    if per_rank not in values:
        raise ValueError(
            f"per-rank object {key!r} was saved by ranks {sorted(values)}, not by rank {per_rank} (--per-rank)"
        )
    return values[per_rank]
