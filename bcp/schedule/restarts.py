"""The restarts a manager's root has seen: ``ROOT/.bcp-restarts.json``, for learning the
failure rate when ``mtbf_seconds`` is not given (docs/manager.md, "Interval").

The coordinator of every ``CheckpointManager(interval="auto")`` appends the time it
started (Unix seconds) when it starts; the times since the first are the run's life, the
starts after the first its restarts. The file is read as hostile: at most
:data:`MAX_BYTES` bytes, a JSON object of this format and version, at most
:data:`MAX_STARTS` finite times in order, none before 2000 nor after tomorrow. Anything
else is refused (a WARNING) and the record starts again from this start; a record that
cannot be written costs a WARNING, never the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

from bcp.backends import Backend
from bcp.backends.storage_errors import ObjectNotFoundError

log = logging.getLogger(__name__)

KEY = ".bcp-restarts.json"
FORMAT = "bcp-restarts"
#: starts kept (the oldest go first); a record of this many is about 5 KiB
MAX_STARTS = 256
#: a record larger than this is not read
MAX_BYTES = 16 << 10
#: 2000-01-01T00:00:00Z: no start is older
EARLIEST = 946_684_800.0
#: a start up to a day in the future is a skewed clock; later ones are refused
CLOCK_SKEW = 86_400.0


@dataclasses.dataclass(frozen=True)
class Restarts:
    """The starts recorded under a root, oldest first, this one last."""

    starts: tuple[float, ...]

    @property
    def restarts(self) -> int:
        """Starts after the first: each followed a stop, a failure as far as bcp knows."""
        return max(0, len(self.starts) - 1)

    @property
    def exposure_seconds(self) -> float:
        """Seconds from the first recorded start to the last (the run's life before this start)."""
        return self.starts[-1] - self.starts[0] if len(self.starts) > 1 else 0.0


def encode(starts: tuple[float, ...]) -> bytes:
    return json.dumps({"format": FORMAT, "version": 1, "starts": [round(t, 3) for t in starts]}).encode()


def decode(data: bytes, now: float) -> tuple[float, ...]:
    """The start times in a record's bytes; ValueError (saying what is wrong) unless they
    are what :func:`encode` writes, with times in the sane range."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{len(data)} bytes, more than {MAX_BYTES}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != 1:
        raise ValueError(f"not a {FORMAT} record of version 1")
    starts = doc.get("starts")
    if not isinstance(starts, list) or len(starts) > MAX_STARTS:
        raise ValueError(f"'starts' is not a list of at most {MAX_STARTS} times")
    out: list[float] = []
    for t in starts:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"'starts' holds {t!r}, not a time")
        if not EARLIEST <= t <= now + CLOCK_SKEW:
            raise ValueError(f"'starts' holds {t}, outside 2000-01-01 .. now")
        if out and t < out[-1]:
            raise ValueError("'starts' is not in order")
        out.append(float(t))
    return tuple(out)


def read(backend: Backend, now: float) -> tuple[float, ...]:
    """The starts recorded under ``backend``: () when there is no record; ValueError when
    it is there but refused."""
    try:
        size = backend.size(KEY)
    except (FileNotFoundError, ObjectNotFoundError):
        return ()
    if size > MAX_BYTES:
        raise ValueError(f"{size} bytes, more than {MAX_BYTES}")
    return decode(backend.read(KEY, 0, size), now)


def record_start(backend: Backend, now: float) -> Restarts:
    """(the coordinator) Append ``now`` to the record under ``backend`` and return it.
    A refused record is replaced (WARNING naming it and why); an unwritable one is a
    WARNING. A start before the last recorded one (a clock gone back) is recorded as the
    last one's time."""
    try:
        starts = read(backend, now)
    except ValueError as e:
        log.warning("ignoring %s/%s (%s): the failure rate is learned afresh", backend.uri, KEY, e)
        starts = ()
    except OSError as e:
        log.warning("could not read %s/%s (%s): the failure rate is learned afresh", backend.uri, KEY, e)
        starts = ()
    this = max(now, starts[-1]) if starts else now
    starts = (*starts, this)[-MAX_STARTS:]
    try:
        backend.write(KEY, encode(starts))
    except Exception as e:  # noqa: BLE001 - a record for the interval, never a reason to stop
        log.warning("could not write %s/%s: %s", backend.uri, KEY, e)
    return Restarts(starts)
