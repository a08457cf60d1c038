"""What a caller hands :class:`bcp.CheckpointManager`, checked before anything is
saved: the step number (a directory name, a sort key) and the metrics stored beside
it in the manifest for ``keep_best`` and for people."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping

log = logging.getLogger("bcp.manager")


def checked_step(step: object) -> int:
    """``step`` as an int: a non-negative integer (a numpy one too), not a bool or a
    float that merely holds one (``2.0`` is a mistake about what is passed, refused)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise TypeError(f"CheckpointManager: a step is a non-negative int, not {step!r} ({type(step).__name__})")
    return int(step)


def stored_metrics(metrics: Mapping[str, object] | None, step: int) -> dict[str, float | str]:
    """The metrics as the manifest keeps them: finite numbers as floats; NaN and the
    infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers,
    and a diverging loss must not stop a job from checkpointing), which ``keep_best``
    ignores with a WARNING. Anything not a number is refused, naming it."""
    stored: dict[str, float | str] = {}
    for name, value in (metrics or {}).items():
        number = None
        if not isinstance(value, bool | str | bytes):
            try:
                number = float(value)  # type: ignore[arg-type]  # a number, a numpy scalar, a 1-element tensor
            except (TypeError, ValueError, RuntimeError):
                pass
        if number is None:
            raise TypeError(f"CheckpointManager: metric {name!r} of step {step} is {value!r:.60}, not a number")
        if not math.isfinite(number):
            log.warning("step %d: metric %r is %s; stored as text, keep_best ignores it", step, name, number)
        stored[str(name)] = number if math.isfinite(number) else str(number)
    return stored
