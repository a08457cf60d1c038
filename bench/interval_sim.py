"""``interval="auto"`` against fixed intervals, on simulated failure traces.

Each trace is a run of ``--failures`` failures (its duration ends at the last one) of a
job of one model size:

* failures: Poisson (exponential gaps), bursty Weibull gaps (shape 0.6: failures come
  in clusters) and a two-state process (calm, and storms with failures ten times as
  often, each failure keeping the state with probability 0.8), with a mean time between
  failures (MTBF) from 10 minutes to 10 hours;
* costs from bcp's own numbers: the script saves a small state through a
  ``CheckpointManager(async_save=True, metrics=...)`` and loads it back, and scales the
  ``MetricsRecord`` figures (blocking seconds, commit seconds, load seconds per byte) to
  each model's per-rank bytes; a recovery adds a fixed restart time (``--restart``) to the
  load. The step times per size are assumptions of the table (printed).

In a gap between failures the job first recovers (a failure during it starts it again),
then trains and saves; a save kept training waiting its blocking time (and for the
previous save's commit when that was still running) and counts only once committed. A
failure loses the work since the last committed save. Waste: the share of the run's
wall time that was not kept training.

``auto`` is ``bcp.schedule.interval.IntervalPolicy`` observing the run as it goes: the
step time and each save's cost, agreed at each save as the manager does; after each
failure a new policy (a restarted process) starts from the estimates the newest
manifest kept and the failure history the root's restart record gives, so it learns the
MTBF from the failures it sees (``--mtbf-given``: the true MTBF is given instead). The
fixed intervals are searched on a grid per trace (the best one knows the trace); the
defaults are every 100, 500 and 1,000 steps. The last line is

    interval_sim: auto within <p>% of the best fixed interval over <n> traces, worst <q>%

where p is the mean and q the largest of (auto's waste / the best fixed waste - 1).
Targets: p <= 5, q <= 10, each default 2x worse than the best somewhere. Deterministic
(seeded traces; costs measured unless `--costs`); about 20 s.

    python bench/interval_sim.py [--failures 400] [--seed 0] [--method exact|young] [--mtbf-given] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import bcp
from bcp.schedule.interval import IntervalPolicy

MTBFS = (600.0, 1800.0, 3600.0, 3 * 3600.0, 10 * 3600.0)
KINDS = ("poisson", "weibull", "two-state")
#: per-rank checkpoint bytes and the step time assumed for each model size
SIZES = {
    "tiny": (256 << 20, 0.25),
    "small": (2 << 30, 0.5),
    "medium": (16 << 30, 2.0),
    "large": (64 << 30, 6.0),
}
DEFAULTS = (100, 500, 1000)


@dataclasses.dataclass(frozen=True)
class Costs:
    """One model size's costs, in seconds: a save's blocking, its commit lag, a recovery."""

    step: float
    blocking: float
    lag: float
    recovery: float


def measure(nbytes: int = 16 << 20, saves: int = 5) -> tuple[float, float, float]:
    """Seconds per byte of bcp's async save (blocking, to its commit) and of a load, from
    the manager's ``MetricsRecord`` of real saves and loads: medians of ``saves`` (after
    a first save that warms the staging memory), each save committed before the next."""
    records: list[bcp.MetricsRecord] = []
    state = {"w": torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        with bcp.CheckpointManager(root, async_save=True, keep_last=2, metrics=records.append) as manager:
            for step in range(saves + 1):
                manager.save(step, state)
                manager.wait()
        for _ in range(3):
            bcp.CheckpointManager(root, metrics=records.append).load_latest({"w": torch.zeros(nbytes // 4)})
    save = [r for r in records if r.kind == "save"][1:]
    load = [r for r in records if r.kind == "load"]
    return (
        statistics.median(r.blocking_seconds / r.bytes for r in save),
        statistics.median(r.total_seconds / r.bytes for r in save),
        statistics.median(r.total_seconds / r.bytes for r in load),
    )


def gaps_of(kind: str, mtbf: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` times between failures with mean ``mtbf``."""
    if kind == "poisson":
        return rng.exponential(mtbf, n)
    if kind == "weibull":
        shape = 0.6
        return rng.weibull(shape, n) * mtbf / math.gamma(1 + 1 / shape)
    # two states with equal stationary shares; storms' failures 10x as frequent
    calm = mtbf / 0.55
    out, storm = np.empty(n), False
    for i in range(n):
        out[i] = rng.exponential(calm * 0.1 if storm else calm)
        if rng.random() > 0.8:
            storm = not storm
    return out


def fixed_waste(gaps: np.ndarray, steps: int, c: Costs) -> float:
    """Waste of saving every ``steps`` steps (closed form per gap)."""
    work = steps * c.step
    period = work + c.blocking + max(0.0, c.lag - work)
    avail = gaps - c.recovery
    committed = np.floor(np.maximum(avail - c.lag, 0.0) / period)
    committed = np.where(avail > 0, committed, 0.0)
    return 1.0 - float((committed * work).sum()) / float(gaps.sum())


