"""Timelines of saves and loads, one Chrome trace (Perfetto) JSON file per rank.

A save or load with ``trace=DIR`` (or with the environment variable ``BCP_TRACE_DIR``
set) opens a :class:`Session` when it starts and writes ``DIR/<kind>-<id>.rank<N>.json``
when it ends: "X" (complete) events with ``ts``/``dur`` in microseconds of wall-clock
time (so the ranks' files line up), ``pid`` the rank, ``tid`` the thread, ``args``
with the bytes a span moved and its GB/s. ``trace=True`` records the same spans
without a file: the stage totals come back in ``SaveInfo.stages`` /
``LoadInfo.stages`` (``CheckpointManager(metrics=...)`` uses that).

The engine marks its stages with :func:`span`. With no session open it returns one
shared no-op context manager after a single module-level ``None`` check: no clock
read, no allocation. A span is recorded into every session open in the process
(an async save writing in the background while a load runs appears in both).
``bcp trace DIR`` (``bcp.trace_report``) merges the files and summarises them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: a directory every save and load of the process traces into (jobs that cannot be edited)
ENV = "BCP_TRACE_DIR"

#: a trace option: a directory (write a file there), True (record, no file) or None/False (off)
TraceOption = str | os.PathLike | bool | None

_lock = threading.Lock()
#: the sessions open in this process; None when there is none (the fast path's one check)
_active: tuple[Session, ...] | None = None
_serial = itertools.count()


class _Null:
    """The span returned while nothing records: enter and exit do nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL = _Null()


class Span:
    """One timed region, recorded into every open session when it exits."""

    __slots__ = ("name", "nbytes", "start")

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self.start = 0

    def __enter__(self) -> Span:
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        record(self.name, self.start, time.perf_counter_ns(), self.nbytes)


def span(name: str, nbytes: int = 0) -> Span | _Null:
    """``with span("write", n):`` times the block as stage ``name`` moving ``n`` bytes
    (set ``.nbytes`` inside the block when it is known only there). Off: :data:`NULL`."""
    if _active is None:
        return NULL
    return Span(name, nbytes)


def enabled() -> bool:
    return _active is not None


def record(name: str, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
    """Record a span measured elsewhere (``time.perf_counter_ns`` values)."""
    sessions = _active
    if sessions is None:
        return
    thread = threading.current_thread()
    for session in sessions:
        session.add(name, start_ns, end_ns, nbytes, thread)


def directory_of(option: TraceOption) -> TraceOption:
    """The option, or ``$BCP_TRACE_DIR`` when the call gave none (False: off, whatever the environment)."""
    if option is None:
        return os.environ.get(ENV) or None
    return option


def host_name() -> str:
    """The host a trace file says its rank ran on: ``BCP_HOST_ID`` when set, else the
    host name (as the local tier names hosts; ``bcp trace`` adds up a host's ranks)."""
    return os.environ.get("BCP_HOST_ID") or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class StageTotal:
    """One stage on one rank: seconds it was active (overlapping spans counted once) and bytes moved."""

    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 and self.nbytes else 0.0


def active_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def stage_totals(events: list[dict[str, Any]]) -> dict[str, StageTotal]:
    """Per stage name: the union of its spans' time and the sum of their bytes (one rank's "X" events)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    nbytes: dict[str, int] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
        nbytes[e["name"]] = nbytes.get(e["name"], 0) + int(e.get("args", {}).get("bytes", 0))
    return {name: StageTotal(active_seconds(iv) / 1e6, nbytes[name]) for name, iv in spans.items()}


class Session:
    """The spans of one save or load on one rank, from :func:`begin` to :meth:`end`."""

    def __init__(self, directory: Path | None, rank: int, kind: str) -> None:
        self.directory, self.rank, self.kind = directory, rank, kind
        #: the file's name part that the ranks share (a save's id; set once known)
        self.label = ""
        self.start = time.perf_counter_ns()
        #: wall-clock ns minus perf_counter ns: timestamps comparable across processes
        self.offset = time.time_ns() - self.start
        self.events: list[dict[str, Any]] = []
        self.threads: dict[int, str] = {}
        self.path: Path | None = None

    def add(self, name: str, start_ns: int, end_ns: int, nbytes: int, thread: threading.Thread) -> None:
        tid = thread.ident or 0
        if tid not in self.threads:
            self.threads[tid] = thread.name
        dur = max(end_ns - start_ns, 0)
        args: dict[str, Any] = {}
        if nbytes:
            args = {"bytes": nbytes, "GB/s": round(nbytes / dur, 3) if dur else 0.0}
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "ts": (start_ns + self.offset) / 1000,
                "dur": dur / 1000,
                "pid": self.rank,
                "tid": tid,
                "args": args,
            }
        )

    def document(self, **other: Any) -> dict[str, Any]:
        """The Chrome trace document: the spans, then the rank's and threads' names."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
            for tid, name in self.threads.items()
        ]
        info = {"rank": self.rank, "host": host_name(), "kind": self.kind, "label": self.label, **other}
        return {"traceEvents": self.events + meta, "displayTimeUnit": "ms", "otherData": info}

    def totals(self) -> dict[str, StageTotal]:
        return stage_totals(self.events)

    def end(self, nbytes: int = 0, **other: Any) -> dict[str, StageTotal]:
        """Close the session: record its whole span (``kind``), write the file when it
        has a directory, return the stage totals. A failure to write is logged, never raised."""
        record(self.kind, self.start, time.perf_counter_ns(), nbytes)
        self._close()
        if self.directory is not None:
            self.path = self._write(other)
        return self.totals()

    def cancel(self) -> None:
        """Close the session without a file: it turned out to be no operation (a
        recovery that found no local step)."""
        self._close()

    def _close(self) -> None:
        global _active
        with _lock:
            rest = tuple(s for s in _active or () if s is not self)
            _active = rest or None

    def _write(self, other: Mapping[str, Any]) -> Path | None:
        import logging

        label = self.label or f"{os.getpid()}-{next(_serial)}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            path = self.directory / f"{self.kind}-{label}.rank{self.rank}.json"  # type: ignore[operator]
            for n in itertools.count(1):
                if not path.exists():
                    break
                path = path.with_name(f"{self.kind}-{label}-{n}.rank{self.rank}.json")
            path.write_text(json.dumps(self.document(**other)))
            return path
        except OSError as e:
            log = logging.getLogger(__name__)
            log.warning("could not write the trace of rank %d to %s: %s", self.rank, self.directory, e)
            return None


def begin(option: TraceOption, rank: int, kind: str) -> Session | None:
    """Open a session for a ``kind`` ("save"/"load") when ``option`` (or ``$BCP_TRACE_DIR``) asks for one."""
    global _active
    where = directory_of(option)
    if where is None or where is False:
        return None
    session = Session(None if where is True else Path(os.fspath(where)), rank, kind)
    with _lock:
        _active = (*(_active or ()), session)
    return session
