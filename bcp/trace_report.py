"""Merging the ranks' trace files (``bcp.trace``) into one timeline, and summarising it.

``bcp trace DIR`` calls :func:`read_traces`, :func:`merge` (one Chrome trace JSON
document with every rank as a process: it opens in ui.perfetto.dev and
chrome://tracing) and :func:`summarise`: per operation (a save or a load, known by
its kind and checkpoint id) and per stage, the time each rank spent in it (the union
of its spans: overlapping chunk spans of several threads count once), the slowest
rank, the median, the stragglers and the stage's GB/s.

Given the measured speeds of the disk and the network (:class:`Speeds`; ``bcp trace
--disk-gbps/--network-gbps``, or ``--measure URI``: :func:`bcp.benchmark.storage_speed`),
it also puts the stages that move bytes through one of them against its speed
(:data:`MEASURED_STAGES`): per host (the ``host`` of the trace files: a host's ranks
share its disk and network), the bytes its ranks moved in the stage over the time any
of them was in it, for the host that spent longest in it; the share of the measured
speed that is, and the time the bytes would take at that speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import re
import secrets
import stat
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from bcp.backends import split_scheme
from bcp.trace import StageTotal, stage_totals

log = logging.getLogger(__name__)

#: the files ``bcp.trace`` writes (the merged file does not match)
RANK_FILE = re.compile(r".+\.rank(\d+)\.json$")


class TraceError(ValueError):
    """A trace directory with no rank files, or a file that is not a bcp trace."""


#: The largest trace file ``read_traces`` reads (bytes); a larger one is skipped with a
#: warning. A rank's file of a big save is a few MiB; this bounds the memory a planted
#: file can make ``bcp trace`` use.
MAX_TRACE_FILE_BYTES = 256 << 20


def _read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link, FIFO or device: opened
    with O_NOFOLLOW | O_NONBLOCK, so neither can block or redirect the read) of at most
    ``limit`` bytes; None (and a warning naming it) otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            log.warning("skipped %r: a symbolic link, not a trace file", str(path))
            return None
        raise TraceError(f"{path}: cannot open: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("skipped %r: not a regular file", str(path))
            return None
        if st.st_size > limit:
            log.warning("skipped %r: %d bytes, over the %d-byte limit of a trace file", str(path), st.st_size, limit)
            return None
        chunks = []
        left = limit + 1  # a file growing while read is cut at the limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            log.warning("skipped %r: grew over the %d-byte limit of a trace file", str(path), limit)
            return None
        return data
    finally:
        os.close(fd)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_trace(doc: object, where: str) -> dict[str, Any]:
    """``doc`` if it is a trace document the summary can use: a ``traceEvents`` list
    whose "X" events have a string ``name``, numbers ``ts`` and ``dur >= 0`` and an
    number ``args.bytes >= 0`` (if any), and an ``otherData`` object whose ``rank`` (if
    any) is an integer. TraceError naming ``where`` and the event otherwise."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{where}: not a Chrome trace document (no traceEvents list)")
    other = doc.setdefault("otherData", {})
    if not isinstance(other, dict):
        raise TraceError(f"{where}: otherData is not an object")
    rank = other.get("rank", 0)
    if type(rank) is not int or rank < 0:
        raise TraceError(f"{where}: otherData.rank is not a rank number: {rank!r:.80}")
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict):
            raise TraceError(f"{where}: traceEvents[{i}] is not an object")
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        ok = (
            isinstance(e.get("name"), str)
            and _number(e.get("ts"))
            and _number(e.get("dur"))
            and e["dur"] >= 0
            and isinstance(args, dict)
            and _number(args.get("bytes", 0))
            and args.get("bytes", 0) >= 0
        )
        if not ok:
            raise TraceError(
                f"{where}: traceEvents[{i}] is not a span bcp writes (a string name, numbers ts and dur >= 0, "
                "a number args.bytes >= 0)"
            )
    return doc


def read_traces(directory: str | Path, *, max_file_bytes: int = MAX_TRACE_FILE_BYTES) -> list[dict[str, Any]]:
    """Every rank file in ``directory`` (``*.rank<N>.json``), parsed, sorted by name.
    Only regular files are read (a link, FIFO or device is skipped with a warning, as
    is a file over ``max_file_bytes``); each is checked (:func:`check_trace`)."""
    root = Path(directory)
    if not root.is_dir():
        raise TraceError(f"{root}: not a directory")
    docs = []
    for path in sorted(root.iterdir()):
        if not RANK_FILE.match(path.name):
            continue
        where = str(path)
        data = _read_regular(path, max_file_bytes)
        if data is None:
            continue
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise TraceError(f"{where}: not a readable trace file: {e}") from None
        doc = check_trace(doc, where)
        doc["otherData"].setdefault("file", path.name)
        docs.append(doc)
    if not docs:
        raise TraceError(f"{root}: no trace files (*.rank<N>.json); save or load with trace={str(root)!r}")
    return docs


