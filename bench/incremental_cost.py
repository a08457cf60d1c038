"""What an incremental save costs on dense training, where every piece changes.

Prints (1) the digest candidates' speed on one buffer (XXH3-128, BLAKE3 on one and
two threads, CRC32C as bcp computes it; the fastest of --repeats), then (2) a full
save against an incremental save whose base differs in every byte (the state is
changed in place before each pair), interleaved (full, incremental, incremental,
full, ...) so the shared disk and CPU treat both alike, for ``bcp.save`` (sync) and
for ``bcp.async_save`` (async: the seconds it blocks the caller, and the whole
save's wall and CPU once waited for): one row each of the medians of wall seconds,
process CPU seconds (all threads) and blocking seconds, their ratios and the bytes
each wrote, and the load average before and after (the machine may be shared).

``--count N`` saves ``N`` 1-D tensors of mixed sizes instead (``bench/shapes.py``
``count_state``: e.g. ``--count 2000 --mib 64``), where the per-tensor costs (plans,
pieces, the base's rows) show rather than the bytes; ``--manager`` saves through a
``CheckpointManager`` (async, its base the step it committed last) against one at
``incremental=False``, the state changed in place between steps.

    python bench/incremental_cost.py [--mib 256] [--tensors 8] [--count N] [--manager] [--rounds 5]
        [--dir /tmp/bcp-incr-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch
import xxhash

import bcp
from bcp.metadata import crc32c


def digest_speeds(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s (10^9) of each candidate over ``nbytes`` random bytes: the fastest of ``repeats``."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    fns = {"xxh3_128": lambda: xxhash.xxh3_128_digest(data), "crc32c": lambda: crc32c(data)}
    try:
        import blake3

        fns["blake3 (1 thread)"] = lambda: blake3.blake3(data).digest()
        fns["blake3 (2 threads)"] = lambda: blake3.blake3(data, max_threads=2).digest()
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--count", type=int, default=0, help="N 1-D tensors of mixed sizes (count_state)")
    ap.add_argument("--manager", action="store_true", help="through CheckpointManagers (async)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bcp-incr-bench")
    args = ap.parse_args()

    for name, gbps in digest_speeds(min(args.mib, 256) << 20, args.repeats).items():
        print(f"digest {name:20s} {gbps:6.1f} GB/s")

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load}, {os.cpu_count()} CPUs")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    if args.count:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from shapes import count_state

        state = count_state(args.mib << 20, args.count)
    else:
        rows = (args.mib << 20) // args.tensors // 4 // 1024
        state = {f"w{i}": torch.randn(rows, 1024) for i in range(args.tensors)}
    try:
        for mode in ("manager",) if args.manager else ("sync", "async"):
            dense_rows(state, args, mode)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def dense_rows(state: dict[str, torch.Tensor], args: argparse.Namespace, mode: str) -> None:
    """Full and incremental saves of ``state``, every byte changed before each pair,
    interleaved; prints the medians (wall, CPU, and for async the blocking seconds)."""
    if mode == "manager":
        manager_rows(state, args)
        return
    base = os.path.join(args.dir, f"{mode}-base")
    bcp.save(state, base, incremental=True)
    samples: dict[str, list[tuple[float, float, float]]] = {"full": [], "incremental": []}
    written: dict[str, int] = {}
    for r in range(args.rounds):
        for t in state.values():
            t.add_(1.0)  # every piece changes
        order = ["full", "incremental"] if r % 2 == 0 else ["incremental", "full"]
        for kind in order:
            uri = os.path.join(args.dir, f"{mode}-{kind}-{r}")
            extra = {} if kind == "full" else {"base": base}
            os.sync()
            wall, cpu = time.perf_counter(), time.process_time()
            if mode == "sync":
                info = bcp.save(state, uri, **extra)  # type: ignore[arg-type]
                blocking = time.perf_counter() - wall
            else:
                handle = bcp.async_save(state, uri, **extra)  # type: ignore[arg-type]
                blocking = handle.blocking_seconds
                info = handle.wait()
            samples[kind].append((time.perf_counter() - wall, time.process_time() - cpu, blocking))
            written[kind] = info.bytes_written
        shutil.rmtree(os.path.join(args.dir, f"{mode}-full-{r}"))
        # the next incremental save's base is this one (its predecessor is no longer needed)
        old, base = base, os.path.join(args.dir, f"{mode}-incremental-{r}")
        shutil.rmtree(old)
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in samples.items()}
    for kind, (w, c, b) in med.items():
        print(
            f"{mode:5s} {kind:12s} wall {w:7.3f} s  cpu {c:7.3f} s  blocking {b:7.3f} s  "
            f"wrote {written[kind] / 2**20:9.1f} MiB"
        )
    inc, full = med["incremental"], med["full"]
    print(
        f"incremental_cost: {mode}, all changed, {args.mib} MiB: time {inc[0] / full[0]:.3f}x, "
        f"cpu {inc[1] / full[1]:.3f}x, blocking {inc[2] / full[2]:.3f}x, "
        f"bytes {written['incremental'] / written['full']:.4f}x"
    )


def manager_rows(state: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
    """Steps through two managers (incremental and not), every byte changed before each
    step, interleaved; medians of each ``save`` call's wall and CPU seconds and of the
    step's whole CPU (its save, then ``wait``)."""
    managers = {
        "full": bcp.CheckpointManager(os.path.join(args.dir, "full"), keep_last=2),
        "incremental": bcp.CheckpointManager(os.path.join(args.dir, "incr"), keep_last=2, incremental=True),
    }
    samples: dict[str, list[tuple[float, float, float]]] = {"full": [], "incremental": []}
    for step in range(args.rounds + 1):
        for t in state.values():
            t.add_(1.0)
        order = ["full", "incremental"] if step % 2 == 0 else ["incremental", "full"]
        for kind in order:
            wall, cpu = time.perf_counter(), time.process_time()
            managers[kind].save(step, state)
            call = (time.perf_counter() - wall, time.process_time() - cpu)
            managers[kind].wait()
            if step:  # the first step has no base
                samples[kind].append((*call, time.process_time() - cpu))
    for m in managers.values():
        m.close()
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in samples.items()}
    for kind, (w, c, whole) in med.items():
        print(f"manager {kind:12s} save() wall {w:7.3f} s  cpu {c:7.3f} s  step cpu (save+wait) {whole:7.3f} s")
    inc, full = med["incremental"], med["full"]
    print(
        f"incremental_cost: manager, all changed, {args.mib} MiB, {len(state)} tensors: "
        f"save() time {inc[0] / full[0]:.3f}x, step cpu {inc[2]:.3f} s against {full[2]:.3f} s "
        f"({inc[2] / full[2]:.3f}x)"
    )


if __name__ == "__main__":
    main()
