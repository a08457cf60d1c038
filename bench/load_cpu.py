"""CPU seconds and wall seconds of ``bcp.load``: the rows issue 37 asks about.

* page cache: 1 GiB as 100, 1,000 and 10,000 tensors (``shapes.count_state``), the
  files read through the page cache first, loaded into existing tensors;
* transformer (``shapes.transformer_state``, 948 tensors at 1 GiB): cold (pages
  evicted first) and warm (page cache), every block verified.

CPU seconds (``time.process_time``: every thread of the process) count the work a
load does whatever the machine's other load; wall seconds are printed beside them.
Medians of ``--calls`` calls in one process, after a warm-up call; the last line is

    load_cpu: 10000/100 cpu <r>x wall <r>x

    python bench/load_cpu.py [--gib 1] [--counts 100,1000,10000] [--calls 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # bench/ is not a package
from peers import drop_cache, warm_cache

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def measure(state: dict, uri: str, calls: int, prepare) -> tuple[float, float, int]:
    """(median CPU s, median wall s, requests) of ``bcp.load`` into copies of ``state``."""
    import torch

    import bcp

    dst = {k: torch.zeros_like(v) for k, v in state.items()} if "model" not in state else None
    template = dst if dst is not None else _zeros(state)
    bcp.load(template, uri)  # warm-up: imports, first-touch of the destinations
    cpu, wall, requests = [], [], 0
    for _ in range(calls):
        prepare(uri)
        c0, w0 = time.process_time(), time.perf_counter()
        info = bcp.load_with_info(template, uri)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        requests = info.requests
    flat, got = shapes.flatten(state), shapes.flatten(template)
    if not all(torch.equal(got[k], v) for k, v in flat.items()):
        raise SystemExit(f"load_cpu: the load of {uri} differs from what was saved")
    return statistics.median(cpu), statistics.median(wall), requests


def _zeros(state):
    import torch

    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_zeros(v) for v in state)
    return state


def main() -> None:
    import bcp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--counts", default="100,1000,10000")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bcp-load-cpu-", dir=args.dir)
    rows = []
    try:
        counts = [int(c) for c in args.counts.split(",")]
        for n in counts:
            state = shapes.count_state(int(args.gib * 2**30), n)
            uri = os.path.join(work, f"n{n}")
            bcp.save(state, uri)
            rows.append((f"page cache, {n:,} tensors", *measure(state, uri, args.calls, warm_cache)))
            shutil.rmtree(uri)
        state = shapes.transformer_state(args.gib)
        uri = os.path.join(work, "transformer")
        bcp.save(state, uri)
        n = len(list(shapes.tensors(state)))
        rows.append((f"transformer ({n} tensors), cold", *measure(state, uri, args.calls, drop_cache)))
        rows.append((f"transformer ({n} tensors), warm", *measure(state, uri, args.calls, warm_cache)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.gib:g} GiB; medians of {args.calls} calls; load average {os.getloadavg()[0]:.1f}")
    print("| load | CPU s | wall s | requests |")
    print("|---|---:|---:|---:|")
    for name, cpu, wall, req in rows:
        print(f"| {name} | {cpu:.3f} | {wall:.3f} | {req} |")
    lo, hi = rows[0], rows[len(counts) - 1]
    print(f"load_cpu: {counts[-1]}/{counts[0]} cpu {hi[1] / lo[1]:.2f}x wall {hi[2] / lo[2]:.2f}x")


if __name__ == "__main__":
    main()