def write_merged(path: str | Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON to ``path`` without following a link planted there: into a
    fresh temporary file beside it (O_CREAT | O_EXCL | O_NOFOLLOW), then renamed over
    ``path`` (a rename replaces a link, never writes through it)."""
    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        raise TraceError(f"{target}: is a directory; name a file for the merged timeline")
    data = json.dumps(doc).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, flags, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


Resource = Literal["disk", "network"]

#: stage -> (what it moves bytes through, direction): "storage" is where the checkpoint
#: is (a local path: the disk; anything else: the network to the store); "network" the
#: network between ranks (gloo: shared reads, the local tier's peer exchange)
MEASURED_STAGES: dict[str, tuple[str, str]] = {
    "write": ("storage", "write"),
    "fetch": ("storage", "read"),
    "exchange": ("network", "read"),
}


@dataclasses.dataclass(frozen=True)
class Speeds:
    """Measured speeds in GB/s (10^9 bytes/s) of one host's disk and network, each
    ``(write, read)``; None: not known."""

    disk: tuple[float, float] | None = None
    network: tuple[float, float] | None = None

    def of(self, resource: Resource, direction: str) -> float | None:
        pair = self.disk if resource == "disk" else self.network
        if pair is None:
            return None
        return pair[0] if direction == "write" else pair[1]


def storage_kind(uri: str) -> Resource | None:
    """What a checkpoint at ``uri`` is moved through: "disk" (a local path), "network"
    (an object store, HDFS, ...), None (``memory://``: neither)."""
    scheme, _ = split_scheme(uri)
    if scheme == "file":
        return "disk"
    return None if scheme == "memory" else "network"


@dataclasses.dataclass(frozen=True)
class Against:
    """One stage against the measured speed of what it used, on its slowest host."""

    resource: Resource
    direction: str
    #: the measured speed, GB/s
    speed_gbps: float
    host: str
    #: the host's ranks' bytes in the stage, and the seconds any of them was in it
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def share(self) -> float:
        """The host's GB/s in the stage as a fraction of the measured speed."""
        return self.gbps / self.speed_gbps

    @property
    def at_speed_seconds(self) -> float:
        """How long the host's bytes take at the measured speed."""
        return self.nbytes / (self.speed_gbps * 1e9)


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
    #: the stage against the measured speed of what it moves bytes through (speeds given)
    against: Against | None = None

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
    docs: Sequence[dict[str, Any]],
    *,
    straggler_pct: float = 20.0,
    min_seconds: float = 0.001,
    speeds: Speeds | None = None,
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
            against = _against(members, name, speeds) if speeds is not None and nbytes else None
            stages.append(
                StageSummary(
                    name, counts[name], nbytes, per_rank, stragglers(per_rank, straggler_pct, min_seconds), against
                )
            )
        whole = next((s for s in stages if s.stage == kind), None)
        seconds = whole.slowest[1] if whole is not None else 0.0
        out.append(OperationSummary(kind, label, tuple(sorted(totals)), seconds, tuple(stages)))
    return out


def _against(docs: Sequence[dict[str, Any]], stage: str, speeds: Speeds) -> Against | None:
    """``stage`` of one operation's rank files against its measured speed (None: not a
    measured stage, or its speed is not known)."""
    if stage not in MEASURED_STAGES:
        return None
    via, direction = MEASURED_STAGES[stage]
    resource: Resource | None = "network"
    if via == "storage":
        uri = str(docs[0].get("otherData", {}).get("uri", ""))
        resource = storage_kind(uri) if uri else None
    speed = speeds.of(resource, direction) if resource is not None else None
    if resource is None or speed is None or speed <= 0:
        return None
    events: dict[str, list[dict[str, Any]]] = {}  # host -> its ranks' spans of the stage
    for doc in docs:
        other = doc.get("otherData", {})
        host = str(other.get("host") or f"rank {other.get('rank', 0)}")
        events.setdefault(host, []).extend(e for e in doc["traceEvents"] if e.get("name") == stage)
    totals = {host: stage_totals(evs)[stage] for host, evs in events.items() if any(e.get("ph") == "X" for e in evs)}
    host = max(totals, key=lambda h: (totals[h].seconds, h))
    return Against(resource, direction, speed, host, totals[host].nbytes, totals[host].seconds)


def stragglers(per_rank: dict[int, float], pct: float, min_seconds: float = 0.0) -> tuple[int, ...]:
    """The ranks more than ``pct`` percent (and ``min_seconds``) over the median; none for one rank."""
    if len(per_rank) < 2:
        return ()
    median = statistics.median(per_rank.values())
    limit = max(median * (1 + pct / 100), median + min_seconds)
    return tuple(r for r, s in sorted(per_rank.items()) if s > limit)
