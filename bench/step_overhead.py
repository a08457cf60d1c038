"""What ``CheckpointManager.step`` costs a training step when nothing is due and no notice came.

    .venv/bin/python bench/step_overhead.py [--worlds 1,2,4] [--calls 2000]

For each world size, one gloo job on this machine (loopback; ranks from bench/ranks.py's
fork server, torch imported once) whose every rank makes a
manager with ``interval=None`` (never due) twice, with preemption on (one all-reduce of
four numbers per call on bcp's own group) and off (no collective), and times each of
``--calls`` calls of ``step()`` after a warm-up; then the same all-reduce alone on the
job's group (what the machine's loopback and scheduling cost, whoever calls it). Each rank's median; the table shows the
largest rank's median in microseconds. The last line sums it up (target: under 1 ms with
preemption on; about nothing off).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from ranks import gloo_rank, run_ranks


def _rank(rank: int, world: int, port: int, root: str, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    gloo_rank(rank, world, out, lambda: _medians(world, root, calls))


def _medians(world: int, root: str, calls: int) -> dict[str, float]:
    """(in a rank of the gloo group) This rank's medians of step() on and off, and of the bare all-reduce."""
    import torch
    import torch.distributed as dist

    import bcp

    state = {"w": torch.zeros(4)}
    medians = {}
    for label, preemption in (("on", bcp.Preemption()), ("off", None)):
        manager = bcp.CheckpointManager(os.path.join(root, label), preemption=preemption, interval=None)
        for s in range(100):  # warm-up
            manager.step(s, state)
        times = []
        for s in range(calls):
            t0 = time.perf_counter_ns()
            stop = manager.step(s, state)
            times.append(time.perf_counter_ns() - t0)
            assert not stop
        manager.close()
        medians[label] = statistics.median(times) / 1e3
    flags = torch.zeros(4, dtype=torch.float64)  # the same collective, bare: what the machine's loopback costs
    for _ in range(100):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        times.append(time.perf_counter_ns() - t0)
    medians["bare"] = statistics.median(times) / 1e3
    everyone: list = [None] * world
    dist.all_gather_object(everyone, medians)
    return {k: max(m[k] for m in everyone) for k in medians}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4", help="gloo world sizes, comma-separated")
    p.add_argument("--calls", type=int, default=2000, help="timed calls of step() per rank and setting")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each job may take")
    args = p.parse_args()
    print(f"medians of {args.calls} calls; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bcp-step-") as work:
        for world in (int(w) for w in args.worlds.split(",") if w.strip()):
            out = os.path.join(work, f"{world}.json")
            root = os.path.join(work, f"ck{world}")
            port = free_port()
            run_ranks(
                _rank,
                lambda r, world=world, port=port, out=out, root=root: (r, world, port, root, args.calls, out),
                world,
                args.timeout,
                f"step_overhead: the job on {world} ranks",
            )
            results[world] = json.loads(Path(out).read_text())
    print()
    print("| gloo ranks | step() with preemption, us | step() without preemption, us | bare all_reduce, us |")
    print("|---:|---:|---:|---:|")
    for world, r in results.items():
        print(f"| {world} | {r['on']:.1f} | {r['off']:.1f} | {r['bare']:.1f} |")
    on = max(r["on"] for r in results.values())
    off = max(r["off"] for r in results.values())
    print(f"step_overhead: {on:.1f} us per step() with preemption, {off:.1f} us without (target 1000)")


if __name__ == "__main__":
    main()
