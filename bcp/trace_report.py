"""Merging the ranks' trace files (``bcp.trace``) into one timeline, and summarising it.

``bcp trace DIR`` calls :func:`read_traces`, :func:`merge` (one Chrome trace JSON
document with every rank as a process: it opens in ui.perfetto.dev and
chrome://tracing) and :func:`summarise`: per operation (a save or a load, known by
its kind and checkpoint id) and per stage, the time each rank spent in it (the union
of its spans: overlapping chunk spans of several threads count once), the slowest
rank, the median, the stragglers and the stage's GB/s.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .trace import StageTotal, stage_totals

#: the files ``bcp.trace`` writes (the merged file does not match)
RANK_FILE = re.compile(r".+\.rank(\d+)\.json$")


class TraceError(ValueError):
    """A trace directory with no rank files, or a file that is not a bcp trace."""


def read_traces(directory: str | Path) -> list[dict[str, Any]]:
    """Every rank file in ``directory`` (``*.rank<N>.json``), parsed, sorted by name."""
    root = Path(directory)
    if not root.is_dir():
        raise TraceError(f"{root}: not a directory")
    docs = []
    for path in sorted(root.iterdir()):
        if not RANK_FILE.match(path.name):
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TraceError(f"{path}: not a readable trace file: {e}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise TraceError(f"{path}: not a Chrome trace document (no traceEvents list)")
        doc.setdefault("otherData", {}).setdefault("file", path.name)
        docs.append(doc)
    if not docs:
        raise TraceError(f"{root}: no trace files (*.rank<N>.json); save or load with trace={str(root)!r}")
    return docs


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace document holding every file's events (pid = rank)."""
    events: list[dict[str, Any]] = []
    seen_meta: set[tuple] = set()
    for doc in docs:
        for e in doc["traceEvents"]:
            if e.get("ph") == "M":
                key = (e.get("name"), e.get("pid"), e.get("tid"))
                if key in seen_meta:
                    continue
                seen_meta.add(key)
            events.append(e)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"files": [d.get("otherData", {}) for d in docs]},
    }


@dataclasses.dataclass(frozen=True)
class StageSummary:
    """One stage of one operation, over its ranks."""

    stage: str
    spans: int
    nbytes: int
    #: seconds each rank had the stage active
    per_rank: dict[int, float]
    #: ranks more than the straggler threshold slower than the median
    stragglers: tuple[int, ...]

    @property
    def total_seconds(self) -> float:
        return sum(self.per_rank.values())

    @property
    def slowest(self) -> tuple[int, float]:
        rank = max(self.per_rank, key=lambda r: (self.per_rank[r], -r))
        return rank, self.per_rank[rank]

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.per_rank.values())

    @property
    def gbps(self) -> float:
        """Job-wide: the stage's bytes over its slowest rank's time (the ranks run in parallel)."""
        seconds = self.slowest[1]
        return self.nbytes / seconds / 1e9 if seconds > 0 and self.nbytes else 0.0


@dataclasses.dataclass(frozen=True)
class OperationSummary:
    """One save or load: its stages in the order they first started."""

    kind: str
    label: str
    ranks: tuple[int, ...]
    seconds: float
    stages: tuple[StageSummary, ...]


def summarise(
    docs: Sequence[dict[str, Any]], *, straggler_pct: float = 20.0, min_seconds: float = 0.001
) -> list[OperationSummary]:
    """Per operation, per stage: see the module's docstring. A straggler is a rank
    more than ``straggler_pct`` percent and ``min_seconds`` slower than the median."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for doc in docs:
        other = doc.get("otherData", {})
        groups.setdefault((str(other.get("kind", "?")), str(other.get("label", ""))), []).append(doc)
    out = []
    for (kind, label), members in groups.items():
        totals: dict[int, dict[str, StageTotal]] = {}
        first: dict[str, float] = {}
        counts: dict[str, int] = {}
        for doc in members:
            rank = int(doc.get("otherData", {}).get("rank", 0))
            spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
            totals[rank] = stage_totals(spans)
            for e in spans:
                first[e["name"]] = min(first.get(e["name"], e["ts"]), e["ts"])
                counts[e["name"]] = counts.get(e["name"], 0) + 1
        stages = []
        for name in sorted(first, key=lambda n: first[n]):
            per_rank = {r: t[name].seconds for r, t in sorted(totals.items()) if name in t}
            nbytes = sum(t[name].nbytes for t in totals.values() if name in t)
            stages.append(
                StageSummary(name, counts[name], nbytes, per_rank, stragglers(per_rank, straggler_pct, min_seconds))
            )
        whole = next((s for s in stages if s.stage == kind), None)
        seconds = whole.slowest[1] if whole is not None else 0.0
        out.append(OperationSummary(kind, label, tuple(sorted(totals)), seconds, tuple(stages)))
    return out


def stragglers(per_rank: dict[int, float], pct: float, min_seconds: float = 0.0) -> tuple[int, ...]:
    """The ranks more than ``pct`` percent (and ``min_seconds``) over the median; none for one rank."""
    if len(per_rank) < 2:
        return ()
    median = statistics.median(per_rank.values())
    limit = max(median * (1 + pct / 100), median + min_seconds)
    return tuple(r for r, s in sorted(per_rank.items()) if s > limit)
