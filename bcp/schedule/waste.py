"""The cost model of checkpointing under failures, and the interval that wastes the least.

One tier: training saves every ``T`` seconds of work; a save keeps the training loop
waiting ``C`` seconds (its blocking cost) and is committed ``L`` seconds after that (an
async save's background write: the commit lag); failures arrive at rate ``1/M``; a
failure costs the work since the last *committed* save plus ``R`` seconds of recovery
(restart and load). Two forms of the expected waste, as a fraction of wall time:

* first order (Young): ``C/T + (T/2 + L + R)/M``, minimised at ``T* = sqrt(2 C M)``;
* exact for exponential (Poisson) failures (Daly): a segment of ``T`` work and its save
  takes ``E(T) = M e^(R/M) (e^((T+C)/M) - 1)`` seconds on average, failures during a
  recovery included, so the waste is ``1 - T/E(T)``, plus ``L/M`` for the commit lag.

A save started before the previous one committed waits for it: the cost of a save is
``C + max(0, L - T)`` (what the manager's ``save`` waits for). ``optimal_seconds``
minimises the exact form numerically (golden section on log T); ``bench/interval_sim.py``
compares both forms on failure traces and the exact one is the default
(docs/manager.md, "Interval").

Two tiers (a local tier drained to the persistent one): a share ``q`` of the failures
loses a host's local copies (more hosts than the replicas cover) and falls back to the
persistent tier; the rest recover from the local one. The waste is the sum of each
tier's, with failure rates ``(1 - q)/M`` and ``q/M``: each tier's interval is chosen for
its own rate, the persistent one a multiple of the local one (drains copy local steps).
"""

from __future__ import annotations

import math
from typing import Literal

#: how the optimum is found: the exact exponential model, or Young's first-order formula
Method = Literal["exact", "young"]

#: the golden ratio's conjugate, for the golden-section search
_PHI = (math.sqrt(5) - 1) / 2


def waste_fraction(
    interval: float, cost: float, recovery: float, mtbf: float, lag: float = 0.0, method: Method = "exact"
) -> float:
    """Expected share of wall time lost to saves, lost work and recoveries, at one
    save every ``interval`` seconds of work. All arguments in seconds, ``interval`` and
    ``mtbf`` > 0. Capped at 1 (nothing is left for training)."""
    value = _objective(interval, cost, recovery, mtbf, lag, method)
    return min(1.0, max(0.0, value + 1.0 + lag / mtbf if method == "exact" else value))


def _objective(interval: float, cost: float, recovery: float, mtbf: float, lag: float, method: Method) -> float:
    """The waste without the cap at 1, so that it still has one minimum where every
    interval wastes everything (saves dearer than the failures allow): the search and
    the choice of steps minimise this. The exact form is returned less 1 (``-T/E``):
    ``1 - T/E`` would round away the differences when ``T/E`` is tiny."""
    if interval <= 0 or mtbf <= 0:
        raise ValueError(f"interval and mtbf must be > 0, got {interval} and {mtbf}")
    effective = cost + max(0.0, lag - interval)
    if method == "young":
        return effective / interval + (interval / 2 + lag + recovery) / mtbf
    exponent = (interval + effective + recovery) / mtbf
    if exponent > 700:  # e^exponent overflows: log-space, increasing with the exponent
        return exponent - math.log(interval / mtbf)
    expected = mtbf * math.exp(recovery / mtbf) * math.expm1((interval + effective) / mtbf)
    return -interval / expected


def young_seconds(cost: float, mtbf: float) -> float:
    """Young's first-order optimum, ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * max(cost, 0.0) * mtbf)


def optimal_seconds(cost: float, recovery: float, mtbf: float, lag: float = 0.0, method: Method = "exact") -> float:
    """The interval (seconds of work between saves) that minimises :func:`waste_fraction`."""
    if method == "young" and lag <= 0:
        return max(young_seconds(cost, mtbf), 1e-6)
    lo, hi = math.log(1e-6 + cost * 1e-3), math.log(50.0 * mtbf + lag)

    def f(x: float) -> float:
        return _objective(math.exp(x), cost, recovery, mtbf, lag, method)

    a, b = lo, hi
    c, d = b - _PHI * (b - a), a + _PHI * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(80):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _PHI * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _PHI * (b - a)
            fd = f(d)
        if b - a < 1e-6:
            break
    return math.exp((a + b) / 2)


def best_steps(
    step_seconds: float,
    cost: float,
    recovery: float,
    mtbf: float,
    lag: float = 0.0,
    method: Method = "exact",
    *,
    multiple_of: int = 1,
    max_steps: int = 10**9,
) -> int:
    """The interval in steps (a multiple of ``multiple_of``, at most ``max_steps``) whose
    waste is no larger than its neighbours': the continuous optimum rounded, then moved
    one multiple at a time while a neighbour wastes less."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    unit = max(1, multiple_of)
    top = max(1, max_steps // unit)

    def w(k: int) -> float:
        return _objective(k * unit * step_seconds, cost, recovery, mtbf, lag, method)

    guess = optimal_seconds(cost, recovery, mtbf, lag, method) / (unit * step_seconds)
    k = min(top, max(1, int(guess)))
    if k + 1 <= top and w(k + 1) < w(k):
        k += 1
    while k + 1 <= top and w(k + 1) < w(k):
        k += 1
    while k > 1 and w(k - 1) < w(k):
        k -= 1
    return k * unit