def auto_waste(gaps: np.ndarray, c: Costs, method: str, mtbf_given: float | None) -> float:
    """Waste of ``IntervalPolicy`` deciding as it goes (one policy per process lifetime)."""
    kept_work, elapsed, snapshot = 0.0, 0.0, None
    for index, gap in enumerate(gaps):
        policy = IntervalPolicy(mtbf_seconds=mtbf_given, method=method)  # type: ignore[arg-type]
        if snapshot is not None:
            policy.seed(snapshot)
            policy.observe_recovery(c.recovery)
        if index and mtbf_given is None:
            policy.observe_restart(elapsed, count=index, source="simulated restarts")
        policy.agree()
        avail = gap - (c.recovery if index else 0.0)
        if snapshot is not None:
            policy.mark_saved("persistent", 0)
        t, step, prev_commit, committed = 0.0, 0, -math.inf, 0
        while avail > 0:
            n = max(1, policy.next_save_step(step) - step)
            start = t + n * c.step
            wait = max(0.0, prev_commit - start)
            end = start + wait + c.blocking
            if end > avail:
                break
            step += n
            policy.observe_step(n * c.step, n)
            policy.observe_save("persistent", wait + c.blocking, total_seconds=wait + c.blocking + c.lag, step=step)
            policy.agree()
            t, prev_commit = end, end + c.lag
            if prev_commit <= avail:
                committed = step
        kept_work += committed * c.step
        elapsed += gap
        snapshot = policy.snapshot()
    return 1.0 - kept_work / elapsed


def best_fixed(gaps: np.ndarray, c: Costs) -> tuple[int, float]:
    """The grid's best fixed interval: geometric steps of 4%, then every step near the best."""
    grid = sorted({max(1, round(1.04**i)) for i in range(400)})
    wastes = [fixed_waste(gaps, n, c) for n in grid]
    i = int(np.argmin(wastes))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    stride = max(1, (hi - lo) // 200)
    return min(((n, fixed_waste(gaps, n, c)) for n in range(lo, hi + 1, stride)), key=lambda x: x[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=400, help="failures per trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=("exact", "young"), default="exact")
    parser.add_argument("--mtbf-given", action="store_true", help="give the policy the true MTBF")
    parser.add_argument("--restart", type=float, default=30.0, help="seconds a restart costs besides the load")
    parser.add_argument(
        "--costs", default=None, help="BLOCKING,COMMIT,LOAD seconds per GiB instead of measuring (to repeat a table)"
    )
    parser.add_argument("--quick", action="store_true", help="one size, Poisson and Weibull, three MTBFs (tests)")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.costs:
        blocking, total, load = (float(x) / (1 << 30) for x in args.costs.split(","))
        where = "given"
    else:
        blocking, total, load = measure()
        where = "measured: async saves through a CheckpointManager's metrics, medians"
    print(
        f"bcp costs ({where}): blocking {blocking * (1 << 30):.3f} s/GiB, "
        f"commit {total * (1 << 30):.3f} s/GiB, load {load * (1 << 30):.3f} s/GiB; restart +{args.restart:g} s"
    )
    sizes = {"small": SIZES["small"]} if args.quick else SIZES
    kinds = KINDS[:2] if args.quick else KINDS
    mtbfs = (MTBFS[0], MTBFS[2], MTBFS[4]) if args.quick else MTBFS
    other = "young" if args.method == "exact" else "exact"
    print(
        f"{'size':<7} {'trace':<9} {'MTBF':>6} {'C s':>6} {'lag s':>6} {'R s':>6} {'step s':>6} "
        f"{'best n':>7} {'best %':>7} {'auto %':>7} {'auto/best':>9} {other + '/best':>10} "
        + " ".join(f"{'every ' + str(d):>10}" for d in DEFAULTS)
    )
    ratios, others, default_worst = [], [], dict.fromkeys(DEFAULTS, 0.0)
    rng = np.random.default_rng(args.seed)
    for size, (nbytes, step) in sizes.items():
        c = Costs(step, blocking * nbytes, (total - blocking) * nbytes, args.restart + load * nbytes)
        for kind in kinds:
            for mtbf in mtbfs:
                gaps = gaps_of(kind, mtbf, args.failures, rng)
                n_best, w_best = best_fixed(gaps, c)
                given = mtbf if args.mtbf_given else None
                w_auto = auto_waste(gaps, c, args.method, given)
                w_other = auto_waste(gaps, c, other, given)
                ratio = w_auto / w_best - 1.0
                ratios.append(ratio)
                others.append(w_other / w_best - 1.0)
                fixed = {d: fixed_waste(gaps, d, c) for d in DEFAULTS}
                for d, w in fixed.items():
                    default_worst[d] = max(default_worst[d], w / w_best)
                print(
                    f"{size:<7} {kind:<9} {mtbf / 3600:>5.2g}h {c.blocking:>6.2f} {c.lag:>6.2f} {c.recovery:>6.1f} "
                    f"{step:>6.2g} {n_best:>7d} {100 * w_best:>6.2f}% {100 * w_auto:>6.2f}% {ratio + 1:>9.3f} "
                    f"{w_other / w_best:>10.3f} " + " ".join(f"{fixed[d] / w_best:>9.2f}x" for d in DEFAULTS)
                )
    for d in DEFAULTS:
        print(f"fixed every {d} steps: worst {default_worst[d]:.1f}x the best fixed waste")
    print(f"({time.perf_counter() - started:.1f} s; waste: share of wall time lost; auto/best: waste ratio)")
    print(
        f"the other model ({other}) would be within {100 * sum(others) / len(others):.1f}% on average, "
        f"worst {100 * max(others):.1f}%"
    )
    mean, worst = 100 * sum(ratios) / len(ratios), 100 * max(ratios)
    print(
        f"interval_sim: auto within {mean:.1f}% of the best fixed interval over {len(ratios)} traces, "
        f"worst {worst:.1f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
