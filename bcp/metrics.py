"""One record per checkpoint save and load, for ``CheckpointManager(metrics=callback)``.

The manager calls the callback once per save (when it completes: at once for a
synchronous save, at ``wait()`` / the next save for an async one) and once per
``load_latest`` that loaded a step. The per-stage GB/s come from the stage totals
the trace recorder keeps (``bcp.trace``): the manager records every save and load
in memory when it has a callback (``trace=True`` unless the call names a directory),
which costs what tracing costs (docs/observability.md). Two ready callbacks:
:class:`TensorBoardMetrics` (a ``torch.utils.tensorboard.SummaryWriter``) and
:class:`LoggingMetrics` (one line through ``logging``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

from bcp.trace import StageTotal

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MetricsRecord:
    """What one save or load of a manager cost (this rank's view)."""

    step: int
    kind: Literal["save", "load"]
    #: seconds the call kept the caller waiting (an async save: its staging only)
    blocking_seconds: float
    #: seconds from the call to the end (an async save: to its commit)
    total_seconds: float
    #: bytes this rank wrote (save) or read (load)
    bytes: int
    #: stage -> GB/s of the bytes it moved while active (stages that moved bytes)
    gbps: Mapping[str, float]
    #: attempts retried by the storage backends in this process meanwhile
    retries: int
    #: where the step went or came from: the root ("persistent") or the local tier ("local")
    tier: Literal["persistent", "local"] = "persistent"

    @property
    def overall_gbps(self) -> float:
        return self.bytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0


#: what ``CheckpointManager(metrics=...)`` takes
MetricsCallback = Callable[[MetricsRecord], Any]


def stage_gbps(stages: Mapping[str, StageTotal]) -> Mapping[str, float]:
    """The stages that moved bytes, with their GB/s."""
    return MappingProxyType({name: round(t.gbps, 4) for name, t in stages.items() if t.nbytes})


class LoggingMetrics:
    """A callback that logs each record as one line (``logger``, default ``bcp.metrics``, at ``level``)."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger or log
        self.level = level

    def __call__(self, record: MetricsRecord) -> None:
        stages = " ".join(f"{name}={gbps:.2f}" for name, gbps in record.gbps.items())
        self.logger.log(
            self.level,
            "checkpoint %s step %d (%s): %.3f s blocking, %.3f s total, %d bytes, %.2f GB/s; "
            "stage GB/s: %s; retries %d",
            record.kind,
            record.step,
            record.tier,
            record.blocking_seconds,
            record.total_seconds,
            record.bytes,
            record.overall_gbps,
            stages or "-",
            record.retries,
        )


class TensorBoardMetrics:
    """A callback that writes each record's numbers as scalars of a
    ``torch.utils.tensorboard.SummaryWriter`` (tags ``<prefix>/<kind>/<name>``, at the record's step)."""

    def __init__(self, writer: Any, prefix: str = "checkpoint") -> None:
        self.writer = writer
        self.prefix = prefix

    def __call__(self, record: MetricsRecord) -> None:
        tag = f"{self.prefix}/{record.kind}"
        scalars = {
            "blocking_seconds": record.blocking_seconds,
            "total_seconds": record.total_seconds,
            "bytes": float(record.bytes),
            "gbps": record.overall_gbps,
            "retries": float(record.retries),
            **{f"gbps/{stage}": value for stage, value in record.gbps.items()},
        }
        for name, value in scalars.items():
            self.writer.add_scalar(f"{tag}/{name}", value, record.step)
